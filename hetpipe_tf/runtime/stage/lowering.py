"""The lowering of a stage's device instructions to compiled calls (HetPipe §4).

**One call per task.** The device instructions of one task (on the last stage a minibatch's
forward pass, backward pass, release, update and the next stash; on the others a forward task,
and a backward task with the update and the next stash) run as one compiled graph function on
the stage's device (:class:`hetpipe_tf.runtime.compiled.CompiledCall`), traced once for each
shape of task (:func:`task_shape`: the instruction types and the minibatch offsets between
them) and called with the minibatch ids as a tensor. A forward pass whose backward pass comes
in a later task runs as TensorFlow's forward function of the pass, which also returns the
intermediates that the later backward call takes in
(:class:`hetpipe_tf.runtime.compiled.SplitPass`).
"""
import functools
from collections.abc import Sequence

import tensorflow as tf

from hetpipe_tf.pipeline.instructions import (
    AccumulateGradient, ApplyAccumulated, ApplyUpdate, Backward, CompensateGradient, Forward, Instruction,
    Recompute, ReleaseWeights, StashWeights)
from hetpipe_tf.runtime.compiled import CompiledCall, spec_of
from hetpipe_tf.runtime.stage.passes import Nest, StagePass, is_float
from hetpipe_tf.runtime.stage.slots import MinibatchSlots, SlotValue
from hetpipe_tf.runtime.stage.updates import StageUpdate
from hetpipe_tf.runtime.stage.verdicts import FINITE, checked_gradient, combined, verdict_code
from hetpipe_tf.runtime.stage.weights import StageWeights

#: A task's shape: (instruction type, minibatch offset from the first, fixed fields) per instruction.
TaskShape = tuple[tuple[type[Instruction], int, tuple[bool | float | int, ...]], ...]
#: An input or output of a compiled task: (kind, minibatch offset).
Key = tuple[str, int]


def task_shape(instructions: Sequence[Instruction]) -> tuple[int, TaskShape]:
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


def _parts(instructions: Sequence[Instruction]) -> list[Sequence[Instruction]]:
    """The tasks that the executor joined into one run of device instructions (a forward pass of
    a later minibatch than the run's first starts the second,
    :meth:`hetpipe_tf.pipeline.executor.PipelineExecutor._joined`), or [] for one task's run."""
    base = instructions[0].minibatch
    for n, ins in enumerate(instructions):
        if n and isinstance(ins, (Forward, Recompute)) and ins.minibatch != base:
            return [instructions[:n], instructions[n:]]
    return []


class TaskTrace:
    """What one compiled task's graph holds while it is traced: minibatch ids by offset, the
    inputs by key, each pass's tape, each minibatch's gradients and verdict, the running sum of
    microbatch gradients, and the outputs by key."""

    def __init__(self, offsets: Sequence[int], base: tf.Tensor, inputs: dict[Key, SlotValue],
                 terms_at: set[int]) -> None:
        self.id = {o: base + o for o in offsets}
        self.inputs = inputs
        self.terms_at = terms_at  # offsets whose update terms this call makes (first stage)
        self.taped = {}  # offset -> (tape, sources, number of received sources, targets, regularisation)
        self.grads = {}  # offset -> (weight gradients, verdict)
        self.terms = {}  # offset -> the update terms of the minibatch (hetpipe_tf.runtime.update_terms)
        self.scales = {}  # offset -> the loss scale S_p the minibatch's loss was multiplied by
        self.acc = inputs.get(("acc", 0))
        self.outputs = {}


def _passes(shape: TaskShape) -> tuple[set[int], set[int]]:
    """The minibatch offsets of a task's forward passes (or recomputations) and backward passes."""
    return ({o for t, o, _ in shape if t in (Forward, Recompute)}, {o for t, o, _ in shape if t is Backward})


def _input_keys(shape: TaskShape, is_last: bool, update: StageUpdate, terms_at: set[int]) -> list[Key]:
    """The inputs a task of `shape` takes, in order."""
    forwards, backwards = _passes(shape)
    keys = []
    for t, o, _ in shape:
        if t is Forward:
            keys += [("entering", o)] + ([("labels", o)] if is_last else [])
        elif t is Recompute:
            keys.append(("kept", o))
        elif t is Backward:
            if not is_last:
                keys.append(("out_grads", o))
            if o not in forwards:
                keys.append(("record", o))
            if o in terms_at and update.tied_sources:
                keys.append(("tied_in", o))
        elif t in (CompensateGradient, ApplyUpdate, AccumulateGradient) and o not in backwards:
            keys.append(("weight_grads", o))
        if t is ApplyUpdate and update.takes_terms and o not in backwards:
            keys.append(("terms", o))
    return list(dict.fromkeys(keys))


