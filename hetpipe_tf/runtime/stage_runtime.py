"""One pipeline stage on its device: weights, optimizer, weight stash, minibatches in flight.

The stage's live weights w_local, its optimizer copy and its weight stash are
placed on the stage's device (``tf.device``). The rules of HetPipe §4 are
carried out by the schedule's instructions; this class is what the device
instructions (:data:`DEVICE_INSTRUCTIONS`) do to the stage:

* ``StashWeights(p)``: w_p := w_local, kept in the C++ weight stash;
* ``Forward(p)``: runs the stage on minibatch p with w_p and keeps what its backward
  pass needs (the pass's intermediate tensors; the backward pass does not recompute
  them); ``live``: with the live weights instead of a stashed version; ``recompute``:
  keeps only the pass's inputs, for ``Recompute(p)``, the same pass again with the live
  weights (GPipe's re-materialisation; NaivePipe's backward against the live weights);
* ``Backward(p)``: gradients of p against the weights its pass used (w_p);
* ``CompensateGradient(p)``: TaylorPipe's delay compensation (TaylorPipe §3.2) of p's
  weight gradient g, computed against w_p: g := g + λ·g⊙g⊙(w_local − w_p);
* ``ApplyUpdate(p)``: w_local := w_local + u_p with the stage's optimizer;
* ``AccumulateGradient(p)`` and ``ApplyAccumulated(first, p)``: GPipe's sum of
  microbatch gradients, and one update from their mean at the flush;
* ``ReleaseWeights(p)``: drops w_p.

**One call per task.** The device instructions of one task (:meth:`StageRuntime.run`: on the
last stage a minibatch's forward pass, backward pass, release, update and the next stash;
on the others a forward task, and a backward task with the update and the next stash) run
as one compiled graph function on the stage's device
(:class:`hetpipe_tf.runtime.compiled.CompiledCall`), traced once for each shape of task (the
instruction types and the minibatch offsets between them) and called with the minibatch
ids as a tensor. A forward pass whose backward pass comes in a later task runs as
TensorFlow's forward function of the pass, which also returns the intermediates that the
later backward call takes in (:class:`hetpipe_tf.runtime.compiled.SplitPass`).

**Non-finite minibatches.** Nothing reads a value back to the host on the way: the loss is
logged as a tensor, and each update is applied only if its verdict says the minibatch is
finite. A minibatch's verdict (an int32: :data:`FINITE`, or which stage's loss or weight
gradient was not finite, :func:`verdict_code`) travels upstream with its gradient
(``SendGradient`` sends both), each stage combining it with its own gradient, so a loss or
gradient that is NaN or infinite on one stage stops the update of that minibatch on that
stage and every stage before it (they apply after it, §4); nothing of it reaches their
w_local, so nothing of it can be pushed to the parameter servers. The verdicts are read
back before the stage's next task (:meth:`StageRuntime.check_applied`, which the executor
also calls before anything reads the weights: a push, a snapshot, the end of the run), and
a non-finite one raises :class:`NonFiniteError` naming the minibatch and the stage where the
loss or gradient went bad.
"""
import contextlib
import functools
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.ops.weight_stash import WeightStash
from hetpipe_tf.pipeline.emulation import MemoryAccount
from hetpipe_tf.pipeline.instructions import (
    AccumulateGradient, ApplyAccumulated, ApplyUpdate, Backward, CompensateGradient, Forward, Recompute,
    ReleaseWeights, StashWeights)
from hetpipe_tf.pipeline.schedule import NO_SYNC, NO_WORKER_UPDATE
from hetpipe_tf.runtime.compiled import CompiledCall, SplitPass, spec_of
from hetpipe_tf.runtime.optimizers import stage_optimizer
from hetpipe_tf.runtime.provenance import Provenance
from hetpipe_tf.runtime.update_terms import ScaleState, clip_factor, clipped, squared_norm
from hetpipe_tf.runtime.stage_rewrite import variable_bytes
from hetpipe_tf.sync.parameter_server import synchronised_variables

#: The instructions a stage runtime carries out on its device (:meth:`StageRuntime.run`).
DEVICE_INSTRUCTIONS = frozenset({Forward, Recompute, Backward, CompensateGradient, ReleaseWeights, ApplyUpdate,
                                 AccumulateGradient, ApplyAccumulated, StashWeights})
#: The weight elements from which a stage's update runs compiled by XLA (see docs/performance.md).
_XLA_APPLY_ELEMENTS = 1 << 20
#: A minibatch's verdict: finite so far.
FINITE = -1
#: How many verdicts a stage keeps unread at most. The first stage reads each before it reports
#: the minibatch done; every stage reads them before a push, a snapshot and the end of a run.
_UNCHECKED = 64


def verdict_code(stage, loss, variable=0):
    """The verdict of a minibatch whose loss (`loss`, on the last stage `stage`) or weight gradient
    on `stage` was not finite, first in its weight `variable`: ``variable << 17 | stage << 1 | loss``."""
    return variable << 17 | stage << 1 | int(loss)


def read_verdict(code):
    """(stage, loss, variable) of a verdict that is not :data:`FINITE` (see :func:`verdict_code`)."""
    return (code >> 1) & 0xFFFF, bool(code & 1), code >> 17


def _copy(variable, trainable):
    """A new variable with `variable`'s value, dtype, name and path (what optimizers match their
    settings against, such as AdamW's exclude_from_weight_decay), on the current device."""
    with contextlib.ExitStack() as stack:
        for part in variable.path.split("/")[:-1]:
            stack.enter_context(keras.name_scope(part))
        # From a value (numpy): given a tf.Variable, keras.Variable would reuse it.
        return keras.Variable(variable.numpy(), dtype=variable.dtype, trainable=trainable, name=variable.name)


def is_remote(device):
    """Whether `device` belongs to a task of a cluster rather than to this process."""
    job = tf.DeviceSpec.from_string(device or "").job
    return job not in (None, "localhost")


