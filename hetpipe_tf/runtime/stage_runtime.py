"""One pipeline stage on its device: weights, optimizer, weight stash, minibatches in flight.

The stage's live weights w_local, its optimizer copy and its weight stash are
placed on the stage's device (``tf.device``). The rules of HetPipe §4 are
carried out by the schedule's instructions; this class is what each of them does
to the stage:

* ``stash_weights(p)``: w_p := w_local, kept in the C++ weight stash;
* ``forward(p)``: runs the stage on minibatch p with w_p, under a gradient tape
  that keeps the minibatch's activations until its backward pass (the backward pass
  does not recompute them); ``forward(p, live=True)`` uses the live weights instead of
  a stashed version, and ``forward(p, recompute=True)`` runs without a tape and keeps
  only the pass's inputs, for ``recompute(p)``: the same pass again, with the live
  weights, under a tape (GPipe's re-materialisation; NaivePipe's backward against
  the live weights);
* ``backward(p)``: gradients of p against the weights its taped pass used (w_p);
* ``compensate_gradient(p, λ)``: TaylorPipe's delay compensation (seed 003 §3.2) of p's
  weight gradient g, computed against w_p: g := g + λ·g⊙g⊙(w_local − w_p);
* ``apply_update(p)``: w_local := w_local + u_p with the stage's optimizer;
* ``accumulate_gradient(p)`` and ``apply_accumulated(first, p)``: GPipe's sum of
  microbatch gradients, and one update from their mean at the flush;
* ``release_weights(p)``: drops w_p.

A non-finite loss (last stage, checked after the forward pass) or weight gradient
(checked inside the apply function, which then applies nothing) raises
:class:`NonFiniteError`: nothing of that minibatch reaches w_local, so nothing of it
can be pushed to the parameter servers. The apply's verdict is read back later, not in the
apply's own call (a read back makes the host wait for the device): by the stage's next
apply, or :meth:`StageRuntime.check_applied` (the executor calls it before anything reads
the weights: a push, a snapshot, the end of the run).
"""
import contextlib
import functools
import time
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from hetpipe_tf.ops.weight_stash import WeightStash
from hetpipe_tf.pipeline.emulation import MemoryAccount
from hetpipe_tf.pipeline.instructions import Backward, Forward
from hetpipe_tf.pipeline.schedule import NO_SYNC
from hetpipe_tf.runtime.optimizers import stage_optimizer
from hetpipe_tf.runtime.stage_rewrite import variable_bytes
from hetpipe_tf.sync.parameter_server import synchronised_variables


def _is_remote(device):
    """Whether `device` belongs to a task of a cluster rather than to this process."""
    job = tf.DeviceSpec.from_string(device or "").job
    return job not in (None, "localhost")


def _in_order(entering):
    """The tensors a pass enters with, from {position: tensor}, in position order."""
    return [entering[i] for i in range(len(entering))]


def _is_float(t):
    """Whether a tensor holds floating-point values."""
    return tf.as_dtype(t.dtype).is_floating


@dataclass
class _InFlight:
    """What minibatch p holds on this stage between its forward and backward passes."""
    tape: object
    sources: list  # float received tensors, then the weight version's tensors
    num_entering: int  # how many of `sources` are received tensors
    received_float: list  # for each received tensor: its position in sources, or None
    targets: list  # what the backward pass differentiates


class NonFiniteError(FloatingPointError):
    """A minibatch's loss or gradient is NaN or infinite; nothing of that minibatch was applied.

    `logs` holds the minibatch's loss and metrics when the loss was not finite (for
    ``keras.callbacks.TerminateOnNaN``), else None."""

    def __init__(self, message, minibatch, stage, logs=None):
        super().__init__(message)
        self.minibatch = minibatch
        self.stage = stage
        self.logs = logs


@dataclass(frozen=True)
class StageState:
    """A stage's state right after some update: what a checkpoint or evaluation needs.
    `applied`: the minibatches whose updates it holds; `used`: the recorded provenance of the
    versions used so far ({p: local updates}, {p: global pushes}), when recording it; `sync`:
    (the synchronisation scheme's snapshot of its stage state, the global pushes held)."""
    trainable: list
    non_trainable: list
    optimizer: list
    applied: tuple = ()
    used: tuple = ({}, {})
    sync: tuple = (None, frozenset())