class CompiledTask:
    """One shape of task (:func:`task_shape`) compiled for a stage: which inputs the call takes
    (keys such as ("entering", offset)), which outputs it gives, and its compiled call."""

    def __init__(self, lowering: "TaskLowering", shape: TaskShape, accumulating: bool) -> None:
        self.shape = shape
        self.offsets = sorted({o for _, o, _ in shape})
        forwards, backwards = _passes(shape)
        # The first stage makes a minibatch's update terms where its backward pass and update run together.
        update = lowering.update
        self.terms_at = {o for t, o, _ in shape if t is ApplyUpdate and o in backwards} if update.makes_terms else set()
        self.inputs = _input_keys(shape, lowering.passes.is_last, update, self.terms_at)
        if accumulating:
            self.inputs.append(("acc", 0))
        # A pass is taped in the graph when its backward pass runs in the same call; else split.
        self.in_graph = forwards & backwards
        self.call = CompiledCall(functools.partial(lowering.task_graph, self), lowering.device,
                                 name=f"{lowering.name}_task")
        self.outputs: list[Key] | None = None  # known once traced


class TaskLowering:
    """Lowers runs of a stage's device instructions to compiled calls and makes their graphs.
    `records_terms`: whether the run records which clip factor and loss scale each update took."""

    def __init__(self, name: str, device: str, passes: StagePass, weights: StageWeights, update: StageUpdate,
                 records_terms: bool) -> None:
        self.name = name
        self.index = update.index
        self.device = device
        self.passes = passes
        self.weights = weights
        self.update = update
        self.records_terms = records_terms
        self._tasks = {}  # (task shape, accumulating) -> CompiledTask
        self._ids = {}  # minibatch id -> the same as an int64 tensor

    def call(self, instructions: Sequence[Instruction], slots: MinibatchSlots) -> list[tuple[str, int, SlotValue]]:
        """Runs `instructions` (device instructions of one task, in program order) in one compiled
        call, its inputs taken out of `slots`; returns its outputs as (kind, minibatch, value)."""
        base, shape = task_shape(instructions)
        key = (shape, slots.accumulated is not None)
        task = self._tasks.get(key)
        if task is None:
            task = self._tasks[key] = CompiledTask(self, shape, key[1])
        args = [self._minibatch_id(base)] + [slots.take(kind, base + o) for kind, o in task.inputs]
        if task.outputs is None:
            values = {(kind, base + o): value for (kind, o), value in zip(task.inputs, args[1:])}
            self._trace(task, args[0], values, base)
            for part in _parts(instructions):  # each also runs alone, when the executor does not join them
                part_base, part_shape = task_shape(part)
                if (part_shape, key[1]) not in self._tasks:
                    self._tasks[(part_shape, key[1])] = CompiledTask(self, part_shape, key[1])
                    self._trace(self._tasks[(part_shape, key[1])], args[0], values, part_base)
        outputs = task.call(*args)
        return [(kind, base + o, value) for (kind, o), value in zip(task.outputs, outputs)]

    def _trace(self, task: CompiledTask, minibatch_id: tf.Tensor, values: dict[tuple[str, int], SlotValue],
               base: int) -> None:
        """Traces `task` for inputs like `values` ({(kind, minibatch): value}), its first minibatch
        `base`. A part whose inputs are not all among `values` (another part makes them) is traced
        on its first run instead."""
        inputs = [(kind, base + o) for kind, o in task.inputs]
        if all(k in values for k in inputs):
            task.call.trace(tuple([spec_of(minibatch_id)] + [self._input_spec(k[0], values[k]) for k in inputs]))

    def _minibatch_id(self, p: int) -> tf.Tensor:
        """Minibatch id p as an int64 tensor, made once for the few calls of a minibatch."""
        tensor = self._ids.get(p)
        if tensor is None:
            if len(self._ids) >= 64:
                self._ids.clear()
            tensor = self._ids[p] = tf.constant(p, tf.int64)
        return tensor

    def _input_spec(self, kind: str, value: SlotValue) -> Nest:
        """The spec a compiled task takes input `kind` with: what a minibatch brings for minibatches of
        any size, a split pass's record as the pass makes it, gradients as they are."""
        if kind in ("entering", "labels", "kept"):
            return spec_of(value, relax_batch=True)
        if kind == "out_grads":
            return (spec_of(value[0], relax_batch=True),) + spec_of(tuple(value[1:]))
        if kind == "record":
            weights, entering, labels, _ = value
            return self.passes.specs(weights, entering, labels) + (self.passes.recorded.record_specs,)
        return spec_of(value)

    # The graph of a task --------------------------------------------------------------
    def task_graph(self, task: CompiledTask, base: tf.Tensor, *inputs: SlotValue) -> list[SlotValue]:
        """The graph function of `task`: each instruction in program order."""
        tr = TaskTrace(task.offsets, base, dict(zip(task.inputs, inputs)), task.terms_at)
        for t, o, fixed in task.shape:
            if t is Forward:
                live, recompute = fixed
                weights = self.weights.live() if live else self.weights.version(tr.id[o])
                entering, labels = tr.inputs[("entering", o)], tr.inputs.get(("labels", o), ())
                if recompute:  # untaped: Recompute(p) runs it again
                    targets, _, logs = self.passes.graph(weights, entering, labels)
                    self._emit_pass(tr, o, targets, logs)
                else:
                    self._lower_pass(tr, o, weights, entering, labels, True, o in task.in_graph)
            elif t is Recompute:
                entering, labels = tr.inputs[("kept", o)]
                self._lower_pass(tr, o, self.weights.live(), entering, labels, False, o in task.in_graph)
            elif t is Backward:
                self._lower_backward(tr, o)
            elif t is ReleaseWeights:
                self.weights.stash.release(tr.id[o])
            elif t is CompensateGradient:
                self._lower_compensate(tr, o, fixed[0])
            elif t is ApplyUpdate:
                self._lower_apply(tr, o)
            elif t is AccumulateGradient:
                self._lower_accumulate(tr, o)
            elif t is ApplyAccumulated:
                total, verdict = tr.acc
                count = float(o - fixed[0] + 1)
                mean = [g / tf.constant(count, g.dtype) for g in total]
                tr.outputs[("verdict", o)] = self.update.apply(mean, verdict)
                tr.acc = None
            elif t is StashWeights:
                self.weights.stash.put(tr.id[o], [v.value for v in self.weights.trainable])
        if tr.acc is not None:
            tr.outputs[("acc", 0)] = tr.acc
        for o, grads in tr.grads.items():  # gradients a later call applies
            tr.outputs[("weight_grads", o)] = grads
        task.outputs = list(tr.outputs)
        return list(tr.outputs.values())

    def _lower_pass(self, tr: TaskTrace, o: int, weights: list[tf.Tensor], entering: list[tf.Tensor], labels: Nest,
                    update_state: bool, in_graph: bool) -> None:
        """A taped pass whose backward pass runs in this call (`in_graph`), or the forward call of
        the split pass, whose record a later call's backward pass takes in."""
        if in_graph:
            float_pos, sources = self.passes.differentiated(weights, entering)
            scale = self.update.scale_now()
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
                tape.watch(sources)
                targets, reg, logs = self.passes.graph(weights, entering, labels, update_state=update_state)
                differentiated = [targets[0] * tf.cast(scale, targets[0].dtype)] if scale is not None else targets
            tr.taped[o] = (tape, sources, len(float_pos), differentiated, reg)
            if scale is not None:
                tr.scales[o] = scale
            self._emit_pass(tr, o, targets, logs)
            return
        split = self.passes.split(update_state, weights, entering, labels)
        outputs, record = split.forward(weights, entering, labels)
        if self.passes.is_last:
            self._emit_pass(tr, o, outputs[:1], dict(zip(self.passes.log_names, outputs[1:])))
        else:
            self._emit_pass(tr, o, outputs[:-1], {})
        tr.outputs[("record", o)] = (list(weights), list(entering), labels, record)

    def _emit_pass(self, tr: TaskTrace, o: int, targets: list[tf.Tensor], logs: dict[str, tf.Tensor]) -> None:
        if self.passes.is_last:
            tr.outputs[("logs", o)] = logs
        else:
            tr.outputs[("sent", o)] = list(targets)

    def _backward_gradients(self, tr: TaskTrace, o: int) -> tuple[list, list, tf.Tensor | None]:
        """(gradients of the received floating-point tensors, weight gradients, the loss on the
        last stage) of minibatch offset `o`: from its tape in this call, or from its split pass's record."""
        passes = self.passes
        if o in tr.taped:
            tape, sources, num_received, targets, reg = tr.taped.pop(o)
            if passes.is_last:
                targets, seeds, loss = list(targets), None, targets[0]
            else:
                out_grads = tr.inputs[("out_grads", o)][0]
                targets = [t for t in targets if is_float(t)] + [reg]
                seeds, loss = list(out_grads) + [self._reg_seed(tr, o, reg)], None
            grads = tape.gradient(targets, sources, output_gradients=seeds,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return grads[:num_received], grads[num_received:], loss
        weights, entering, labels, record = tr.inputs[("record", o)]
        n = passes.recorded.num_outputs
        if passes.is_last:  # d(S_p * loss) = S_p * d(loss)
            seed = tf.ones_like(record[0])
            scale = self.update.scale_now()
            if scale is not None:
                tr.scales[o] = scale
                seed = seed * tf.cast(scale, seed.dtype)
            seeds, loss = [seed] + [None] * (n - 1), record[0]
        else:
            out_grads = iter(tr.inputs[("out_grads", o)][0])
            seeds = [next(out_grads) if is_float(t) else None for t in record[:n - 1]]
            seeds, loss = seeds + [self._reg_seed(tr, o, record[n - 1])], None
        grads = passes.recorded.backward(seeds, record, tf.nest.flatten((weights, entering, labels),
                                                                        expand_composites=True))
        received_grads = [grads[len(weights) + i] for i in range(passes.num_received) if is_float(entering[i])]
        return received_grads, grads[:len(weights)], loss

    def _reg_seed(self, tr: TaskTrace, o: int, reg: tf.Tensor) -> tf.Tensor:
        """The seed of a stage's regularisation loss `reg` (before the last): S_p under loss scaling,
        as the loss Keras scales includes the model's own losses; else 1."""
        if self.update.rule.loss_scaling is None:
            return tf.ones_like(reg)
        return tf.ones_like(reg) * tf.cast(tr.inputs[("out_grads", o)][3], reg.dtype)

    def _lower_backward(self, tr: TaskTrace, o: int) -> None:
        received_grads, weight_grads, loss = self._backward_gradients(tr, o)
        if self.passes.is_last:
            code, squared, scale = tf.constant(FINITE, tf.int32), tf.constant(0.0), tr.scales.pop(o, tf.constant(1.0))
        else:
            _, code, squared, scale = tr.inputs[("out_grads", o)]
        if loss is not None:
            code = combined(code, tf.logical_not(tf.math.is_finite(loss)), verdict_code(self.index, loss=True))
        code = checked_gradient(code, weight_grads, self.index)
        squared = self.update.squared(squared, weight_grads, scale)
        tr.grads[o] = (list(weight_grads), code)
        if self.passes.num_received:
            tr.outputs[("input_grads", o)] = (received_grads, code, squared, scale)
        if self.index > 0 and self.update.tied_positions:
            tr.outputs[("tied", o)] = self.update.tied_gradients(weight_grads)
        if o in tr.terms_at:
            tied_in = tr.inputs.get(("tied_in", o), [])
            tr.terms[o] = self.update.terms(weight_grads, code, squared, scale, tied_in)
            tr.outputs[("terms", o)] = tr.terms[o]

    def _grads_of(self, tr: TaskTrace, o: int) -> tuple[list, tf.Tensor]:
        """(weight gradients, verdict) of minibatch offset `o`: computed in this call, or taken in
        from an earlier one."""
        if o in tr.grads:
            return tr.grads.pop(o)
        return tr.inputs[("weight_grads", o)]

    def _lower_compensate(self, tr: TaskTrace, o: int, variance_control: float) -> None:
        """TaylorPipe's delay compensation of p's weight gradient g, computed against w_p:
        g := g + λ·g⊙g⊙(w_local − w_p)."""
        grads, code = self._grads_of(tr, o)
        trainable = self.weights.trainable
        if trainable:  # a stage may have no weights (pooling, activations)
            version = self.weights.version(tr.id[o])
            grads = [tf.convert_to_tensor(g) for g in grads]
            grads = [g + variance_control * g * g * (w.value - v) for g, w, v in zip(grads, trainable, version)]
        tr.grads[o] = (grads, checked_gradient(code, grads, self.index))

    def _lower_accumulate(self, tr: TaskTrace, o: int) -> None:
        grads, verdict = self._grads_of(tr, o)
        grads = [tf.convert_to_tensor(g) for g in grads]
        if tr.acc is not None:
            total, code = tr.acc
            grads = [a + g for a, g in zip(total, grads)]
            verdict = tf.where(code != FINITE, code, verdict)
        tr.acc = (grads, verdict)

    def _lower_apply(self, tr: TaskTrace, o: int) -> None:
        grads, code = self._grads_of(tr, o)
        if o in tr.terms or self.update.takes_terms:
            terms = tr.terms.pop(o) if o in tr.terms else tr.inputs[("terms", o)]
            grads = self.update.with_terms(grads, terms)
            code, scale, clip = terms[:3]
            if self.records_terms:
                tr.outputs[("applied_terms", o)] = tf.stack([clip, tf.cast(scale, clip.dtype)])
        tr.outputs[("verdict", o)] = self.update.apply(grads, code)
