"""The façade of one pipeline stage on its device, which the executor drives (see the package
docstring): it carries out the stage's device instructions (:data:`DEVICE_INSTRUCTIONS`) with
its weights, its minibatches' slots, the lowering to compiled calls and its update, and keeps
the host's bookkeeping (memory, updates held, verdicts read back, provenance)."""
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import keras
import tensorflow as tf

from hetpipe_tf.compat import eager_context as context
from hetpipe_tf.ops.weight_stash import WeightStash
from hetpipe_tf.pipeline.emulation import MemoryAccount
from hetpipe_tf.pipeline.instructions import (
    AccumulateGradient, ApplyAccumulated, ApplyUpdate, Backward, CompensateGradient, Forward, Instruction,
    Recompute, ReleaseWeights, StashWeights)
from hetpipe_tf.pipeline.schedule import NO_SYNC, NO_WORKER_UPDATE, SyncScheme, WorkerUpdate
from hetpipe_tf.runtime.loss_head import LossHead
from hetpipe_tf.runtime.provenance import Provenance
from hetpipe_tf.runtime.run_config import RunConfig
from hetpipe_tf.runtime.stage.lowering import TaskLowering
from hetpipe_tf.runtime.stage.passes import Nest, StagePass
from hetpipe_tf.runtime.stage.slots import MinibatchSlots, SlotValue
from hetpipe_tf.runtime.stage.synchronised import SynchronisedWeights
from hetpipe_tf.runtime.stage.updates import StageUpdate
from hetpipe_tf.runtime.stage.verdicts import FINITE, non_finite_error, read_verdict
from hetpipe_tf.runtime.stage.weights import StageWeights
from hetpipe_tf.runtime.stage_rewrite import TiedVariable, variable_bytes
from hetpipe_tf.runtime.update_terms import ScaleState, UpdateRule

#: The instructions a stage runtime carries out on its device (:meth:`StageRuntime.run`).
DEVICE_INSTRUCTIONS = frozenset({Forward, Recompute, Backward, CompensateGradient, ReleaseWeights, ApplyUpdate,
                                 AccumulateGradient, ApplyAccumulated, StashWeights})
#: What :meth:`hetpipe_tf.runtime.provenance.Provenance.snapshot` gives: (used versions, used globals, live globals).
ProvenanceSnapshot = tuple[dict[int, tuple[int, ...]], dict[int, frozenset], frozenset]
#: How many verdicts a stage keeps unread at most. The first stage reads each before it reports
#: the minibatch done; every stage reads them before a push, a snapshot and the end of a run.
_UNCHECKED = 64


@dataclass(frozen=True)
class StageState:
    """A stage's state right after some update: what a checkpoint or evaluation needs.
    `applied`: the minibatches whose updates it holds; `sync`: the synchronisation scheme's
    snapshot of its stage state; `provenance`: the record's snapshot, when recording it
    (:class:`hetpipe_tf.runtime.provenance.Provenance`)."""
    trainable: list[tf.Tensor]
    non_trainable: list[tf.Tensor]
    optimizer: list[tf.Tensor]
    applied: tuple[int, ...] = ()
    sync: Nest = None
    provenance: ProvenanceSnapshot | None = None