def _scaled(g, scale):
    """Gradient `g` with `scale` applied to its values (an IndexedSlices stays one)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(scale(g.values), g.indices, g.dense_shape)
    return scale(g)


def _in_order(entering):
    """The tensors a pass enters with, from {position: tensor}, in position order."""
    return [entering[i] for i in range(len(entering))]


def _is_float(t):
    """Whether a tensor holds floating-point values."""
    return tf.as_dtype(t.dtype).is_floating


def _combined(code, bad, own):
    """The verdict after a check: `code` if a later stage (or an earlier microbatch) already went
    bad, else `own` where `bad`."""
    return tf.where(code != FINITE, code, tf.where(bad, own, code))


def _checked_gradient(code, grads, stage):
    """`code` after checking the weight gradients `grads` of `stage` (an IndexedSlices' values):
    a gradient holds a NaN or an infinity exactly when its sum is not finite, but for a sum of
    finite values past the float's range, which is taken as not finite too."""
    if not grads:
        return code
    finite = tf.math.is_finite(tf.stack([tf.reduce_sum(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g,
                                                              tf.float32)) for g in grads]))
    first_bad = tf.cast(tf.argmin(tf.cast(finite, tf.int32)), tf.int32)
    own = first_bad * (1 << 17) + verdict_code(stage, loss=False)
    return _combined(code, tf.logical_not(tf.reduce_all(finite)), own)


class NonFiniteError(FloatingPointError):
    """A minibatch's loss or gradient is NaN or infinite; nothing of that minibatch was applied.

    `stage` is the stage where the loss or gradient went bad; `logs` holds the minibatch's
    loss and metrics when the loss was not finite (for ``keras.callbacks.TerminateOnNaN``),
    else None."""

    def __init__(self, message, minibatch, stage, logs=None):
        super().__init__(message)
        self.minibatch = minibatch
        self.stage = stage
        self.logs = logs


@dataclass(frozen=True)
class StageState:
    """A stage's state right after some update: what a checkpoint or evaluation needs.
    `applied`: the minibatches whose updates it holds; `sync`: the synchronisation scheme's
    snapshot of its stage state; `provenance`: the record's snapshot, when recording it
    (:class:`hetpipe_tf.runtime.provenance.Provenance`)."""
    trainable: list
    non_trainable: list
    optimizer: list
    applied: tuple = ()
    sync: object = None
    provenance: tuple = None


def _task_shape(instructions):
    """(first minibatch, shape): the shape of a run of device instructions is what its compiled
    call depends on, the same for every minibatch: each instruction's type, its minibatch's
    offset from the first, and its fixed fields."""
    base = instructions[0].minibatch
    shape = []
    for ins in instructions:
        fixed = ()
        if isinstance(ins, Forward):
            fixed = (ins.live, ins.recompute)
        elif isinstance(ins, CompensateGradient):
            fixed = (ins.variance_control,)
        elif isinstance(ins, ApplyAccumulated):
            fixed = (ins.first - base,)
        shape.append((type(ins), ins.minibatch - base, fixed))
    return base, tuple(shape)


class _Trace:
    """What one compiled task's graph holds while it is traced: minibatch ids by offset, the
    inputs by key, each pass's tape or record, each minibatch's gradients and verdict, the
    running sum of microbatch gradients, and the outputs by key."""

    def __init__(self, offsets, base, inputs, terms_at):
        self.id = {o: base + o for o in offsets}
        self.inputs = inputs
        self.terms_at = terms_at  # offsets whose update terms this call makes (first stage)
        self.taped = {}  # offset -> (tape, sources, number of received sources, targets, regularisation)
        self.grads = {}  # offset -> (weight gradients, verdict)
        self.terms = {}  # offset -> the update terms of the minibatch (hetpipe_tf.runtime.update_terms)
        self.scales = {}  # offset -> the loss scale S_p the minibatch's loss was multiplied by
        self.acc = inputs.get(("acc", 0))
        self.outputs = {}


class _Task:
    """One shape of task (:func:`_task_shape`) compiled for a stage: which inputs the call takes
    (keys such as ("entering", offset)), which outputs it gives, and its compiled call."""

    def __init__(self, runtime, shape, accumulating):
        self.shape = shape
        self.offsets = sorted({o for _, o, _ in shape})
        kinds = [(t, o) for t, o, _ in shape]
        forwards = {o for t, o in kinds if t in (Forward, Recompute)}
        backwards = {o for t, o in kinds if t is Backward}
        # The first stage makes a minibatch's update terms where its backward pass and update run together.
        self.terms_at = {o for t, o in kinds if t is ApplyUpdate and o in backwards} if runtime.makes_terms else set()
        keys = []
        for t, o, fixed in shape:
            if t is Forward:
                keys += [("entering", o)] + ([("labels", o)] if runtime.is_last else [])
            elif t is Recompute:
                keys.append(("kept", o))
            elif t is Backward:
                if not runtime.is_last:
                    keys.append(("out_grads", o))
                if o not in forwards:
                    keys.append(("record", o))
                if o in self.terms_at and runtime.tied_sources:
                    keys.append(("tied_in", o))
            elif t in (CompensateGradient, ApplyUpdate, AccumulateGradient) and o not in backwards:
                keys.append(("weight_grads", o))
            if t is ApplyUpdate and runtime.takes_terms and o not in backwards:
                keys.append(("terms", o))
        if accumulating:
            keys.append(("acc", 0))
        self.inputs = list(dict.fromkeys(keys))
        # A pass is taped in the graph when its backward pass runs in the same call; else split.
        self.in_graph = forwards & backwards
        self.call = CompiledCall(functools.partial(runtime._task_graph, self), runtime.device,
                                 name=f"stage{runtime.index}_task")
        self.outputs = None  # output keys, known once traced

    def gather(self, runtime, base):
        """The call's arguments: the first minibatch's id, then the inputs, taken from the runtime;
        traces the call at its first use."""
        args = [runtime._minibatch_id(base)]
        for kind, o in self.inputs:
            args.append(runtime._take(kind, base + o))
        if self.outputs is None:
            self.call.trace(tuple([spec_of(args[0])] + [runtime._input_spec(kind, value)
                                                        for (kind, _), value in zip(self.inputs, args[1:])]))
        return args


