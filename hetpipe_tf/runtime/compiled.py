"""Compiled calls: one graph function per task shape, called with flat tensors.

A stage's work on one minibatch is a few instructions (HetPipe §4: a forward task, a
backward task with the update and the next stash). :class:`CompiledCall` traces the graph
of such a run once and then calls it the way ``tf.function`` itself calls a traced
function, skipping the per-call Python of ``tf.function``'s dispatch (argument binding,
the trace cache's key, tape checks), which costs several times what running a small
stage does: one call is one kernel launch sequence on the stage's device, and one RPC
when that device is another task's.

:class:`SplitPass` is a differentiable function whose forward and backward passes run
in two separate calls, as a pipeline stage needs (the backward pass of minibatch p comes
tasks later, §4): the forward call returns the pass's outputs and the intermediate
tensors the backward pass needs (what an eager ``GradientTape`` would keep), and the
backward pass is a graph function that later calls take in, with the update that follows
it. Both are TensorFlow's own: the forward and backward functions TensorFlow builds when
a tape watches a ``tf.function`` call (``_FirstOrderTapeGradientFunctions``, written
against TensorFlow 2.21, whose version :mod:`hetpipe_tf.ops.loader` checks), so the
gradients are exactly those of ``tf.GradientTape``.
"""
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hetpipe_tf.compat import concrete_function as _concrete
from hetpipe_tf.compat import flat_caller
from hetpipe_tf.ops.first_calls import FIRST_CALLS, FirstCallLocked


_traced = [0]  # graph functions traced so far (under FIRST_CALLS)


def traces_made() -> int:
    """How many graph functions this process's compiled calls and split passes have traced: a
    stage traces each shape of task once, on its first call, and keeps it for every later
    ``fit``, ``train`` or ``evaluate`` of its virtual worker."""
    return _traced[0]


def batch_relaxed(spec: tf.TensorSpec) -> tf.TensorSpec:
    """`spec` with an unknown first dimension: one trace serves every minibatch size."""
    if spec.shape.rank:
        return tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype)
    return spec


def spec_of(value, relax_batch: bool = False):
    """The (nested) TensorSpec of `value`, its first dimension unknown with `relax_batch`."""
    def one(t: Any) -> Any:
        spec = tf.type_spec_from_value(t)
        return batch_relaxed(spec) if relax_batch and isinstance(spec, tf.TensorSpec) else spec
    return tf.nest.map_structure(one, value)


def packer(structure) -> Callable:
    """A function that rebuilds `structure` (nested lists, tuples and dicts of tensors and
    ``tf.IndexedSlices``, as a traced function's outputs are) from an iterator over its flat
    components in ``tf.nest.flatten(..., expand_composites=True)`` order: the same result as
    ``tf.nest.pack_sequence_as``, without its per-call Python walk of the structure."""
    if isinstance(structure, (list, tuple)):
        parts, kind = [packer(item) for item in structure], type(structure)
        return lambda flat: kind([part(flat) for part in parts])
    if isinstance(structure, dict):
        keys = sorted(structure)  # tf.nest's order
        parts = [packer(structure[k]) for k in keys]
        return lambda flat: {k: part(flat) for k, part in zip(keys, parts)}
    if isinstance(structure, tf.IndexedSlices):
        if structure.dense_shape is None:
            return lambda flat: tf.IndexedSlices(next(flat), next(flat))
        return lambda flat: tf.IndexedSlices(next(flat), next(flat), next(flat))
    return lambda flat: next(flat)