class StageRuntime:
    def __init__(self, stage, device, num_in_flight, optimizer, loss_head=None, memory=None,
                 activation_bytes=0, record_provenance=False, single_threaded=False, sync=NO_SYNC):
        self.stage = stage
        self.index = stage.index
        self.device = device
        self.loss_head = loss_head
        self.memory = memory or MemoryAccount(device)
        self.activation_bytes = int(activation_bytes)
        self.record_provenance = record_provenance
        self.single_threaded = single_threaded
        with tf.device(device):
            # From a value (numpy): given a tf.Variable, keras.Variable would reuse it.
            self.trainable = [keras.Variable(v.numpy(), dtype=v.dtype, trainable=True, name=v.name)
                              for v in stage.trainable_variables]
            self.non_trainable = [keras.Variable(v.numpy(), dtype=v.dtype, trainable=False, name=v.name)
                                  for v in stage.non_trainable_variables]
            self.optimizer = stage_optimizer(optimizer)
            self.optimizer.build(self.trainable)
        self.stash = WeightStash(num_in_flight, device=device, name=f"stage{self.index}")
        self._dtypes = [v.dtype for v in self.trainable]
        self.version_bytes = variable_bytes(self.trainable)
        self.memory.allocate("weights", self.version_bytes + variable_bytes(self.non_trainable))
        self.memory.allocate("optimizer slots", variable_bytes(self.optimizer.variables))
        # What the synchronisation scheme exchanges with the other virtual workers, in the same
        # order as their paths (the keys of the parameter servers).
        self.synchronised = synchronised_variables(self.trainable, self.non_trainable)
        self.synchronised_paths = [v.path for v in synchronised_variables(stage.trainable_variables,
                                                                          stage.non_trainable_variables)]
        if sync.weight_copies:
            self.memory.allocate("synchronisation copies", sync.weight_copies * variable_bytes(self.synchronised))
        # The weight and synchronisation bookkeeping, each one call (on another task's device
        # one RPC, not one per variable and op).
        self._stash_fn = tf.function(functools.partial(self._stash_graph))
        self._read_synchronised_fn = tf.function(functools.partial(self._read_synchronised_graph))
        self._add_to_weights_fn = tf.function(functools.partial(self._add_to_weights_graph))
        self._merge_fn = tf.function(functools.partial(self._merge_graph))
        self._change_fn = tf.function(functools.partial(self._synchronised_change_graph))
        self._subtract_fn = tf.function(functools.partial(_subtract_graph))
        self._sum_fn = tf.function(functools.partial(_sum_graph))
        self._mean_fn = tf.function(functools.partial(_mean_graph))
        self._compensate_fn = tf.function(functools.partial(self._compensate_graph))
        self._read_weights_fn = tf.function(functools.partial(self._read_weights_graph))
        self._timed_pass_fn = tf.function(functools.partial(self._timed_pass_graph))
        self.sync_scheme = sync
        self.sync_state = sync.stage_state(self)
        self._stashed = set()  # minibatch ids whose versions the stash holds (no readback needed)
        self._entering = {}  # p -> {position: tensor}
        self._labels = {}
        self._inflight = {}
        self._kept = {}  # p -> (entering, labels) of a forward pass to recompute
        self._weight_grads = {}
        self._accumulated = None  # GPipe: the sum of the microbatch gradients since the last flush
        self._input_grads = {}
        self.applied = []  # minibatch ids whose updates w_local holds, in order
        self._unchecked = []  # (finite flag, grads, minibatches) of applies not yet read back
        self.version_updates = {}  # p -> updates w_p holds (when recording provenance)
        self.used_versions = {}  # p -> updates the version p's forward pass used
        self.global_included = frozenset()  # (worker, clock) pushes the live weights hold
        self.version_globals = {}  # p -> (worker, wave) pushes w_p holds
        self.used_globals = {}  # p -> (worker, wave) pushes the version p's forward pass used
        self.logs = {}  # p -> loss and metrics (last stage)
        # Partials, not methods or lambdas: TensorFlow keys its retracing warning on a function's
        # code, which every stage would share.
        self._forward_fn = tf.function(functools.partial(self._forward_graph))
        # XLA fuses the optimizer's elementwise update (2-3x faster on one core); it copies a
        # variable's buffer that a stashed version still shares, as eager updates do. Not on
        # another task's device: TF 2.21's remote eager runtime then fails the next eager op
        # ("KernelAndDeviceOp does not support EagerFunctionParams").
        self._apply_fn = tf.function(functools.partial(self._apply_graph),
                                     jit_compile=not _is_remote(device))

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

    # Inputs of a minibatch -------------------------------------------------------------
    def set_received(self, p, tensors):
        self._entering.setdefault(p, {}).update(enumerate(tensors))

    def set_loaded(self, p, tensors):
        n = len(self.stage.io.received)
        self._entering.setdefault(p, {}).update((n + i, t) for i, t in enumerate(tensors))

    def set_labels(self, p, labels):
        self._labels[p] = labels

    # Weight versions -------------------------------------------------------------------
    def _stash_graph(self, p):
        self.stash.put(p, [v.value for v in self.trainable])

    def stash_weights(self, p):
        self.memory.allocate("stashed versions", self.version_bytes)
        with tf.device(self.device):
            self._stash_fn(tf.constant(p, tf.int64))
        self._stashed.add(p)
        if self.record_provenance:
            self.version_updates[p] = tuple(self.applied)
            self.version_globals[p] = self.global_included

    def release_weights(self, p):
        self.stash.release(p)
        self._stashed.discard(p)
        self.memory.free("stashed versions", self.version_bytes)

    # Compute -----------------------------------------------------------------------------
    def _read_weights_graph(self):
        return [tf.identity(v.value) for v in self.trainable]

    def _forward_graph(self, weights, entering, labels, training, update_state=True):
        state = [v.value for v in self.non_trainable]
        sent, new_state, reg = self.stage.stateless_call(weights, state, entering, training)
        for v, value in zip(self.non_trainable, new_state) if update_state else ():
            v.assign(value)
        if not self.is_last:
            return sent, reg, {}
        labels = self.loss_head.split_labels(labels)
        loss = self.loss_head.loss(labels, sent) + reg
        with tf.name_scope("metrics"):
            metrics = self.loss_head.metrics(labels, [tf.stop_gradient(o) for o in sent])
        return [loss], reg, dict(metrics, loss=loss)

    def _weights(self, p, live):
        """The weights minibatch p's pass uses: the live ones, or its stashed version w_p."""
        if live:
            with tf.device(self.device):
                weights = self._read_weights_fn()
            if self.record_provenance:
                self.used_versions[p] = tuple(self.applied)
                self.used_globals[p] = self.global_included
            return weights
        if self.record_provenance:
            self.used_versions[p] = self.version_updates.pop(p)
            self.used_globals[p] = self.version_globals.pop(p, frozenset())
        return self.stash.get(p, self._dtypes)

    def forward(self, p, training=True, live=False, recompute=False):
        """Forward pass of minibatch p with its stashed weight version w_p (`live`: with the live
        weights); with `recompute`, untaped, keeping only its inputs for :meth:`recompute`."""
        entering = _in_order(self._entering.pop(p))
        weights = self._weights(p, live)
        labels = self._labels.pop(p) if self.is_last else None
        if recompute:
            self._kept[p] = (entering, labels)
            with tf.device(self.device):
                targets, reg, logs = self._forward_fn(weights, entering, labels, training)
        else:
            targets, logs = self._taped_forward(p, weights, entering, labels, training, update_state=True)
        if self.is_last:
            loss = float(logs["loss"])
            if not np.isfinite(loss):
                values = {k: float(v) for k, v in logs.items()}
                raise NonFiniteError(
                    f"minibatch {p}: the loss is {loss} on stage {self.index} (the last); nothing of "
                    f"minibatch {p} was applied or pushed. Lower the learning rate, look for NaN or Inf "
                    f"in the data, or clip gradients (the optimizer's clipnorm)", p, self.index, values)
            self.logs[p] = logs
            return logs
        return targets

    def _timed_pass_graph(self, weights, entering, labels):
        _, sources = self._differentiated(weights, entering)
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(sources)
                targets, reg, _ = self._forward_graph(weights, entering, labels, True, update_state=False)
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

    def recompute(self, p, training=True):
        """Runs minibatch p's forward pass again from the inputs its untaped pass kept, with the
        live weights, under a tape for :meth:`backward`; the non-trainable state is not updated again."""
        entering, labels = self._kept.pop(p)
        with tf.device(self.device):
            weights = self._read_weights_fn()
        self._taped_forward(p, weights, entering, labels, training, update_state=False)

    def _differentiated(self, weights, entering):
        """What a pass is differentiated with respect to: what the previous stage sent (its gradient
        goes back; model inputs loaded here need no gradient) and the weights. Returns the
        positions of the received floating-point tensors and the sources (those, then the weights)."""
        float_pos = [i for i in range(len(self.stage.io.received)) if _is_float(entering[i])]
        return float_pos, [entering[i] for i in float_pos] + list(weights)

    def _taped_forward(self, p, weights, entering, labels, training, update_state):
        """Runs the pass under a tape and keeps it, with its activations, until :meth:`backward`."""
        self.memory.allocate("activations", self.activation_bytes)
        float_pos, sources = self._differentiated(weights, entering)
        with tf.device(self.device):
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
                tape.watch(sources)
                targets, reg, logs = self._forward_fn(weights, entering, labels, training, update_state)
        position = {i: k for k, i in enumerate(float_pos)}
        n_received = len(self.stage.io.received)
        self._inflight[p] = _InFlight(tape=tape, sources=sources, num_entering=len(float_pos),
                                      received_float=[position.get(i) for i in range(n_received)],
                                      targets=list(targets) + ([] if self.is_last else [reg]))
        return targets, logs

    def backward(self, p, output_grads=None):
        """Backward pass of minibatch p against w_p; keeps the weight gradients for apply_update."""
        record = self._inflight.pop(p)
        if self.is_last:
            seeds = None
        else:
            float_targets = [t for t in record.targets[:-1] if _is_float(t)]
            seeds = [g for t, g in zip(record.targets[:-1], output_grads) if _is_float(t)]
            record.targets = float_targets + [record.targets[-1]]
            seeds = seeds + [tf.ones_like(record.targets[-1])]
        with tf.device(self.device):
            grads = record.tape.gradient(record.targets, record.sources, output_gradients=seeds,
                                         unconnected_gradients=tf.UnconnectedGradients.ZERO)
        self.memory.free("activations", self.activation_bytes)
        self._weight_grads[p] = grads[record.num_entering:]
        self._input_grads[p] = [grads[k] if k is not None else None for k in record.received_float]

    def input_gradients(self, p):
        """The gradient of minibatch p's received tensors, for the previous stage."""
        return self._input_grads.pop(p)

    def _apply_graph(self, grads):
        """Applies the gradients if every one is finite; returns whether they were."""
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(
            g.values if isinstance(g, tf.IndexedSlices) else g)) for g in grads])

        def apply():
            self.optimizer.apply(grads, self.trainable)
            return tf.constant(True)

        return tf.cond(finite, apply, lambda: tf.constant(False))

    def apply_update(self, p):
        """w_local := w_local + u_p, unless u_p is not finite (then NonFiniteError)."""
        self._apply(self._weight_grads.pop(p), (p,))

    def _compensate_graph(self, p, grads, variance_control):
        version = self.stash.get(p, self._dtypes)
        grads = [tf.convert_to_tensor(g) for g in grads]
        return [g + variance_control * g * g * (w.value - v) for g, w, v in zip(grads, self.trainable, version)]

    def compensate_gradient(self, p, variance_control):
        """TaylorPipe (seed 003 §3.2, Algorithm 1): replaces minibatch p's weight gradient g, computed
        against its stashed version W_t = w_p (the local model), by the first-order Taylor prediction
        of the gradient at the live weights W̄ (the master model), g + λ·g⊙g⊙(W̄ − W_t), with
        λ = `variance_control`; one compiled call on the stage's device. w_p must still be stashed
        (before ``release_weights(p)``); a sparse gradient (an embedding's) becomes dense."""
        if not self.trainable:  # a stage may have no weights (pooling, activations)
            return
        with tf.device(self.device):
            self._weight_grads[p] = self._compensate_fn(tf.constant(p, tf.int64), self._weight_grads[p],
                                                        float(variance_control))

    def accumulate_gradient(self, p):
        """Adds minibatch p's weight gradients to the sum since the last flush (GPipe)."""
        grads = [tf.convert_to_tensor(g) for g in self._weight_grads.pop(p)]
        self._accumulated = (grads, [p]) if self._accumulated is None else (
            self.sum(self._accumulated[0], grads), self._accumulated[1] + [p])

    def apply_accumulated(self, first, p):
        """GPipe's flush: one update from the mean of the gradients of microbatches `first`..p."""
        total, summed = self._accumulated
        if summed != list(range(first, p + 1)):
            raise RuntimeError(f"stage {self.index}: the flush of microbatches {first}..{p} found the "
                               f"gradients of {summed}; the schedule must accumulate each microbatch once")
        self._accumulated = None
        with tf.device(self.device):
            mean = self._mean_fn(total, tf.constant(len(summed), total[0].dtype)) if total else []
        self._apply(mean, tuple(summed))

    def _apply(self, grads, minibatches):
        """Applies `grads`, the update of `minibatches`, to w_local unless one is not finite; the
        verdict is read back by the next apply or :meth:`check_applied`."""
        self.check_applied()
        if self.trainable:  # a stage may have no weights (pooling, activations)
            with tf.device(self.device):
                self._unchecked.append((self._apply_fn(grads), grads, minibatches))
        self.applied.extend(minibatches)

    def check_applied(self):
        """Reads back whether the applies since the last check were finite; raises
        :class:`NonFiniteError` for the first that was not (it applied nothing)."""
        unchecked, self._unchecked = self._unchecked, []
        for finite, grads, minibatches in unchecked:
            if bool(finite):
                continue
            bad = [v.path for v, g in zip(self.stage.trainable_variables, grads) if not np.all(np.isfinite(
                tf.convert_to_tensor(g).numpy()))]
            which = (f"minibatch {minibatches[0]}" if len(minibatches) == 1
                     else f"minibatches {minibatches[0]}..{minibatches[-1]}")
            raise NonFiniteError(
                f"{which}: the gradient of stage {self.index} is not finite (NaN or Inf in "
                f"{', '.join(bad)}); nothing of it was applied or pushed. Lower the learning rate or "
                f"clip gradients (the optimizer's clipnorm)", minibatches[-1], self.index)

    # Synchronisation ---------------------------------------------------------------------
    def _read_synchronised_graph(self):
        return [tf.identity(v.value) for v in self.synchronised]

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

    def _now_including(self, stashed, included):
        self.global_included = frozenset(included)
        if self.record_provenance:
            for p in stashed:
                self.version_globals[p] = self.global_included

    def add_to_weights(self, deltas, first_minibatch, included):
        """Adds `deltas` (one per synchronised variable) to the live variables and to the versions
        stashed for minibatches >= `first_minibatch`, which thereby hold the global updates
        `included` ((worker, clock) pushes), as the live weights now do; one compiled call on the
        stage's device."""
        stashed, padded = self._stashed_from(first_minibatch)
        with tf.device(self.device):
            self._add_to_weights_fn(list(deltas), padded)
        self._now_including(stashed, included)

    def merge_pulled(self, base, pulled, first_minibatch, included):
        """:meth:`add_to_weights` of ``pulled - base`` in the same compiled call that computes it (one
        RPC where the device is another task's): the merge of global weights pulled after the
        pushes `included` (§5). Returns ``base + (pulled - base)``, the new base of the next push."""
        stashed, padded = self._stashed_from(first_minibatch)
        with tf.device(self.device):
            new_base = self._merge_fn(list(base), list(pulled), padded)
        self._now_including(stashed, included)
        return new_base

    def end_run(self):
        """Drops what a stopped or failed run left behind: versions stashed for minibatches
        that never ran, and their inputs, so that the next run starts clean."""
        for p in self.stash.stats().minibatches:
            self.release_weights(p)
        self._stashed.clear()
        for p in list(self._inflight):
            self._inflight.pop(p)
            self.memory.free("activations", self.activation_bytes)
        for pending in (self._entering, self._labels, self._weight_grads, self._input_grads,
                        self.version_updates, self.version_globals, self._kept, self._unchecked):
            pending.clear()
        self._accumulated = None

    # State -------------------------------------------------------------------------------
    def snapshot(self):
        """The stage's state now (tensors share buffers until the variables change)."""
        return StageState(trainable=[tf.identity(v.value) for v in self.trainable],
                          non_trainable=[tf.identity(v.value) for v in self.non_trainable],
                          optimizer=[tf.identity(v.value) for v in self.optimizer.variables],
                          applied=tuple(self.applied),
                          used=(dict(self.used_versions), dict(self.used_globals)) if self.record_provenance
                          else ({}, {}),
                          sync=(self.sync_state.snapshot() if self.sync_state else None, self.global_included))

    def restore(self, state):
        """Sets the stage's live state back to `state` (a :meth:`snapshot`)."""
        for variables, values in ((self.trainable, state.trainable), (self.non_trainable, state.non_trainable),
                                  (self.optimizer.variables, state.optimizer)):
            for v, value in zip(variables, values):
                v.assign(value)
        self.applied = list(state.applied)
        self.used_versions, self.used_globals = dict(state.used[0]), dict(state.used[1])
        sync_state, self.global_included = state.sync
        if self.sync_state:
            self.sync_state.restore(sync_state)

    def load_model_weights(self):
        """Sets the live weights to the Keras model's own and starts the synchronisation
        bookkeeping from them (a new run after an aborted one; the optimizer's state stays)."""
        for variables, sources in ((self.trainable, self.stage.trainable_variables),
                                   (self.non_trainable, self.stage.non_trainable_variables)):
            for v, source in zip(variables, sources):
                v.assign(source.value)
        self.sync_state = self.sync_scheme.stage_state(self)
        self.global_included = frozenset()

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


