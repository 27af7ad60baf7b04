"""Measuring a model's profile on this host (HetPipe §7: "we first profile the DNN model").

Each segment (see :mod:`hetpipe_tf.planning.profile`) runs as a stage of its own, with the
same stage code the executor runs, and its forward and backward times are measured
alone (:func:`hetpipe_tf.runtime.stage.timing.measure_stage_times`). A trivial stage gives
the fixed cost of a task, which is subtracted from every segment, so that a stage of
several segments costs one task overhead plus its segments' compute. Emulated device
types use these host times scaled by dilation / speed, as the emulation itself does, so
they are taken where and as the emulation takes its references: on a cluster's task
(``stage_device``) when the stages will run on tasks, each pass timed on that device
without the RPCs that drive it; a fixed cost per task measured from this process's clock
(about 1 ms a stage here) would steer the cut away from the slow devices, whose paced
tasks hold no such cost.
The time to apply an update is fitted from applies with the real optimizer on weights shaped
like the model's. Profiles are cached as JSON, keyed by model, batch size, optimizer (its class
and settings), host and TensorFlow version; a profile measured while other processes took more
than a quarter of the host's CPU (:mod:`hetpipe_tf.runtime.host_load`) is used but not cached, with
a warning, so that a plan made later on the idle host is not made from a busy host's times.
"""
import contextlib
import hashlib
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TypeAlias

import keras
import numpy as np
import tensorflow as tf

from hetpipe_tf.pipeline.instructions import ApplyUpdate, Backward, Forward
from hetpipe_tf.planning.model_graph import ModelGraph
from hetpipe_tf.planning.profile import AttentionBlock, Profile, SegmentTimes, static_profile
from hetpipe_tf.runtime.host_load import OthersLoad
from hetpipe_tf.runtime.loss_head import LossHead
from hetpipe_tf.runtime.optimizers import check_optimizer, stage_optimizer
from hetpipe_tf.runtime.stage_rewrite import KerasGraph, StagedModel, describe_model, split_model, variable_bytes
from hetpipe_tf.runtime.run_config import LossArgument, RunConfig

from hetpipe_tf.runtime.stage import StageRuntime
from hetpipe_tf.runtime.stage.timing import measure_stage_times
from hetpipe_tf.runtime.virtual_worker import VirtualWorker

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hetpipe_tf", "profiles")
#: Part of every cached profile's name, bumped when what a profile measures changes: profiles
#: cached by an earlier version are not read back (2: applies timed on weights shaped like the model's; 3: a
#: segment per layer call, shared layers' calls apart).
CACHE_VERSION = 3