class StageRuntime:
    """One stage of a virtual worker on its device (see :mod:`hetpipe_tf.runtime.stage`)."""

    #: What :meth:`run` carries out (the executor groups a task's consecutive ones into one call).
    device_instructions = DEVICE_INSTRUCTIONS

    def __init__(self, stage: keras.Model, device: str, config: RunConfig, loss_head: LossHead | None = None,
                 memory: MemoryAccount | None = None, activation_bytes: int = 0, sync: SyncScheme = NO_SYNC,
                 variable_paths: Mapping[int, Sequence[str]] | None = None,
                 worker_update: WorkerUpdate = NO_WORKER_UPDATE, ties: Sequence[TiedVariable] = ()) -> None:
        self.stage = stage
        self.index = stage.index
        #: The weights' paths of every stage of the virtual worker (for messages naming them).
        self.variable_paths = variable_paths or {stage.index: [v.path for v in stage.trainable_variables]}
        self.device = device
        self.memory = memory or MemoryAccount(device)
        self.activation_bytes = int(activation_bytes)
        #: Which updates each weight version held, when the run records it (None: it does not).
        self.provenance = Provenance() if config.record_provenance else None
        self.single_threaded = config.single_threaded_stages
        name = f"stage{self.index}"
        self.weights = StageWeights(stage, device, config.optimizer, config.num_in_flight, name)
        is_last = loss_head is not None
        self.update = StageUpdate(self.index, is_last, self.weights, config.update_rule, worker_update, ties, device,
                                  self.single_threaded)
        self.passes = StagePass(stage, self.weights.non_trainable, loss_head, device, name)
        self.lowering = TaskLowering(name, device, self.passes, self.weights, self.update,
                                     records_terms=self.provenance is not None)
        self.slots = MinibatchSlots(len(stage.io.received), self.update.tied_sources)
        self.version_bytes = self.weights.version_bytes
        self.memory.allocate("weights", self.version_bytes + variable_bytes(self.non_trainable))
        self.memory.allocate("optimizer slots", variable_bytes(self.optimizer.variables))
        # A tied weight's replica on a later stage is pushed by the first stage holding one only.
        followers = {pos for tie in ties for st, pos in tie.replicas if st == self.index and st != tie.replicas[0][0]}
        self.synchronisation = SynchronisedWeights(self.weights, device, followers, self.provenance)
        if sync.weight_copies:
            self.memory.allocate("synchronisation copies",
                                 sync.weight_copies * variable_bytes(self.synchronisation.variables))
        self.sync_scheme = sync
        self.sync_state = sync.stage_state(self.synchronisation)
        self.skipped = set()  # minibatches a loss scale overflow skipped (read back by check_applied)
        self.applied = []  # minibatch ids whose updates w_local holds, in order

    # What other layers read -------------------------------------------------------------
    @property
    def is_last(self) -> bool:
        return self.passes.is_last

    @property
    def trainable(self) -> list[keras.Variable]:
        return self.weights.trainable

    @property
    def non_trainable(self) -> list[keras.Variable]:
        return self.weights.non_trainable

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        return self.weights.optimizer

    @property
    def stash(self) -> WeightStash:
        return self.weights.stash

    @property
    def rule(self) -> UpdateRule:
        return self.update.rule

    @property
    def scale_state(self) -> ScaleState | None:
        """The dynamic loss scale and its counter (first stage, under loss scaling)."""
        return self.update.scale_state

    @property
    def loss_scale(self) -> keras.Variable | None:
        """The loss scale the loss is multiplied by (last stage, under loss scaling)."""
        return self.update.loss_scale

    @property
    def logs(self) -> dict[int, dict[str, tf.Tensor]]:
        """Minibatch -> its loss and metrics, tensors (last stage)."""
        return self.slots.logs

    @property
    def applied_terms(self) -> dict[int, tf.Tensor]:
        """When recording provenance: minibatch -> (the global clip's factor, the loss scale S_p) its update took."""
        return self.slots.applied_terms

    def execution_scope(self) -> contextlib.AbstractContextManager:
        """How the stage's functions run. With `single_threaded`, the stage's kernels run one
        after another on its own thread (TensorFlow's single-threaded function executor), so a
        stage uses one core, as a GPU runs a stage's kernels in one stream; by default
        TensorFlow's inter-op pool may spread a stage's independent ops over every core."""
        if self.single_threaded:
            return context.function_executor_type("SINGLE_THREADED_EXECUTOR")
        return contextlib.nullcontext()

    # What a minibatch brings and takes ------------------------------------------------
    def set_received(self, p: int, tensors: Sequence[tf.Tensor]) -> None:
        self.slots.set_received(p, tensors)

    def set_loaded(self, p: int, tensors: Sequence[tf.Tensor]) -> None:
        self.slots.set_loaded(p, tensors)

    def set_labels(self, p: int, labels: Nest) -> None:
        """Minibatch p's labels, as the dataset gives them (arrays or tensors, any structure)."""
        self.slots.labels[p] = tf.nest.map_structure(tf.convert_to_tensor, labels)

    def set_output_gradients(self, p: int, message: SlotValue) -> None:
        """The next stage's message for minibatch p: (the gradient of each floating-point tensor
        this stage sent, in order; the minibatch's verdict so far)."""
        self.slots.out_grads[p] = message

    def sent(self, p: int) -> list[tf.Tensor]:
        """The tensors minibatch p's forward pass sends to the next stage."""
        return self.slots.sent.pop(p)

    def input_gradients(self, p: int) -> SlotValue:
        """The message for the previous stage: (the gradient of each floating-point tensor this
        stage received for minibatch p, in order; p's verdict so far; the squared norm of the
        gradients so far, when clipping by the global norm; the loss scale S_p)."""
        return self.slots.input_grads.pop(p)

    def weight_gradients(self, p: int) -> SlotValue:
        """(weight gradients, verdict) of minibatch p, kept by a backward pass whose update did not
        run in the same call; taken out of the stage."""
        return self.slots.weight_grads.pop(p)

    def tied_gradients(self, p: int) -> list[tf.Tensor]:
        """The gradients of minibatch p of this stage's tied replicas, for the first stage."""
        return self.slots.tied.pop(p)

    def set_tied_gradients(self, p: int, source: int, grads: list[tf.Tensor]) -> None:
        self.slots.tied_in.setdefault(p, {})[source] = grads

    def update_terms(self, p: int) -> SlotValue:
        """Minibatch p's update terms, for the stages waiting for them (first stage)."""
        return self.slots.terms[p]

    def set_update_terms(self, p: int, terms: SlotValue) -> None:
        self.slots.terms[p] = terms

    # Running device instructions ------------------------------------------------------
    def run(self, instructions: Sequence[Instruction]) -> None:
        """Carries out `instructions`, device instructions of one task in program order
        (:data:`DEVICE_INSTRUCTIONS`), in one compiled call on the stage's device."""
        if len(self.slots.unchecked) > _UNCHECKED:  # long done: reading them back makes no wait
            self.check_applied()
        for ins in instructions:
            self._account(ins)
        flushes = {i.minibatch for i in instructions if isinstance(i, ApplyAccumulated)}
        for kind, p, value in self.lowering.call(instructions, self.slots):
            self.slots.keep(kind, p, value, flush=p in flushes)

    def _account(self, ins: Instruction) -> None:
        """The host's bookkeeping of `ins` (memory, versions, updates held, provenance), in program
        order before the call: an emulated device that would run out of memory fails first."""
        p = ins.minibatch
        if isinstance(ins, Forward):
            if ins.recompute:
                self.slots.kept[p] = (self.slots.entering_of(p), self.slots.labels.get(p, ()))
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
            self.weights.stashed.add(p)
            if self.provenance:
                self.provenance.stashed(p, self.applied)
        elif isinstance(ins, ReleaseWeights):
            self.weights.stashed.discard(p)
            self.memory.free("stashed versions", self.version_bytes)
        elif isinstance(ins, ApplyUpdate):
            self.applied.append(p)
        elif isinstance(ins, AccumulateGradient):
            self.slots.summed.append(p)
        elif isinstance(ins, ApplyAccumulated):
            if self.slots.summed != list(range(ins.first, p + 1)):
                raise RuntimeError(f"stage {self.index}: the flush of microbatches {ins.first}..{p} found the "
                                   f"gradients of {self.slots.summed}; the schedule must accumulate each microbatch "
                                   f"once")
            self.applied.extend(self.slots.summed)

    def check_applied(self, logs: Mapping[int, Mapping[str, tf.Tensor]] | None = None) -> None:
        """Reads back the verdicts of the updates since the last check; raises
        :class:`NonFiniteError` for the first that was not finite (it applied nothing), but under
        loss scaling a gradient that was not finite is a minibatch skipped (:attr:`skipped`).
        `logs`: {minibatch: its logs} that the last stage made, for the error of a loss that was
        not finite, where this stage holds none."""
        for verdict, minibatches, own in self.slots.take_unchecked():
            code = int(verdict)
            if code == FINITE:
                continue
            if self.update.rule.loss_scaling is not None and not read_verdict(code)[1]:
                # A gradient past float16's range under loss scaling: skipped on every stage, the scale halved.
                self.skipped.update(minibatches)
                self.applied = [q for q in self.applied if q not in minibatches]
                continue
            raise non_finite_error(code, minibatches, own or (logs or {}).get(minibatches[-1]), self.variable_paths)

    def timed_solo_pass(self, p: int) -> tuple[float, float]:
        """Minibatch p's forward and backward times (seconds) as the stage's device measures them
        (:meth:`hetpipe_tf.runtime.stage.passes.StagePass.timed`: on another task's device each
        eager call is an RPC, left out). Uses the version stashed for p and the inputs set for it,
        consumes neither and changes no state."""
        labels = self.slots.labels[p] if self.is_last else None
        with tf.device(self.device):
            version = self.stash.get(p, self.weights.dtypes)
        return self.passes.timed(version, self.slots.entering_of(p), labels)

    def end_run(self) -> None:
        """Drops what a stopped or failed run left behind: versions stashed for minibatches
        that never ran, and their inputs, so that the next run starts clean."""
        for p in self.stash.stats().minibatches:
            self.stash.release(p)
            self.memory.free("stashed versions", self.version_bytes)
        self.weights.stashed.clear()
        for _ in self.slots.record:
            self.memory.free("activations", self.activation_bytes)
        self.slots.clear()
        if self.provenance:
            self.provenance.drop_pending()

    # State -------------------------------------------------------------------------------
    def snapshot(self) -> StageState:
        """The stage's state now (tensors share buffers until the variables change)."""
        trainable, non_trainable, optimizer = self.weights.values()
        return StageState(trainable=trainable, non_trainable=non_trainable, optimizer=optimizer,
                          applied=tuple(self.applied), sync=self.sync_state.snapshot() if self.sync_state else None,
                          provenance=self.provenance.snapshot() if self.provenance else None)

    def restore(self, state: StageState) -> None:
        """Sets the stage's live state back to `state` (a :meth:`snapshot`)."""
        self.weights.assign(state.trainable, state.non_trainable, state.optimizer)
        self.applied = list(state.applied)
        if self.sync_state:
            self.sync_state.restore(state.sync)
        if self.provenance:
            self.provenance.restore(state.provenance)

    def load_model_weights(self) -> None:
        """Sets the live weights to the Keras model's own and starts the synchronisation
        bookkeeping from them (a new run after an aborted one; the optimizer's state stays)."""
        self.weights.load_model_weights()
        self.sync_state = self.sync_scheme.stage_state(self.synchronisation)
        if self.provenance:
            self.provenance.restart()

    def write_back(self, state: StageState | None = None) -> None:
        """Writes `state` (default: the live state) into the Keras model's own variables."""
        state = state or self.snapshot()
        self.weights.write_back(state.trainable, state.non_trainable)

    def close(self) -> None:
        self.stash.close()