#: The compiled tasks' outputs a stage keeps per minibatch: output kind -> the dict that holds them.
_KEPT_BY_MINIBATCH = {"sent": "_sent", "logs": "logs", "record": "_inflight", "input_grads": "_input_grads",
                      "tied": "_tied_out", "terms": "_terms", "applied_terms": "applied_terms",
                      "weight_grads": "_weight_grads"}


class StageRuntime:
    """One stage of a virtual worker on its device (see the module docstring)."""

    #: What :meth:`run` carries out (the executor groups a task's consecutive ones into one call).
    device_instructions = DEVICE_INSTRUCTIONS

    def __init__(self, stage, device, config, loss_head=None, memory=None, activation_bytes=0, sync=NO_SYNC,
                 variable_paths=None, worker_update=NO_WORKER_UPDATE, ties=()):
        self.stage = stage
        self.index = stage.index
        #: The weights' paths of every stage of the virtual worker (for messages naming them).
        self.variable_paths = variable_paths or {stage.index: [v.path for v in stage.trainable_variables]}
        self.device = device
        self.loss_head = loss_head
        self.memory = memory or MemoryAccount(device)
        self.activation_bytes = int(activation_bytes)
        #: Which updates each weight version held, when the run records it (None: it does not).
        self.provenance = Provenance() if config.record_provenance else None
        self.single_threaded = config.single_threaded_stages
        with tf.device(device):
            self.trainable = [_copy(v, trainable=True) for v in stage.trainable_variables]
            self.non_trainable = [_copy(v, trainable=False) for v in stage.non_trainable_variables]
            self.optimizer = stage_optimizer(config.optimizer, stage.trainable_variables, self.trainable)
            self.optimizer.build(self.trainable)
        self.stash = WeightStash(config.num_in_flight, device=device, name=f"stage{self.index}")
        self._dtypes = [v.dtype for v in self.trainable]
        # What the run's updates take from every stage (hetpipe_tf.runtime.update_terms): the first
        # stage makes the terms, the stages in worker_update.waiting take them; `ties` are the run's
        # trainable TiedVariables, whose replicas apply their summed gradient.
        self.rule = config.update_rule
        self.makes_terms = self.index == 0 and (bool(self.rule) or bool(worker_update))
        self.takes_terms = self.index in worker_update.waiting
        self.tied_positions = [(g, pos) for g, tie in enumerate(ties) for st, pos in tie.replicas if st == self.index]
        self.tied_sources = tuple(worker_update.tied) if self.index == 0 else ()
        self._ties = ties
        self.scale_state = None
        if self.rule.loss_scaling is not None:
            with tf.device(device):
                if self.index == 0:
                    self.scale_state = ScaleState(self.rule.loss_scaling)
                if self.is_last:
                    self.loss_scale = self.scale_state.scale if self.index == 0 else keras.Variable(
                        self.rule.loss_scaling.initial_scale, dtype="float32", trainable=False, name="loss_scale")
        self.version_bytes = variable_bytes(self.trainable)
        self.memory.allocate("weights", self.version_bytes + variable_bytes(self.non_trainable))
        self.memory.allocate("optimizer slots", variable_bytes(self.optimizer.variables))
        # What the synchronisation scheme exchanges with the other virtual workers, in the same
        # order as their paths (the keys of the parameter servers).
        self.synchronised = synchronised_variables(self.trainable, self.non_trainable)
        self.synchronised_paths = [v.path for v in synchronised_variables(stage.trainable_variables,
                                                                          stage.non_trainable_variables)]
        # A tied weight's replica on a later stage is pushed by the first stage holding one only
        # (the servers hold one copy); every replica pulls and merges, so all stay equal.
        followers = {pos for tie in ties for st, pos in tie.replicas if st == self.index and st != tie.replicas[0][0]}
        self._pushed = [i for i in range(len(self.synchronised)) if i not in followers]
        if sync.weight_copies:
            self.memory.allocate("synchronisation copies", sync.weight_copies * variable_bytes(self.synchronised))
        # The weight and synchronisation bookkeeping, each one call (on another task's device
        # one RPC, not one per variable and op). Partials, not methods or lambdas: TensorFlow
        # keys its retracing warning on a function's code, which every stage would share.
        self._read_synchronised_fn = FirstCallLocked(tf.function(functools.partial(self._read_synchronised_graph)))
        self._add_to_weights_fn = FirstCallLocked(tf.function(functools.partial(self._add_to_weights_graph)))
        self._merge_fn = FirstCallLocked(tf.function(functools.partial(self._merge_graph)))
        self._change_fn = FirstCallLocked(tf.function(functools.partial(self._synchronised_change_graph)))
        self._subtract_fn = FirstCallLocked(tf.function(functools.partial(_subtract_graph)))
        self._sum_fn = FirstCallLocked(tf.function(functools.partial(_sum_graph)))
        self._timed_pass_fn = FirstCallLocked(tf.function(functools.partial(self._timed_pass_graph)))
        # XLA fuses the optimizer's elementwise update, which pays once a stage's weights are large
        # (_XLA_APPLY_ELEMENTS); below that its launch costs more than the update. It copies a
        # variable's buffer that a stashed version still shares, as eager updates do. Not on
        # another task's device: TF 2.21's remote eager runtime then fails the next eager op
        # ("KernelAndDeviceOp does not support EagerFunctionParams"). Always with single-threaded
        # stages: the update's conditional (a functional If) then runs inside XLA's cluster, as TF
        # 2.21's single-threaded executor deadlocks two stages that run an If at once.
        elements = sum(int(np.prod(v.shape)) for v in self.trainable)
        if (elements >= _XLA_APPLY_ELEMENTS or self.single_threaded) and not is_remote(device):
            self._apply_fn = FirstCallLocked(tf.function(functools.partial(self._apply_graph), jit_compile=True))
        else:  # in the task's own graph
            self._apply_fn = self._apply_graph
        self.sync_scheme = sync
        self.sync_state = sync.stage_state(self)
        self._tasks = {}  # (task shape, accumulating) -> _Task
        self._ids = {}  # minibatch id -> the same as an int64 tensor
        self._splits = {}  # update_state -> the SplitPass of the stage's pass
        self._stashed = set()  # minibatch ids whose versions the stash holds (no readback needed)
        self._entering = {}  # p -> {position: tensor}
        self._labels = {}
        self._output_grads = {}  # p -> (gradient of each float tensor sent, verdict) from the next stage
        self._inflight = {}  # p -> (weights, entering, labels, record) of a split forward pass
        self._kept = {}  # p -> (entering, labels) of a forward pass to recompute
        self._sent = {}  # p -> tensors for the next stage
        self._weight_grads = {}  # p -> (weight gradients, verdict) not applied in their backward's call
        self._accumulated = None  # GPipe: (gradient sum, verdict) since the last flush
        self._summed = []  # the microbatches in that sum
        self._input_grads = {}  # p -> (gradient of each float tensor received, verdict, squared norm, S_p)
        self._tied_out = {}  # p -> this stage's tied replicas' gradients, for the first stage
        self._tied_in = {}  # p -> {stage: its tied replicas' gradients} (first stage)
        self._terms = {}  # p -> the update terms (made here, or taken from the first stage)
        self.skipped = set()  # minibatches a loss scale overflow skipped (read back by check_applied)
        #: When recording provenance: minibatch -> (the global clip's factor, the loss scale S_p) its update took.
        self.applied_terms = {}
        self.applied = []  # minibatch ids whose updates w_local holds, in order
        self._unchecked = []  # (verdict, minibatches, logs) of updates not yet read back
        self.logs = {}  # p -> loss and metrics, tensors (last stage)
        self._log_names = None  # the order of the logs in a split pass's outputs (last stage)

    @property
    def is_last(self):
        return self.loss_head is not None

    def execution_scope(self):
        """How the stage's functions run. With `single_threaded`, the stage's kernels run one
        after another on its own thread (TensorFlow's single-threaded function executor), so a
        stage uses one core, as a GPU runs a stage's kernels in one stream; by default
        TensorFlow's inter-op pool may spread a stage's independent ops over every core."""
        if self.single_threaded:
            return context.function_executor_type("SINGLE_THREADED_EXECUTOR")
        return contextlib.nullcontext()

    # What a minibatch brings and takes ------------------------------------------------
    def set_received(self, p, tensors):
        self._entering.setdefault(p, {}).update(enumerate(tensors))

    def set_loaded(self, p, tensors):
        n = len(self.stage.io.received)
        self._entering.setdefault(p, {}).update((n + i, t) for i, t in enumerate(tensors))

    def set_labels(self, p, labels):
        """Minibatch p's labels, as the dataset gives them (arrays or tensors, any structure)."""
        self._labels[p] = tf.nest.map_structure(tf.convert_to_tensor, labels)

    def set_output_gradients(self, p, message):
        """The next stage's message for minibatch p: (the gradient of each floating-point tensor
        this stage sent, in order; the minibatch's verdict so far)."""
        self._output_grads[p] = message

    def sent(self, p):
        """The tensors minibatch p's forward pass sends to the next stage."""
        return self._sent.pop(p)

    def input_gradients(self, p):
        """The message for the previous stage: (the gradient of each floating-point tensor this
        stage received for minibatch p, in order; p's verdict so far; the squared norm of the
        gradients so far, when clipping by the global norm; the loss scale S_p)."""
        return self._input_grads.pop(p)

    def tied_gradients(self, p):
        """The gradients of minibatch p of this stage's tied replicas, for the first stage."""
        return self._tied_out.pop(p)

    def set_tied_gradients(self, p, source, grads):
        self._tied_in.setdefault(p, {})[source] = grads

    def update_terms(self, p):
        """Minibatch p's update terms, for the stages waiting for them (first stage)."""
        return self._terms[p]

    def set_update_terms(self, p, terms):
        self._terms[p] = terms

    def _minibatch_id(self, p):
        """Minibatch id p as an int64 tensor, made once for the few calls of a minibatch."""
        tensor = self._ids.get(p)
        if tensor is None:
            if len(self._ids) >= 64:
                self._ids.clear()
            tensor = self._ids[p] = tf.constant(p, tf.int64)
        return tensor

    def _take(self, kind, p):
        """The input `kind` of minibatch p for a compiled task, taken from what the stage holds."""
        if kind == "entering":
            return _in_order(self._entering.pop(p))
        if kind == "labels":
            return self._labels.pop(p)
        if kind == "out_grads":
            return self._output_grads.pop(p)
        if kind == "record":
            return self._inflight.pop(p)
        if kind == "kept":
            return self._kept.pop(p)
        if kind == "weight_grads":
            return self._weight_grads.pop(p)
        if kind == "tied_in":
            given = self._tied_in.pop(p)
            return [given[t] for t in self.tied_sources]
        if kind == "terms":
            return self._terms.pop(p)
        return self._accumulated  # "acc"

    def _input_spec(self, kind, value):
        """The spec a compiled task takes input `kind` with: what a minibatch brings for minibatches of
        any size, a split pass's record as the pass makes it, gradients as they are."""
        if kind in ("entering", "labels", "kept"):
            return spec_of(value, relax_batch=True)
        if kind == "out_grads":
            return (spec_of(value[0], relax_batch=True),) + spec_of(tuple(value[1:]))
        if kind == "record":
            weights, entering, labels, _ = value
            return self._pass_specs(weights, entering, labels) + (self._splits[True].record_specs,)
        return spec_of(value)

    # Running device instructions ------------------------------------------------------
    def run(self, instructions):
        """Carries out `instructions`, device instructions of one task in program order
        (:data:`DEVICE_INSTRUCTIONS`), in one compiled call on the stage's device."""
        if len(self._unchecked) > _UNCHECKED:  # long done: reading them back makes no wait
            self.check_applied()
        base, shape = _task_shape(instructions)
        key = (shape, self._accumulated is not None)
        task = self._tasks.get(key)
        if task is None:
            task = self._tasks[key] = _Task(self, shape, key[1])
        for ins in instructions:
            self._account(ins, base)
        args = task.gather(self, base)
        outputs = task.call(*args)
        for (kind, o), value in zip(task.outputs, outputs):
            self._keep(kind, base + o, value, instructions)

    def _account(self, ins, base):
        """The host's bookkeeping of `ins` (memory, versions, updates held, provenance), in program
        order before the call: an emulated device that would run out of memory fails first."""
        p = ins.minibatch
        if isinstance(ins, Forward):
            if ins.recompute:
                self._kept[p] = (_in_order(self._entering[p]), self._labels.get(p, ()))
            else:
                self.memory.allocate("activations", self.activation_bytes)
            if self.provenance:
                self.provenance.used(p, ins.live, self.applied)
        elif isinstance(ins, Recompute):
            self.memory.allocate("activations", self.activation_bytes)
        elif isinstance(ins, Backward):
            self.memory.free("activations", self.activation_bytes)
        elif isinstance(ins, StashWeights):
            self.memory.allocate("stashed versions", self.version_bytes)
            self._stashed.add(p)
            if self.provenance:
                self.provenance.stashed(p, self.applied)
        elif isinstance(ins, ReleaseWeights):
            self._stashed.discard(p)
            self.memory.free("stashed versions", self.version_bytes)
        elif isinstance(ins, ApplyUpdate):
            self.applied.append(p)
        elif isinstance(ins, AccumulateGradient):
            self._summed.append(p)
        elif isinstance(ins, ApplyAccumulated):
            if self._summed != list(range(ins.first, p + 1)):
                raise RuntimeError(f"stage {self.index}: the flush of microbatches {ins.first}..{p} found the "
                                   f"gradients of {self._summed}; the schedule must accumulate each microbatch once")
            self.applied.extend(self._summed)

    def _keep(self, kind, p, value, instructions):
        """Keeps output `kind` of minibatch p of a compiled task."""
        held = _KEPT_BY_MINIBATCH.get(kind)
        if held is not None:
            getattr(self, held)[p] = value
        elif kind == "acc":
            self._accumulated = value
        elif kind == "verdict":
            flush = next((i for i in instructions if isinstance(i, ApplyAccumulated) and i.minibatch == p), None)
            minibatches = tuple(self._summed) if flush else (p,)
            if flush:
                self._accumulated, self._summed = None, []
            self._unchecked.append((value, minibatches, self.logs.get(minibatches[-1])))

    # The graph of a task --------------------------------------------------------------
    def _task_graph(self, task, base, *inputs):
        """The graph function of `task` (a :class:`_Task`): each instruction in program order."""
        tr = _Trace(task.offsets, base, dict(zip(task.inputs, inputs)), task.terms_at)
        for t, o, fixed in task.shape:
            if t is Forward:
                live, recompute = fixed
                weights = self._live_weights() if live else self._version(tr.id[o])
                entering, labels = tr.inputs[("entering", o)], tr.inputs.get(("labels", o), ())
                if recompute:  # untaped: Recompute(p) runs it again
                    targets, _, logs = self._pass_graph(weights, entering, labels)
                    self._emit_pass(tr, o, targets, logs)
                else:
                    self._lower_pass(tr, o, weights, entering, labels, True, o in task.in_graph)
            elif t is Recompute:
                entering, labels = tr.inputs[("kept", o)]
                self._lower_pass(tr, o, self._live_weights(), entering, labels, False, o in task.in_graph)
            elif t is Backward:
                self._lower_backward(tr, o)
            elif t is ReleaseWeights:
                self.stash.release(tr.id[o])
            elif t is CompensateGradient:
                self._lower_compensate(tr, o, fixed[0])
            elif t is ApplyUpdate:
                self._lower_apply(tr, o)
            elif t is AccumulateGradient:
                grads, verdict = self._grads_of(tr, o)
                grads = [tf.convert_to_tensor(g) for g in grads]
                if tr.acc is not None:
                    total, code = tr.acc
                    grads = [a + g for a, g in zip(total, grads)]
                    verdict = tf.where(code != FINITE, code, verdict)
                tr.acc = (grads, verdict)
            elif t is ApplyAccumulated:
                total, verdict = tr.acc
                count = float(o - fixed[0] + 1)
                mean = [g / tf.constant(count, g.dtype) for g in total]
                tr.outputs[("verdict", o)] = self._apply_fn(mean, verdict)
                tr.acc = None
            elif t is StashWeights:
                self.stash.put(tr.id[o], [v.value for v in self.trainable])
        if tr.acc is not None:
            tr.outputs[("acc", 0)] = tr.acc
        for o, grads in tr.grads.items():  # gradients a later call applies
            tr.outputs[("weight_grads", o)] = grads
        task.outputs = list(tr.outputs)
        return list(tr.outputs.values())

    def _live_weights(self):
        return [tf.identity(v.value) for v in self.trainable]

    def _version(self, minibatch):
        """Inside a task's graph: the version stashed for `minibatch`, with the weights' shapes."""
        if not self.trainable:  # a stage may have no weights (pooling, activations)
            return []
        version = self.stash.get(minibatch, self._dtypes)
        for t, v in zip(version, self.trainable):
            t.set_shape(v.shape)
        return version

    def _lower_pass(self, tr, o, weights, entering, labels, update_state, in_graph):
        """A taped pass whose backward pass runs in this call (`in_graph`), or the forward call of
        the split pass, whose record a later call's backward pass takes in."""
        if in_graph:
            float_pos, sources = self._differentiated(weights, entering)
            scale = tf.convert_to_tensor(self.loss_scale.value) if self.is_last and self.rule.loss_scaling else None
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
                tape.watch(sources)
                targets, reg, logs = self._pass_graph(weights, entering, labels, update_state=update_state)
                differentiated = [targets[0] * scale] if scale is not None else targets
            tr.taped[o] = (tape, sources, len(float_pos), differentiated, reg)
            if scale is not None:
                tr.scales[o] = scale
            self._emit_pass(tr, o, targets, logs)
            return
        split = self._split_pass(update_state, weights, entering, labels)
        outputs, record = split.forward(weights, entering, labels)
        if self.is_last:
            self._emit_pass(tr, o, outputs[:1], dict(zip(self._log_names, outputs[1:])))
        else:
            self._emit_pass(tr, o, outputs[:-1], {})
        tr.outputs[("record", o)] = (list(weights), list(entering), labels, record)

    def _emit_pass(self, tr, o, targets, logs):
        if self.is_last:
            tr.outputs[("logs", o)] = logs
        else:
            tr.outputs[("sent", o)] = list(targets)

    def _split_pass(self, update_state, weights, entering, labels):
        """The stage's pass as a :class:`SplitPass` (made once per `update_state`): its outputs are
        the sent tensors and the regularisation loss, or on the last stage the loss and the logs."""
        if update_state not in self._splits:
            def fn(weights, entering, labels):
                targets, reg, logs = self._pass_graph(weights, entering, labels, update_state=update_state)
                if self.is_last:
                    self._log_names = list(logs)
                    return list(targets) + [logs[k] for k in self._log_names]
                return list(targets) + [reg]

            with tf.init_scope():
                self._splits[update_state] = SplitPass(fn, self._pass_specs(weights, entering, labels), self.device,
                                                       name=f"stage{self.index}_pass")
        return self._splits[update_state]

    def _pass_specs(self, weights, entering, labels):
        """The specs of a pass's inputs: the weights' as they are; what a minibatch brings, for
        minibatches of any size."""
        return (spec_of(weights), spec_of(entering, relax_batch=True), spec_of(labels, relax_batch=True))

    def _lower_backward(self, tr, o):
        if o in tr.taped:
            tape, sources, num_received, targets, reg = tr.taped.pop(o)
            if self.is_last:
                targets, seeds, loss = list(targets), None, targets[0]
            else:
                out_grads = tr.inputs[("out_grads", o)][0]
                targets = [t for t in targets if _is_float(t)] + [reg]
                seeds, loss = list(out_grads) + [tf.ones_like(reg)], None
            grads = tape.gradient(targets, sources, output_gradients=seeds,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            received_grads, weight_grads = grads[:num_received], grads[num_received:]
        else:
            weights, entering, labels, record = tr.inputs[("record", o)]
            n = self._splits[True].num_outputs
            if self.is_last:  # d(S_p * loss) = S_p * d(loss)
                seed = tf.ones_like(record[0])
                if self.rule.loss_scaling is not None:
                    tr.scales[o] = tf.convert_to_tensor(self.loss_scale.value)
                    seed = seed * tr.scales[o]
                seeds, loss = [seed] + [None] * (n - 1), record[0]
            else:
                out_grads = iter(tr.inputs[("out_grads", o)][0])
                seeds = [next(out_grads) if _is_float(t) else None for t in record[:n - 1]]
                seeds, loss = seeds + [tf.ones_like(record[n - 1])], None
            grads = self._splits[True].backward(seeds, record, tf.nest.flatten(
                (weights, entering, labels), expand_composites=True))
            weight_grads = grads[:len(weights)]
            received = range(len(self.stage.io.received))
            received_grads = [grads[len(weights) + i] for i in received if _is_float(entering[i])]
        if self.is_last:
            code, squared, scale = tf.constant(FINITE, tf.int32), tf.constant(0.0), tr.scales.pop(o, tf.constant(1.0))
        else:
            _, code, squared, scale = tr.inputs[("out_grads", o)]
        if loss is not None:
            code = _combined(code, tf.logical_not(tf.math.is_finite(loss)), verdict_code(self.index, loss=True))
        code = _checked_gradient(code, weight_grads, self.index)
        tied = {pos for _, pos in self.tied_positions}
        if self.rule.global_clipnorm is not None:  # the tied weights' norms are of their sums, on the first stage
            squared = squared + squared_norm([g for i, g in enumerate(weight_grads) if i not in tied], scale)
        tr.grads[o] = (list(weight_grads), code)
        if self.stage.io.received:
            tr.outputs[("input_grads", o)] = (received_grads, code, squared, scale)
        if self.index > 0 and self.tied_positions:
            tr.outputs[("tied", o)] = [tf.convert_to_tensor(weight_grads[pos]) for _, pos in self.tied_positions]
        if o in tr.terms_at:
            tr.terms[o] = self._terms_graph(tr, o, weight_grads, code, squared, scale)
            tr.outputs[("terms", o)] = tr.terms[o]

    def _terms_graph(self, tr, o, weight_grads, code, squared, scale):
        """The first stage: minibatch p's update terms (hetpipe_tf.runtime.update_terms): (verdict,
        loss scale S_p, the global clip's factor, the loss scale after p, each tied weight's summed
        gradient)."""
        sums = [None] * len(self._ties)
        for g, pos in self.tied_positions:
            sums[g] = tf.convert_to_tensor(weight_grads[pos])
        for source, grads in zip(self.tied_sources, tr.inputs.get(("tied_in", o), [])):
            held = [g for g, tie in enumerate(self._ties) for st, _ in tie.replicas if st == source]
            for g, grad in zip(held, grads):
                sums[g] = grad if sums[g] is None else sums[g] + grad
        clip = tf.constant(1.0)
        if self.rule.global_clipnorm is not None:
            clip = clip_factor(squared + squared_norm(sums, scale), self.rule.global_clipnorm)
        after = self.scale_state.after(tf.equal(code, FINITE)) if self.scale_state is not None else scale
        return (code, scale, clip, after, sums)

    def _lower_apply(self, tr, o):
        grads, code = self._grads_of(tr, o)
        if o in tr.terms or self.takes_terms:
            terms = tr.terms.pop(o) if o in tr.terms else tr.inputs[("terms", o)]
            code, scale, clip, after, sums = terms
            grads = list(grads)
            for g, pos in self.tied_positions:
                grads[pos] = sums[g]
            if self.rule.loss_scaling is not None:
                grads = [_scaled(g, lambda x: x / scale) for g in grads]
            if self.rule.global_clipnorm is not None:
                grads = clipped(grads, clip)
            if self.rule.loss_scaling is not None and self.is_last and self.index > 0:
                self.loss_scale.assign(after)
            if self.provenance is not None:
                tr.outputs[("applied_terms", o)] = tf.stack([clip, scale])
        tr.outputs[("verdict", o)] = self._apply_fn(grads, code)

    def _grads_of(self, tr, o):
        """(weight gradients, (verdict, finite flag of each)) of minibatch offset `o`: computed in this
        call, or taken in from an earlier one."""
        if o in tr.grads:
            return tr.grads.pop(o)
        return tr.inputs[("weight_grads", o)]

    def _lower_compensate(self, tr, o, variance_control):
        grads, code = self._grads_of(tr, o)
        if self.trainable:  # a stage may have no weights (pooling, activations)
            version = self._version(tr.id[o])
            grads = [tf.convert_to_tensor(g) for g in grads]
            grads = [g + variance_control * g * g * (w.value - v) for g, w, v in zip(grads, self.trainable, version)]
        tr.grads[o] = (grads, _checked_gradient(code, grads, self.index))

    def _pass_graph(self, weights, entering, labels, update_state=True):
        """The stage's pass (training mode) with the given weights: (targets, regularisation loss,
        logs). Targets are the sent tensors, or on the last stage [loss] (the regularisation
        included) with the logs."""
        state = [v.value for v in self.non_trainable]
        sent, new_state, reg = self.stage.stateless_call(weights, state, entering, True)
        for v, value in zip(self.non_trainable, new_state) if update_state else ():
            v.assign(value)
        if not self.is_last:
            return sent, reg, {}
        labels = self.loss_head.split_labels(labels)
        loss = self.loss_head.loss(labels, sent) + reg
        with tf.name_scope("metrics"):
            metrics = self.loss_head.metrics(labels, [tf.stop_gradient(o) for o in sent])
        return [loss], reg, dict(metrics, loss=loss)

    def _differentiated(self, weights, entering):
        """What a pass is differentiated with respect to: what the previous stage sent (its gradient
        goes back; model inputs loaded here need no gradient) and the weights. Returns the
        positions of the received floating-point tensors and the sources (those, then the weights)."""
        float_pos = [i for i in range(len(self.stage.io.received)) if _is_float(entering[i])]
        return float_pos, [entering[i] for i in float_pos] + list(weights)

    def _apply_graph(self, grads, verdict):
        """Applies the gradients if the minibatch's verdict is finite; returns the verdict."""
        if self.trainable:  # a stage may have no weights (pooling, activations)
            def apply():
                self.optimizer.apply(grads, self.trainable)
                return tf.constant(True)

            tf.cond(verdict == FINITE, apply, lambda: tf.constant(False))
        return verdict

    def check_applied(self, logs=None):
        """Reads back the verdicts of the updates since the last check; raises
        :class:`NonFiniteError` for the first that was not finite (it applied nothing), but under
        loss scaling a gradient that was not finite is a minibatch skipped (:attr:`skipped`).
        `logs`: {minibatch: its logs} that the last stage made, for the error of a loss that was
        not finite, where this stage holds none."""
        unchecked, self._unchecked = self._unchecked, []
        for verdict, minibatches, own in unchecked:
            code = int(verdict)
            if code == FINITE:
                continue
            if self.rule.loss_scaling is not None and not read_verdict(code)[1]:
                # A gradient past float16's range under loss scaling: skipped on every stage, the scale halved.
                self.skipped.update(minibatches)
                self.applied = [q for q in self.applied if q not in minibatches]
                continue
            raise self._non_finite(code, minibatches, own or (logs or {}).get(minibatches[-1]))

    def _non_finite(self, code, minibatches, logs):
        which = (f"minibatch {minibatches[0]}" if len(minibatches) == 1
                 else f"minibatches {minibatches[0]}..{minibatches[-1]}")
        stage, loss, variable = read_verdict(code)
        if loss:
            values = {k: float(v) for k, v in logs.items()} if logs else None
            return NonFiniteError(
                f"{which}: the loss is {values['loss'] if values else 'not finite'} on stage {stage} (the last); "
                f"nothing of it was applied on any stage or pushed. Lower the learning rate, look for NaN or "
                f"Inf in the data, or clip gradients (the optimizer's clipnorm)", minibatches[-1], stage, values)
        return NonFiniteError(
            f"{which}: the gradient of stage {stage} is not finite (NaN or Inf in "
            f"{self.variable_paths[stage][variable]}, the first such weight); nothing of it was applied on "
            f"stage {stage} or the stages before it, or pushed. Lower the learning rate or clip gradients "
            f"(the optimizer's clipnorm)", minibatches[-1], stage)

    # Measuring a stage's passes -------------------------------------------------------
    def _timed_pass_graph(self, weights, entering, labels):
        _, sources = self._differentiated(weights, entering)
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(sources)
                targets, reg, _ = self._pass_graph(weights, entering, labels, update_state=False)
            outputs = list(targets) if self.is_last else [t for t in targets if _is_float(t)] + [reg]
        with tf.control_dependencies(outputs):
            forwarded = tf.timestamp()
        with tf.control_dependencies([forwarded]):
            grads = tape.gradient(outputs, sources, output_gradients=[tf.ones_like(t) for t in outputs],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        with tf.control_dependencies(tf.nest.flatten(grads, expand_composites=True)):
            done = tf.timestamp()
        # The passes' values are returned too: a function runs only what its outputs need, and
        # the timestamps' control dependencies alone did not keep the passes (measured: 0 ms).
        return forwarded - start, done - forwarded, outputs, grads

    def timed_solo_pass(self, p):
        """Minibatch p's forward and backward times (seconds) as the stage's device measures them:
        one compiled call that reads ``tf.timestamp`` before, between and after the two passes, so
        that the time of the calls reaching the device is left out (on another task's device each
        eager call is an RPC). Uses the version stashed for p and the inputs set for it, consumes
        neither and changes no state; the backward pass is seeded with ones."""
        entering = _in_order(self._entering[p])
        labels = self._labels[p] if self.is_last else None
        with tf.device(self.device):
            forward, backward, _, _ = self._timed_pass_fn(self.stash.get(p, self._dtypes), entering, labels)
        return float(forward), float(backward)

    # Synchronisation ---------------------------------------------------------------------
    def _read_synchronised_graph(self):
        return [tf.identity(v.value) for v in self.synchronised]

    def pushed(self, deltas):
        """(paths, deltas) of what this stage pushes to the parameter servers of `deltas` (one per
        synchronised variable): all but its followers' replicas of tied weights."""
        return [self.synchronised_paths[i] for i in self._pushed], [deltas[i] for i in self._pushed]

    def synchronised_values(self):
        """Copies of the synchronised variables' values now (weights, then floating-point state)."""
        with tf.device(self.device):
            return self._read_synchronised_fn()

    def _synchronised_change_graph(self, since):
        now = self._read_synchronised_graph()
        return now, [x - y for x, y in zip(now, since)]

    def synchronised_change(self, since):
        """(copies of the synchronised variables' values now, their change from `since`), in one
        call on the stage's device."""
        with tf.device(self.device):
            return self._change_fn(list(since))

    def subtract(self, a, b):
        """[x - y for x, y in zip(a, b)], computed on the stage's device."""
        with tf.device(self.device):
            return self._subtract_fn(list(a), list(b))

    def sum(self, a, b):
        """[x + y for x, y in zip(a, b)], computed on the stage's device."""
        with tf.device(self.device):
            return self._sum_fn(list(a), list(b))

    def _add_graph(self, deltas):
        for v, d in zip(self.synchronised, deltas):
            v.assign_add(d)

    def _shift_version_graph(self, p, deltas):
        version = self.stash.get(p, self._dtypes)
        self.stash.release(p)
        self.stash.put(p, [w + d for w, d in zip(version, deltas)])  # versions: trainable weights only

    def _add_to_weights_graph(self, deltas, stashed):
        self._add_graph(deltas)
        for i in range(self.stash.capacity) if self.trainable else ():  # a stage without weights stashes nothing
            tf.cond(stashed[i] >= 0, lambda p=stashed[i]: self._shift_version_graph(p, deltas[:len(self.trainable)]),
                    lambda: None)

    def _merge_graph(self, base, pulled, stashed):
        deltas = [x - y for x, y in zip(pulled, base)]
        self._add_to_weights_graph(deltas, stashed)
        return [x + d for x, d in zip(base, deltas)]

    def _stashed_from(self, first_minibatch):
        """The minibatch ids >= `first_minibatch` whose versions are stashed, in order, and the same
        ids padded with -1 to the stash's capacity (one tensor, so one trace of the compiled call)."""
        ids = sorted(p for p in self._stashed if p >= first_minibatch)
        return ids, tf.constant(ids + [-1] * (self.stash.capacity - len(ids)), tf.int64)

    def add_to_weights(self, deltas, first_minibatch, included):
        """Adds `deltas` (one per synchronised variable) to the live variables and to the versions
        stashed for minibatches >= `first_minibatch`, which thereby hold the global updates
        `included` ((worker, clock) pushes), as the live weights now do; one compiled call on the
        stage's device."""
        stashed, padded = self._stashed_from(first_minibatch)
        with tf.device(self.device):
            self._add_to_weights_fn(list(deltas), padded)
        if self.provenance:
            self.provenance.merged(stashed, included)

    def merge_pulled(self, base, pulled, first_minibatch, included):
        """:meth:`add_to_weights` of ``pulled - base`` in the same compiled call that computes it (one
        RPC where the device is another task's): the merge of global weights pulled after the
        pushes `included` (§5). Returns ``base + (pulled - base)``, the new base of the next push."""
        stashed, padded = self._stashed_from(first_minibatch)
        with tf.device(self.device):
            new_base = self._merge_fn(list(base), list(pulled), padded)
        if self.provenance:
            self.provenance.merged(stashed, included)
        return new_base

    def end_run(self):
        """Drops what a stopped or failed run left behind: versions stashed for minibatches
        that never ran, and their inputs, so that the next run starts clean."""
        for p in self.stash.stats().minibatches:
            self.stash.release(p)
            self.memory.free("stashed versions", self.version_bytes)
        self._stashed.clear()
        for p in list(self._inflight):
            self._inflight.pop(p)
            self.memory.free("activations", self.activation_bytes)
        for pending in (self._entering, self._labels, self._output_grads, self._sent, self._weight_grads,
                        self._input_grads, self._kept, self._unchecked, self._summed, self.logs, self._tied_out,
                        self._tied_in, self._terms):
            pending.clear()
        self._accumulated = None
        if self.provenance:
            self.provenance.drop_pending()

    # State -------------------------------------------------------------------------------
    def snapshot(self):
        """The stage's state now (tensors share buffers until the variables change)."""
        return StageState(trainable=[tf.identity(v.value) for v in self.trainable],
                          non_trainable=[tf.identity(v.value) for v in self.non_trainable],
                          optimizer=[tf.identity(v.value) for v in self.optimizer.variables],
                          applied=tuple(self.applied), sync=self.sync_state.snapshot() if self.sync_state else None,
                          provenance=self.provenance.snapshot() if self.provenance else None)

    def restore(self, state):
        """Sets the stage's live state back to `state` (a :meth:`snapshot`)."""
        for variables, values in ((self.trainable, state.trainable), (self.non_trainable, state.non_trainable),
                                  (self.optimizer.variables, state.optimizer)):
            for v, value in zip(variables, values):
                v.assign(value)
        self.applied = list(state.applied)
        if self.sync_state:
            self.sync_state.restore(state.sync)
        if self.provenance:
            self.provenance.restore(state.provenance)

    def load_model_weights(self):
        """Sets the live weights to the Keras model's own and starts the synchronisation
        bookkeeping from them (a new run after an aborted one; the optimizer's state stays)."""
        for variables, sources in ((self.trainable, self.stage.trainable_variables),
                                   (self.non_trainable, self.stage.non_trainable_variables)):
            for v, source in zip(variables, sources):
                v.assign(source.value)
        self.sync_state = self.sync_scheme.stage_state(self)
        if self.provenance:
            self.provenance.restart()

    def write_back(self, state=None):
        """Writes `state` (default: the live state) into the Keras model's own variables."""
        state = state or self.snapshot()
        for v, value in zip(self.stage.trainable_variables, state.trainable):
            v.assign(value)
        for v, value in zip(self.stage.non_trainable_variables, state.non_trainable):
            v.assign(value)

    def close(self):
        self.stash.close()


def _subtract_graph(a, b):
    return [x - y for x, y in zip(a, b)]


def _sum_graph(a, b):
    return [x + y for x, y in zip(a, b)]