class CompiledCall:
    """`fn`, traced once on `device` for the specs of its first call's arguments, then called
    with the arguments' flat tensors (nested lists, tuples and dicts of tensors, composite
    tensors such as ``tf.IndexedSlices`` included). Every later call must have the same
    structure and dtypes, and shapes that fit the specs (`specs`, when given, else those of
    the first call's values, with an unknown first dimension where `relax_batch` says)."""

    def __init__(self, fn: Callable, device: str | None, name: str, jit_compile: bool = False):
        self._fn = fn
        self.device = device
        self.name = name
        self._jit = jit_compile
        self._call = None

    def trace(self, specs) -> None:
        """Traces the graph for arguments of `specs` (a tuple, one nested spec per argument),
        holding :data:`hetpipe_tf.ops.first_calls.FIRST_CALLS`, as its first run does."""
        with FIRST_CALLS, tf.device(self.device):
            concrete = tf.function(self._fn, jit_compile=self._jit, autograph=False).get_concrete_function(*specs)
            _traced[0] += 1
        call_flat, captured = flat_caller(concrete._inference_function), list(concrete.captured_inputs)
        pack = packer(concrete.structured_outputs)
        device = self.device

        def call(flat: list[Any]) -> Any:
            with tf.device(device):
                out = call_flat(flat + captured)
            return pack(iter(out or ()))

        self._call = FirstCallLocked(call)  # its first run instantiates it

    def __call__(self, *args: Any) -> Any:
        if self._call is None:
            self.trace(tuple(spec_of(a) for a in args))
        return self._call(tf.nest.flatten(args, expand_composites=True))


class SplitPass:
    """A differentiable graph function ``fn(*inputs) -> list of tensors`` run as a forward call
    and a later backward pass (see the module docstring).

    :meth:`forward` returns the outputs and a record (every output of TensorFlow's forward
    function: the outputs, then the intermediates the backward pass reads); :meth:`backward`,
    called while tracing another graph function, maps the gradients of the outputs and such a
    record to the gradients of `fn`'s inputs (zeros for an input that does not reach them).
    Traced once on `device` for `specs`."""

    def __init__(self, fn: Callable, specs: Sequence, device: str | None, name: str):
        self.name = name
        self.device = device
        with FIRST_CALLS:  # every graph function of the pass is made here
            with tf.device(device):
                concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
            _traced[0] += 1
            self.num_outputs = len(concrete.outputs)
            self._num_inputs = len(tf.nest.flatten(specs, expand_composites=True))
            self._captured = list(concrete.captured_inputs)  # before the tape's functions capture more
            self._functions = _concrete._FirstOrderTapeGradientFunctions(
                concrete._func_graph, concrete._attrs, concrete._garbage_collector, forwardprop_input_indices=(),
                delayed_rewrite_functions=concrete._delayed_rewrite_functions, need_gradients_for_jvps=False)
            self._forward = self._functions.forward([], [])  # the arguments matter only to forward-mode jvps
        self._run_forward = FirstCallLocked(self._forward.call_flat)  # its first run instantiates it
        #: The specs of a record (unknown dimensions where the inputs' specs have them).
        self.record_specs = [tf.TensorSpec(t.shape, t.dtype) for t in self._functions._forward_graph.outputs]

    def forward(self, *inputs: Any) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """(outputs, record) of the forward pass on `inputs`: run now on the device, or added to the
        graph function being traced."""
        flat = tf.nest.flatten(inputs, expand_composites=True)
        with tf.device(self.device):
            if tf.inside_function():  # added to the graph being traced (under FIRST_CALLS)
                record = self._forward.call_flat(*flat, *self._captured)
            else:
                record = self._run_forward(*flat, *self._captured)
        return list(record[:self.num_outputs]), list(record)

    def backward(self, output_gradients: Sequence, record: Sequence, inputs: Sequence) -> list:
        """Inside a graph function being traced: the gradients of the pass's flat `inputs` (the
        tensors it was given: zeros like them where an input does not reach the outputs) from
        `output_gradients` (one per output; None for an output that gets none) and the forward
        call's `record`."""
        wrapper, _ = self._functions._wrap_backward_function(self._functions._forward_graph,
                                                             self._functions._backward, list(record))
        grads = wrapper(*output_gradients)
        grads = list(grads)[:self._num_inputs] if grads is not None else [None] * self._num_inputs
        return [g if g is not None else tf.zeros_like(x) for g, x in zip(grads, inputs)]