def host_name() -> str:
    """This host's CPU model (or its processor or machine name), which a cached profile's key names."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fingerprint(graph: ModelGraph) -> str:
    text = "|".join(f"{n.kind}:{n.inputs}:{n.outputs}:{n.trainable_bytes}" for n in graph.nodes)
    text += "|" + "|".join(str(t.shape) for t in graph.tensors)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _optimizer_key(optimizer: keras.optimizers.Optimizer) -> str:
    """The optimizer in a cached profile's name: its class and its settings (momentum, amsgrad,
    weight decay, clipping, ...: what an apply runs), not its name nor its learning rate.

    Returns:
        The key.
    """
    config = {k: v for k, v in optimizer.get_config().items() if k not in ("name", "learning_rate")}
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{type(optimizer).__name__}-{digest}"


def random_minibatch(model: keras.Model, batch_size: int, seed: int = 0) -> tuple["Batch", "Batch"]:
    """A minibatch (x, y) of random inputs and labels shaped for `model` at `batch_size`."""
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(batch_size,) + tuple(t.shape[1:])).astype("float32") for t in model.inputs]
    ys = [rng.integers(0, max(int(t.shape[-1]), 2), size=batch_size) for t in model.outputs]
    return (xs[0] if len(xs) == 1 else xs), (ys[0] if len(ys) == 1 else ys)


def _segment_times(staged: StagedModel, loss: LossArgument, x: "Batch", y: "Batch", device: str,
                   repeats: int) -> list[dict[type, float]]:
    """Solo times of every stage (each the minimum over `repeats` runs)."""
    head = LossHead(loss, staged.keras_graph.model.output_names)
    last = staged.num_stages - 1
    config = RunConfig(num_in_flight=1, optimizer=keras.optimizers.SGD(), loss=loss)
    runtimes = [StageRuntime(stage, device, config, loss_head=head if s == last else None)
                for s, stage in enumerate(staged.stages)]
    try:
        return measure_stage_times(runtimes, staged.split_inputs, x, y, repeats=repeats)
    finally:
        for rt in runtimes:
            rt.close()


def _groupings(n: int) -> list[tuple[int, ...]]:
    """Segment groupings measured besides the singletons: the whole model, halves, quarters."""
    out: list[tuple[int, ...]] = []
    for parts in (1, 2, 4):
        if parts < n:
            cuts = sorted({round(i * n / parts) for i in range(parts)})
            out.append(tuple(cuts))
    return out


def _fit_segments(rows: Sequence[tuple[int, int, float]], n: int) -> tuple[float, tuple[float, ...]]:
    """Non-negative least squares for `stage time = overhead + sum of its segments' costs`.

    `rows` are (first segment, end segment, seconds). Returns (overhead, per-segment costs).

    Returns:
        The pair.
    """
    from scipy.optimize import nnls  # late: slow to load: only profiles that are measured pay

    a = np.zeros((len(rows), n + 1))
    b = np.zeros(len(rows))
    for r, (lo, hi, t) in enumerate(rows):
        a[r, 0] = 1.0
        a[r, 1 + lo:1 + hi] = 1.0
        b[r] = t
    x, _ = nnls(a, b)
    return float(x[0]), tuple(float(v) for v in x[1:])


#: Model inputs or labels: an array, or a list of them for several inputs or outputs.
Batch: TypeAlias = np.ndarray | tf.Tensor | list[np.ndarray | tf.Tensor]


def model_passes(model: keras.Model, loss: str | keras.losses.Loss, x: Batch, y: Batch) -> Callable[[], None]:
    """A call that runs `model`'s forward and backward pass on minibatch (x, y) and returns once
    they are computed. Nothing is applied; the passes update the model's non-trainable state
    (BatchNormalization's moving statistics) as a training step does.

    Returns:
        The call (it returns None).
    """
    loss_fn = keras.losses.get(loss)
    variables = model.trainable_variables

    @tf.function
    def passes(x: Batch, y: Batch) -> tf.Tensor:
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(value, variables)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    return lambda: passes(x, y).numpy()


def timed_calls(run: Callable[[], None], seconds: float) -> tuple[float, float]:
    """(wall seconds per call, this process's CPU seconds per wall second) of calling `run` for at
    least `seconds` (and at least twice).

    Returns:
        (seconds per call, CPU seconds per wall second).
    """
    calls, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    while calls < 2 or time.perf_counter() - wall0 < seconds:
        run()
        calls += 1
    wall = time.perf_counter() - wall0
    return wall / calls, (time.process_time() - cpu0) / wall


#: The most elements of the weights an apply is timed on (those of larger models are shrunk to it).
APPLY_ELEMENTS = 2 ** 22


def _stand_ins(model: keras.Model, elements: int) -> list[keras.Variable]:
    """Zero weights shaped like `model`'s trainable ones, under their paths (what Muon's exclusions
    and weight-decay exclusions by name match): every shape shrunk by one factor, when the model's
    are larger, so that together they hold at most about `elements` (each dimension by the same
    ratio, at least 1: a matrix stays a matrix).

    Returns:
        The weights by path.
    """
    weights = model.trainable_variables
    scale = min(1.0, elements / max(sum(int(np.prod(v.shape)) for v in weights), 1))
    out = []
    for v in weights:
        shape = tuple(max(1, int(d * scale ** (1 / len(v.shape)))) for d in v.shape)
        with contextlib.ExitStack() as scopes:
            for part in v.path.split("/")[:-1]:
                scopes.enter_context(keras.name_scope(part))
            out.append(keras.Variable(np.zeros(shape, np.dtype(v.dtype)), name=v.name))
    return out


def _apply_seconds(optimizer: keras.optimizers.Optimizer, model: keras.Model, device: str, shared: bool,
                   elements: int = APPLY_ELEMENTS, repeats: int = 20) -> tuple[float, float]:
    """(base, per byte) of one optimizer apply on a stage's weights: the base, an apply's own cost
    (timed on one weight of one element); per byte, what an apply on weights shaped like `model`'s
    (:func:`_stand_ins`: its matrices take Muon's Newton-Schulz and Adafactor's factored moments, as a
    stage's do) adds per byte to it. With `shared`, a reference to the weights is held across the
    apply, as a stashed version holds it.

    Returns:
        The pair.
    """
    points = []
    for make in (lambda: [keras.Variable(np.zeros(1, "float32"))], lambda: _stand_ins(model, elements)):
        with tf.device(device):
            variables = make()
            opt = stage_optimizer(optimizer)
            opt.build(variables)
            grads = [tf.ones(v.shape, v.dtype) for v in variables]
            fn = tf.function(lambda g: opt.apply(g, variables), jit_compile=True)
            fn(grads)
            best = float("inf")
            for _ in range(repeats):
                held = [v.value.read_value() for v in variables] if shared else None
                t0 = time.perf_counter()
                fn(grads)
                float(tf.reshape(variables[-1].value, [-1])[0])
                best = min(best, time.perf_counter() - t0)
                del held
        points.append((variable_bytes(variables), best))
    (b0, t0), (b1, t1) = points
    per_byte = max((t1 - t0) / (b1 - b0), 0.0) if b1 > b0 else 0.0
    return max(t0 - per_byte * b0, 0.0), per_byte


def _executor_costs(model: keras.Model, loss: LossArgument, optimizer: keras.optimizers.Optimizer,
                    sample: tuple["Batch", "Batch"], device: str, apply_base: float, apply_per_byte: float,
                    steps: int = 24) -> tuple[float, float, float]:
    """What the executor adds around compute, measured by running `model` for real as a two-stage
    pipeline on two emulated devices (Nm = 2, dilation 2): (seconds per non-compute
    instruction, how much slower an apply is there than alone, the mean time the host takes
    to go on after its emulated device ended a task).

    Returns:
        The triple.
    """
    graph = describe_model(model).graph
    cuts = graph.allowed_cuts() or tuple(range(1, graph.num_nodes))  # else a tied layer is replicated
    vw = VirtualWorker(model, "1,1", num_in_flight=2, boundaries=(0, cuts[len(cuts) // 2]),
                       optimizer=optimizer, loss=loss, dilation=2.0)
    data = [sample] * steps
    vw.train(iter(data[:2]), 2)
    vw.train(iter(data), steps, trace=True)
    events = [e for e in vw.trace.events() if e.get("ph") == "X"]
    compute = {Forward.__name__, Backward.__name__, ApplyUpdate.__name__}
    instruction = float(np.median([e["dur"] for e in events if e["cat"] not in compute])) * 1e-6
    # On its emulated device the last stage's backward pass follows its forward pass once the
    # host, which waited for the device (the loss is read back), has issued it: the gap is how
    # late the host goes on after its device ended a task.
    last = {(e["cat"], e["name"].split("(")[1].split(")")[0].split(",")[0]): e for e in events
            if e["tid"] == len(vw.runtimes) - 1 and e["cat"] in (Forward.__name__, Backward.__name__)}
    late = [(last[(Backward.__name__, p)]["ts"] - f["ts"] - f["dur"]) * 1e-6
            for (kind, p), f in last.items() if kind == Forward.__name__ and (Backward.__name__, p) in last]
    overshoot = max(0.0, float(np.mean(late)))
    ratios = []
    for rt in vw.runtimes:
        applied = [e["dur"] * 1e-6 for e in events if e["cat"] == ApplyUpdate.__name__ and e["tid"] == rt.index]
        alone = apply_base + apply_per_byte * rt.version_bytes
        if applied and alone > 0:
            ratios.append(float(np.median(applied)) / alone)
    return instruction, (max(1.0, float(np.median(ratios))) if ratios else 1.0), overshoot


# keras_hub's transformer blocks (self-attention then a feed-forward layer) and table lookups
# without keras.layers.Embedding among their bases, by class name: keras_hub is optional.
_TRANSFORMER_BLOCKS = ("TransformerEncoder", "TransformerDecoder")
_LOOKUPS = ("PositionEmbedding", "TokenAndPositionEmbedding")


def static_facts(keras_graph: KerasGraph) -> tuple[dict[int, AttentionBlock], tuple[int, ...]]:
    """What the layer graph of a Keras model does not show about its layer calls:
    ({node index: AttentionBlock} of its attention layers, node indices of its table lookups).

    Attention layers: keras_hub's TransformerEncoder and TransformerDecoder (their heads, width
    per head, feed-forward width and dropout) and keras.layers.MultiHeadAttention (alone); table
    lookups: keras.layers.Embedding (and ReversibleEmbedding, a subclass) and keras_hub's position
    embeddings.

    Returns:
        The pair.
    """
    attention: dict[int, AttentionBlock] = {}
    lookups: list[int] = []
    for index, op in enumerate(keras_graph.operations):
        name = type(op).__name__
        if name in _TRANSFORMER_BLOCKS:
            inner = getattr(op, "_self_attention_layer", None)
            hidden = keras_graph.graph.tensors[keras_graph.graph.nodes[index].outputs[0]].shape[-1]
            attention[index] = AttentionBlock(
                heads=op.num_heads, head_dim=getattr(inner, "key_dim", None) or hidden // op.num_heads,
                feedforward=op.intermediate_dim, dropout=bool(op.dropout))
        elif isinstance(op, keras.layers.MultiHeadAttention):
            attention[index] = AttentionBlock(heads=op.num_heads, head_dim=op.key_dim, dropout=bool(op.dropout))
        elif isinstance(op, keras.layers.Embedding) or name in _LOOKUPS:
            lookups.append(index)
    return attention, tuple(lookups)


def model_profile(model: keras.Model, batch_size: int, sequence_length: int | None = None) -> Profile:
    """The static profile of a Keras model at `batch_size` (no times), with what its graph does
    not show (:func:`static_facts`): at `sequence_length`, every unknown dimension of its
    tensors (a transformer's sequence) is that long.

    Returns:
        The profile.
    """
    described = describe_model(model)
    graph = described.graph if sequence_length is None else described.graph.at_sequence_length(sequence_length)
    attention, lookups = static_facts(described)
    return static_profile(graph, batch_size, attention=attention, lookups=lookups)


def measure_transfers(src: str, dst: str, sizes: Sequence[int] = (2 ** 16, 2 ** 20, 2 ** 23, 2 ** 25),
                      repeats: int = 5) -> list[tuple[int, float]]:
    """The synthetic transfer benchmark of §7: (bytes, seconds) for moving float32 tensors of
    `sizes` elements from device `src` to `dst` (the least time of `repeats` each).

    Returns:
        The (bytes, seconds) pairs.
    """
    samples = []
    for n in sizes:
        with tf.device(src):
            x = tf.random.uniform((n,))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            with tf.device(dst):
                y = tf.identity(x) + 0.0  # lands on dst and is written there
            float(y[0])
            best = min(best, time.perf_counter() - t0)
        samples.append((4 * n, best))
    return samples


def measure_profile(model: keras.Model, batch_size: int, loss: LossArgument = "sparse_categorical_crossentropy",
                    optimizer: keras.optimizers.Optimizer | str = "sgd", sample: tuple["Batch", "Batch"] | None = None,
                    device: str = "/device:CPU:0", repeats: int = 7, cache_dir: str | None = DEFAULT_CACHE_DIR,
                    stage_device: str | None = None) -> Profile:
    """The profile of `model` at `batch_size`, with times measured on `device` of this host.

    Times go under the key ``"host"``. `stage_device`: where the segments' passes are timed
    instead (a cluster task's CPU, for stages that will run on tasks); applies and the
    executor's costs stay measured on `device`. With `cache_dir`, a profile measured before
    for the same model graph, batch size, optimizer, host and stage device is read back instead,
    and a profile measured on a busy host is not kept (see the module docstring).

    Args:
        model: the Keras model.
        batch_size: the minibatch size.
        loss: the loss the passes compute.
        optimizer: the optimizer whose applies are timed (an instance or a name).
        sample: a minibatch (x, y) to time on (None: random data of the model's input shapes).
        device: the TensorFlow device the passes are timed on.
        repeats: how many times each pass is timed (the least is kept).
        cache_dir: where measured profiles are kept and read back (None: no cache).
        stage_device: where the segments' passes are timed instead (a cluster task's CPU).

    Returns:
        The Profile, its times under ``"host"``.
    """
    keras_graph = describe_model(model)  # a subclassed model's: its trace, with inputs and outputs
    graph = keras_graph.graph
    base = model_profile(model, batch_size)
    optimizer = check_optimizer(optimizer)
    host = hashlib.sha1(host_name().encode()).hexdigest()[:8]
    key = (f"v{CACHE_VERSION}-{graph.name}-{_fingerprint(graph)}-b{batch_size}-{_optimizer_key(optimizer)}-{host}"
           f"-tf{tf.__version__}")
    timed_on = stage_device or device
    if stage_device:
        key += "-stages-" + hashlib.sha1(stage_device.encode()).hexdigest()[:8]
    path = os.path.join(cache_dir, key + ".json") if cache_dir else None
    if path and os.path.exists(path):
        measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(path)))
        print(f"hetpipe: the model's profile measured on {measured} is read from {path} (delete it to measure "
              f"again)", file=sys.stderr, flush=True)
        with open(path) as f:
            return Profile.from_json(f.read())
    with OthersLoad() as load:
        x, y = sample if sample is not None else random_minibatch(keras_graph.model, batch_size)
        n = base.num_segments
        rows: dict[type, list[tuple[int, int, float]]] = {Forward: [], Backward: []}
        for grouping in [tuple(range(n))] + _groupings(n):
            starts = tuple(base.starts[i] for i in grouping)
            staged = split_model(model, boundaries=starts, devices=[timed_on] * len(starts))
            ends = grouping[1:] + (n,)
            for (lo, hi), measured in zip(zip(grouping, ends), _segment_times(staged, loss, x, y, timed_on, repeats)):
                for kind in rows:
                    rows[kind].append((lo, hi, measured[kind]))
        f_overhead, forward = _fit_segments(rows[Forward], n)
        b_overhead, backward = _fit_segments(rows[Backward], n)
        times = SegmentTimes(forward=forward, backward=backward, forward_overhead=f_overhead,
                             backward_overhead=b_overhead,
                             source=f"measured on {host_name()} ({timed_on}), batch {batch_size}")
        apply_base, apply_per_byte = _apply_seconds(optimizer, model, device, shared=False)
        _, shared_per_byte = _apply_seconds(optimizer, model, device, shared=True)
        weights = [v.numpy() for v in model.weights]
        instruction, slower, overshoot = _executor_costs(model, loss, optimizer, (x, y), device, apply_base,
                                                         shared_per_byte)
        for v, w in zip(model.weights, weights):
            v.assign(w)  # the probe run trained the model a little: undo it
        profile = base.with_times("host", times).with_costs(
            apply_base=apply_base * slower, apply_per_byte=apply_per_byte * slower,
            apply_shared_per_byte=shared_per_byte * slower, instruction_seconds=instruction,
            pacing_overshoot_seconds=overshoot)
    if load.busy:
        warnings.warn(f"the model was profiled on a busy host ({load.describe()} while it was timed): its times "
                      f"are slower than the host is, and the plan made from them is a plan for a busier host; "
                      f"the profile is not cached: profile again with the host otherwise idle", stacklevel=2)
    elif path:
        os.makedirs(cache_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(profile.to_json())
    return profile