def _mean_graph(total, count):
    return [x / count for x in total]


def _block(tensors):
    """Waits until `tensors` are computed (GPU kernels run asynchronously)."""
    for t in tf.nest.flatten(tensors):
        if hasattr(t, "device") and "GPU" in t.device:
            np.asarray(tf.reshape(t, [-1])[:1])
            return


def _moved(tensors, device):
    """`tensors` (any structure; None entries kept) copied onto `device`, there when this returns."""
    with tf.device(device):
        moved = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), tensors)
    for t in tf.nest.flatten(moved):
        if t is not None:
            np.asarray(tf.reshape(t, [-1])[:1])
    return moved


def measure_stage_times(runtimes, split_inputs, x, y, repeats=7):
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
    on_device = [{Forward: [], Backward: []} if _is_remote(rt.device) else None for rt in runtimes]
    saved = [[v.numpy() for v in rt.non_trainable] for rt in runtimes]  # copies, not the variables
    for _ in range(repeats + 1):
        for rt in runtimes:
            rt.stash_weights(0)
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
                carry = rt.forward(0)
                _block(carry)
            times[s][Forward].append(time.perf_counter() - t0)
        grads = None
        for s in reversed(range(len(runtimes))):
            rt = runtimes[s]
            grads = _moved(grads, rt.device)
            t0 = time.perf_counter()
            with rt.execution_scope():
                rt.backward(0, grads)
                _block(rt._weight_grads[0])
            grads = rt.input_gradients(0)
            times[s][Backward].append(time.perf_counter() - t0)
            rt._weight_grads.pop(0)
            rt.release_weights(0)
        runtimes[-1].logs.pop(0, None)
    for rt, values in zip(runtimes, saved):
        for v, value in zip(rt.non_trainable, values):
            v.assign(value)
        rt.version_updates.pop(0, None)
        rt.used_versions.pop(0, None)
    return [{kind: min(ts[1:]) for kind, ts in (device or stage).items()} for stage, device in zip(times, on_device)]
