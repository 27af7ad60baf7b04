"""Each stage's forward and backward time measured alone, one stage at a time: the references
of emulated devices (a task of speed v takes ``dilation / v`` times its reference) and the
profile's segment times (HetPipe §7)."""
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from hetpipe_tf.pipeline.instructions import Backward, Forward, ReleaseWeights, StashWeights
from hetpipe_tf.runtime.stage.passes import Nest
from hetpipe_tf.runtime.stage.runtime import StageRuntime
from hetpipe_tf.runtime.stage.weights import is_remote


def _block(tensors: Nest) -> None:
    """Waits until `tensors` are computed (GPU kernels run asynchronously)."""
    for t in tf.nest.flatten(tensors):
        if hasattr(t, "device") and "GPU" in t.device:
            np.asarray(tf.reshape(t, [-1])[:1])
            return


def _moved(tensors: Nest, device: str) -> Nest:
    """`tensors` (any structure; None entries kept) copied onto `device`, there when this returns."""
    with tf.device(device):
        moved = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), tensors)
    for t in tf.nest.flatten(moved):
        if t is not None:
            np.asarray(tf.reshape(t, [-1])[:1])
    return moved


def measure_stage_times(runtimes: Sequence[StageRuntime], split_inputs: Callable[[Nest], dict[int, list]], x: Nest,
                        y: Nest, repeats: int = 7) -> list[dict[type, float]]:
    """Each stage's forward and backward time, measured alone, one stage at a time.

    Runs minibatch (x, y) through the chain of `runtimes` (id 0, the weights as they
    are) `repeats` + 1 times; the first run traces the functions, and the minimum of the
    others is the result (interference from other work only ever adds time): a list
    with, per stage, {Forward: seconds, Backward: seconds}. A stage on a cluster's device
    (a task's, not this process's ``localhost``) is timed on that device
    (:meth:`StageRuntime.timed_solo_pass`): timed from here, its passes would also hold the
    RPCs that drive them, which pacing (``dilation / speed x`` this time) would then dilate as
    if they were compute. For the same reason what a stage receives (the previous stage's
    activations, the next one's gradients, inputs and labels) is on its device before its pass
    is timed: moving it is communication, which the emulation does not pad.
    Nothing is applied, and the stages' non-trainable state is restored afterwards.
    """
    times = [{Forward: [], Backward: []} for _ in runtimes]
    on_device = [{Forward: [], Backward: []} if is_remote(rt.device) else None for rt in runtimes]
    saved = [[v.numpy() for v in rt.non_trainable] for rt in runtimes]  # copies, not the variables
    for _ in range(repeats + 1):
        for rt in runtimes:
            rt.run((StashWeights(0),))
        loaded = split_inputs(x)
        carry = None
        for s, rt in enumerate(runtimes):
            if carry is not None:
                rt.set_received(0, _moved(carry, rt.device))
            if s in loaded:
                rt.set_loaded(0, _moved(loaded[s], rt.device))
            if rt.is_last:
                rt.set_labels(0, _moved(y, rt.device))
            if on_device[s] is not None:
                with rt.execution_scope():
                    forward, backward = rt.timed_solo_pass(0)
                on_device[s][Forward].append(forward)
                on_device[s][Backward].append(backward)
            t0 = time.perf_counter()
            with rt.execution_scope():
                rt.run((Forward(0),))
                carry = None if rt.is_last else rt.sent(0)
                _block(carry if carry is not None else rt.logs[0])
            times[s][Forward].append(time.perf_counter() - t0)
        grads = None
        for s in reversed(range(len(runtimes))):
            rt = runtimes[s]
            if grads is not None:
                rt.set_output_gradients(0, _moved(grads, rt.device))
            t0 = time.perf_counter()
            with rt.execution_scope():
                rt.run((Backward(0),))
                _block(rt.weight_gradients(0))
            times[s][Backward].append(time.perf_counter() - t0)
            grads = rt.input_gradients(0) if rt.stage.io.received else None
            rt.run((ReleaseWeights(0),))
        runtimes[-1].logs.pop(0, None)
    for rt, values in zip(runtimes, saved):
        for v, value in zip(rt.non_trainable, values):
            v.assign(value)
        if rt.provenance:
            rt.provenance.used_versions.pop(0, None)
    return [{kind: min(ts[1:]) for kind, ts in (device or stage).items()} for stage, device in zip(times, on_device)]
