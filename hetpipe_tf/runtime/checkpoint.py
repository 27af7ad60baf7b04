"""Checkpoints of a run of virtual workers under WSP, and resuming from them (HetPipe §3, §5).

**What is saved**, at the end of every `save_every_epochs`-th epoch and of the last one:
the global weights (every variable of the Keras model, trainable and not, in the model's
order: the parameter servers' values and worker 0's random-seed state), every virtual
worker's optimizer state per model variable (its slots, e.g. momentum, by the variable's
position) and its optimizer's own variables (iterations, learning rate, Nadam's u_product),
each worker's clock at the servers, the number of epochs completed, each worker's position
in its shard of the data (the minibatches it has consumed) and the plan (each worker's stage
boundaries and Nm).

**Under another plan**: weights and optimizer state are per model variable, not per stage, so
a checkpoint resumes under another allocation, partition or Nm (each stage takes its variables'
slots wherever the cuts now fall), or another number of virtual workers (:func:`for_workers`:
every new worker starts from the mean of the saved workers' optimizer state, at the global
clock, at its shard's position after the epochs done). With the same number of workers, the
same number of stages in each and the same Nm, the saved cuts are kept (resuming is exact).

**When**: at consistent points only. A run that checkpoints trains epoch by epoch: at
each epoch's end every worker has pushed its last, partial wave, so the servers hold
every update, and every stage then takes the global weights (as a run does after an
aborted one). Between epochs nothing is in flight, so the state above is the whole
state of the run. That drain at every epoch's end is the price: a checkpointing run
trains like any other checkpointing run, not like a run that never drains (whose
pipelines run across epochs).

**Why resuming is exact**: a resumed run starts from exactly that state: the Keras model,
hence the servers and every stage, gets the saved weights, every stage its optimizer
variables, the servers' clocks the saved clocks, and every worker's shard skips the
minibatches consumed (``Dataset.skip``: exact for a deterministic input pipeline, one
without unseeded shuffling). With D = 0 and deterministic data it then ends with the
weights of a run that was never interrupted.

**Atomically**: on ``tf.train.CheckpointManager``, which writes a checkpoint's files and
only then its state file (``checkpoint``) naming it the latest: a crash while saving
leaves the state file naming the previous checkpoint, which stays usable; the two newest
are kept.
"""
import json
import os
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import keras
import numpy as np
import tensorflow as tf

from hetpipe_tf.planning.planner import Plan

if TYPE_CHECKING:
    from hetpipe_tf.runtime.stage.runtime import StageRuntime

#: A worker's optimizer state as :func:`stage_optimizer_state` gives it:
#: ``{"scalars": {name: value}, "slots": {position: {slot: value}}}``.
WorkerOptimizerState = dict[str, dict[Any, Any]]


class SegmentEvents(Protocol):
    """What an epoch-by-epoch fit reports its segments through (:class:`hetpipe_tf.runtime.fit_loop.Events`)."""

    def put(self, kind: str, payload: Any = None) -> None: ...  # noqa: D102

    def get(self, kind: str) -> Any: ...  # noqa: D102

#: The checkpoint format this module writes and reads.
FORMAT = 2
_PREFIX = "ckpt"
_KEY = "{}/.ATTRIBUTES/VARIABLE_VALUE"


@dataclass(frozen=True)
class PlanCuts:
    """What the optimizer state of a checkpoint belongs to: Nm, each worker's stage boundaries (first
    layer call of each stage) and, when uneven, each worker's minibatch size. Saved as the dict
    :meth:`to_dict` gives (the format every checkpoint has had)."""
    num_in_flight: int
    boundaries: tuple[tuple[int, ...], ...]
    minibatch_sizes: tuple[int, ...] | None = None

    @classmethod
    def of_plan(cls, plan: Plan) -> "PlanCuts":
        """A plan's Nm, every worker's boundaries and its uneven minibatch sizes (None if even)."""
        return cls(plan.num_in_flight, tuple(plan.node_boundaries(w) for w in range(len(plan.workers))),
                   tuple(plan.minibatch_sizes) or None)

    @property
    def shape(self) -> tuple[int, tuple[int, ...]]:
        """Nm and each worker's number of stages."""
        return self.num_in_flight, tuple(len(b) for b in self.boundaries)

    def to_dict(self) -> dict:
        cuts = {"num_in_flight": int(self.num_in_flight), "boundaries": [[int(b) for b in w] for w in self.boundaries]}
        if self.minibatch_sizes:
            cuts["minibatch_sizes"] = [int(b) for b in self.minibatch_sizes]
        return cuts

    @classmethod
    def from_dict(cls, cuts: dict) -> "PlanCuts":
        sizes = cuts.get("minibatch_sizes")
        return cls(int(cuts["num_in_flight"]), tuple(tuple(int(b) for b in w) for w in cuts["boundaries"]),
                   tuple(int(b) for b in sizes) if sizes else None)


def reconcile_cuts(saved: PlanCuts | None, planned: PlanCuts) -> PlanCuts:
    """The cuts a run trains at: under a plan of the same shape (Nm, each worker's number of stages)
    as the checkpoint's `saved` cuts, those (resuming is exact, whichever cuts a profile measured anew
    gives), with the saved minibatch sizes while the plan is still uneven (else even); under another
    shape, or without a checkpoint, the `planned` ones (the state is then mapped per variable)."""
    if saved is None or saved.shape != planned.shape:
        return planned
    sizes = (saved.minibatch_sizes or planned.minibatch_sizes) if planned.minibatch_sizes else None
    return PlanCuts(saved.num_in_flight, saved.boundaries, sizes)


@dataclass
class RunState:
    """A run at an epoch's end. `weights`: the Keras model's variables' values in its order;
    `optimizers`: per worker, its :func:`stage_optimizer_state` (None: a fresh optimizer); `clocks`: each worker's
    clock; `positions`: the minibatches each worker has consumed of its shard; `plan`: the run's
    :class:`PlanCuts`."""
    epoch: int
    weights: list[np.ndarray]
    optimizers: list[WorkerOptimizerState | None]
    clocks: list[int]
    positions: list[int]
    plan: PlanCuts


#: The Keras base optimizer's lists of every variable (its own, the model's), not of one kind of slot.
_REGISTRIES = ("_variables", "_trainable_variables")


def _optimizer_keys(runtime: "StageRuntime", model: keras.Model) -> list[str | tuple[int, str]]:
    """What each optimizer variable of a stage runtime is, so that a stage of another cut, worker or
    process finds it: (the model variable's position among `model`'s trainable ones, slot name)
    for a slot; a name for the optimizer's own variables. Positions, not paths, which a model
    rebuilt elsewhere may name otherwise (as the parameter servers do).

    Read the way Keras 3's optimizers use them: each kind of slot is a list aligned with the
    variables the optimizer was built on (``_trainable_variables``, indexed by
    ``_get_variable_index``; None where a variable has none of that kind, as Muon's velocity of the
    weights it orthogonalises), the optimizer's own variables are attributes (``_iterations``,
    Nadam's ``_u_product``). A slot is named as ``add_variable_from_reference`` suffixes its
    variable's path (``momentum``, ``velocity``), else after its list (Adafactor's factored
    moments: ``r``, ``c``); an optimizer's own variable by its name in the optimizer's scope
    (``iteration``, ``learning_rate``), else after its attribute (``u_product``)."""
    optimizer = runtime.optimizer
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    original = {id(c): o for c, o in zip(runtime.trainable, runtime.stage.trainable_variables)}
    built_on = optimizer._trainable_variables
    owned = {id(v) for v in optimizer.variables}
    slots, own = {}, {}
    for attribute, value in vars(optimizer).items():
        if attribute in _REGISTRIES:
            continue
        kind = attribute.lstrip("_")
        if isinstance(value, keras.Variable) and id(value) in owned:
            own[id(value)] = value.name if value.path == f"{optimizer.name}/{value.name}" else kind
        elif (isinstance(value, (list, tuple)) and len(value) == len(built_on) and any(v is not None for v in value)
              and all(v is None or id(v) in owned for v in value)):
            for slot, weight in zip(value, built_on):
                if slot is not None:
                    prefix = weight.path.replace("/", "_") + "_"
                    name = slot.name[len(prefix):] if slot.name.startswith(prefix) else kind
                    slots[id(slot)] = (position[id(original[id(weight)])], name)
    keys = [slots.get(id(v), own.get(id(v))) for v in optimizer.variables]
    unkeyed = [v.path for v, key in zip(optimizer.variables, keys) if key is None]
    if unkeyed:
        raise ValueError(f"stage {runtime.index}'s {type(optimizer).__name__} holds {unkeyed} neither in a list of "
                         f"slots aligned with its weights nor as an attribute of its own: it cannot be checkpointed")
    if len(set(keys)) != len(keys):
        raise ValueError(f"stage {runtime.index}'s {type(optimizer).__name__} has several variables keyed "
                         f"{sorted({k for k in keys if keys.count(k) > 1}, key=str)}: it cannot be checkpointed")
    return keys


def stage_optimizer_state(runtimes: Sequence["StageRuntime"], model: keras.Model) -> WorkerOptimizerState:
    """A worker's optimizer state from its stages (`runtimes`, StageRuntimes of `model`), per model
    variable: ``{"scalars": {name: value}, "slots": {position: {slot: value}}}`` (a variable's
    position among the model's trainable ones); the scalars
    (iterations, learning rate) are every stage's, which all apply every minibatch. With loss
    scaling, the worker's one dynamic scale and its count of clean minibatches are scalars too
    (``loss_scale``, ``loss_scale_counter``: the first stage's, which moves them)."""
    state: WorkerOptimizerState = {"scalars": {}, "slots": {}}
    for rt in runtimes:
        for key, v in zip(_optimizer_keys(rt, model), rt.optimizer.variables):
            if isinstance(key, str):
                state["scalars"].setdefault(key, v.numpy())
            else:
                state["slots"].setdefault(key[0], {})[key[1]] = v.numpy()
        if rt.scale_state is not None:
            state["scalars"]["loss_scale"] = rt.scale_state.scale.numpy()
            state["scalars"]["loss_scale_counter"] = rt.scale_state.counter.numpy()
    return state


def set_stage_optimizer_state(runtimes: Sequence["StageRuntime"], state: WorkerOptimizerState | None,
                              model: keras.Model) -> None:
    """Gives each of `runtimes` its variables' saved optimizer state (`state` as
    :func:`stage_optimizer_state` gives it, wherever the stages' cuts then were; None: leave
    them fresh)."""
    if state is None:
        return
    for rt in runtimes:
        for key, v in zip(_optimizer_keys(rt, model), rt.optimizer.variables):
            value = state["scalars"].get(key) if isinstance(key, str) else state["slots"].get(key[0], {}).get(key[1])
            if value is None:
                raise ValueError(f"stage {rt.index}'s optimizer has {key!r}, the checkpoint none (it holds "
                                 f"{sorted(state['scalars'])} and slots of {len(state['slots'])} variables): it was "
                                 f"saved with another optimizer; resume with the optimizer it was saved with")
            if np.shape(value) != tuple(v.shape):
                raise ValueError(f"stage {rt.index}'s optimizer variable {key!r} has shape {tuple(v.shape)}, the "
                                 f"checkpoint's {np.shape(value)}: it was saved with another optimizer or model; "
                                 f"resume with the ones it was saved with")
            v.assign(value)
    _set_loss_scale(runtimes, state["scalars"])


def _set_loss_scale(runtimes: Sequence["StageRuntime"], scalars: dict[str, Any]) -> None:
    """The saved loss scale on the stages that hold it (the first moves it, the last scales its
    loss by it); a checkpoint without one (saved without loss scaling) leaves the initial scale."""
    if "loss_scale" not in scalars:
        return
    for rt in runtimes:
        if rt.scale_state is not None:
            rt.scale_state.scale.assign(scalars["loss_scale"])
            rt.scale_state.counter.assign(scalars["loss_scale_counter"])
        if rt.is_last and rt.rule.loss_scaling is not None:
            rt.loss_scale.assign(scalars["loss_scale"])


def for_workers(state: RunState, workers: int, steps_per_epoch: int) -> RunState:
    """`state` (a :class:`RunState`) for a run of `workers` virtual workers. With the saved number,
    itself. Otherwise each new worker starts from the mean of the saved workers' optimizer state
    (every slot and iteration count averaged: each saved worker's slots estimate the same moments
    of the same global model's gradients, so none is preferred and none is thrown away), at the
    saved global clock (the slowest worker's), and at its new shard's position after the epochs
    done (the data order of shards of another number of workers cannot go on where the old
    ones were)."""
    if len(state.clocks) == workers:
        return state
    saved = [o for o in state.optimizers if o is not None]
    mean: WorkerOptimizerState | None = None
    if saved:
        mean = {"scalars": {k: _mean([o["scalars"][k] for o in saved]) for k in saved[0]["scalars"]},
                "slots": {p: {s: _mean([o["slots"][p][s] for o in saved]) for s in slots}
                          for p, slots in saved[0]["slots"].items()}}
    return RunState(epoch=state.epoch, weights=state.weights, optimizers=[mean] * workers,
                    clocks=[min(state.clocks)] * workers,
                    positions=epoch_shares(state.epoch, steps_per_epoch, workers), plan=state.plan)


def _mean(values: Sequence[np.ndarray]) -> np.ndarray:
    """The elementwise mean of `values`, in their dtype (integers rounded)."""
    values = np.asarray(values)
    mean = values.mean(axis=0)
    return np.rint(mean).astype(values.dtype) if np.issubdtype(values.dtype, np.integer) else mean.astype(values.dtype)


def skip_consumed(shards: Sequence[tf.data.Dataset], positions: Sequence[int]) -> list[tf.data.Dataset]:
    """Each worker's shard (a repeated tf.data.Dataset) after the minibatches it consumed."""
    return [s.skip(int(p)) if p else s for s, p in zip(shards, positions)]


def epoch_shares(epoch: int, steps_per_epoch: int, workers: int) -> list[int]:
    """The minibatches each worker has consumed after `epoch` epochs of `steps_per_epoch` minibatches
    of all workers together: the run's minibatches are dealt to the workers in turn (minibatch i to
    worker i modulo `workers`), so that every epoch trains exactly `steps_per_epoch` of them, and a
    worker's share of an epoch differs from another's by one at most."""
    consumed = epoch * steps_per_epoch
    return [-(-(consumed - w) // workers) for w in range(workers)]


def _flat_keys(worker: WorkerOptimizerState | None) -> list[list[Any]]:
    """A worker's optimizer state's entries as JSON keys: ["scalar", name], ["slot", position, slot]."""
    if worker is None:
        return []
    return ([["scalar", k] for k in worker["scalars"]]
            + [["slot", p, s] for p, slots in worker["slots"].items() for s in slots])


def _value(worker: WorkerOptimizerState, key: Sequence[Any]) -> Any:
    return worker["scalars"][key[1]] if key[0] == "scalar" else worker["slots"][key[1]][key[2]]


class Checkpoints:
    """A run's checkpoints in `directory` (see the module docstring).

    Args:
      directory: where they go (created if missing).
      save_every_epochs: save at the end of every epoch whose number (counted from 1) is a
        multiple of this, and of a fit's last epoch.
      max_to_keep: how many of the newest to keep.
    """

    def __init__(self, directory: str | os.PathLike[str], save_every_epochs: int = 1, max_to_keep: int = 2) -> None:
        if not isinstance(save_every_epochs, int) or isinstance(save_every_epochs, bool) or save_every_epochs < 1:
            raise ValueError(f"save_every_epochs must be an integer >= 1, got {save_every_epochs!r}")
        if not directory:
            raise ValueError(f"a checkpoint directory is needed, got {directory!r}")
        self.directory = os.fspath(directory)
        self.save_every_epochs = save_every_epochs
        self.max_to_keep = max_to_keep

    def due(self, epoch: int, epochs: int) -> bool:
        """Whether the end of `epoch` (counted from 0) of a fit of `epochs` is saved."""
        return (epoch + 1) % self.save_every_epochs == 0 or epoch + 1 == epochs

    def save(self, state: RunState) -> str:
        """Writes `state` as the newest checkpoint; returns its path."""
        keys = [_flat_keys(worker) for worker in state.optimizers]
        optimizers = [np.asarray(_value(worker, key)) for worker, ks in zip(state.optimizers, keys) for key in ks]
        meta = {"format": FORMAT, "epoch": int(state.epoch), "clocks": [int(c) for c in state.clocks],
                "positions": [int(p) for p in state.positions], "plan": state.plan.to_dict(),
                "weights": [[list(np.shape(w)), str(np.asarray(w).dtype)] for w in state.weights],
                "optimizers": [None if worker is None else ks for worker, ks in zip(state.optimizers, keys)]}
        with tf.device("/device:CPU:0"):
            checkpoint = tf.train.Checkpoint(
                meta=tf.Variable(json.dumps(meta)), weights=[tf.Variable(np.asarray(w)) for w in state.weights],
                optimizers=[tf.Variable(v) for v in optimizers])
        manager = tf.train.CheckpointManager(checkpoint, self.directory, max_to_keep=self.max_to_keep,
                                             checkpoint_name=_PREFIX)
        return manager.save(checkpoint_number=state.epoch)

    def latest_path(self) -> str | None:
        """The newest complete checkpoint's path, or None."""
        return tf.train.latest_checkpoint(self.directory) if os.path.isdir(self.directory) else None

    def latest(self) -> RunState:
        """The newest complete checkpoint as a :class:`RunState`; a clear error if there is none."""
        path = self.latest_path()
        if path is None:
            why = "does not exist" if not os.path.isdir(self.directory) else "holds no complete checkpoint"
            raise FileNotFoundError(f"cannot resume: the checkpoint directory {self.directory!r} {why}; give the "
                                    f"checkpoint_dir (--checkpoint_dir) of a run that saved one, or start without "
                                    f"resume (--noresume) to train from the beginning")
        reader = tf.train.load_checkpoint(path)
        meta = json.loads(reader.get_tensor(_KEY.format("meta")))
        if meta.get("format") != FORMAT:
            raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}; this version reads format "
                             f"{FORMAT}")
        weights = [reader.get_tensor(_KEY.format(f"weights/{i}")) for i in range(len(meta["weights"]))]
        flat = iter(range(sum(len(ks or ()) for ks in meta["optimizers"])))
        optimizers: list[WorkerOptimizerState | None] = []
        for ks in meta["optimizers"]:
            worker = None if ks is None else {"scalars": {}, "slots": {}}
            for key in ks or ():
                value = reader.get_tensor(_KEY.format(f"optimizers/{next(flat)}"))
                if key[0] == "scalar":
                    worker["scalars"][key[1]] = value
                else:
                    worker["slots"].setdefault(key[1], {})[key[2]] = value
            optimizers.append(worker)
        return RunState(epoch=meta["epoch"], weights=weights, optimizers=optimizers, clocks=meta["clocks"],
                        positions=meta["positions"], plan=PlanCuts.from_dict(meta["plan"]))

    def restore_model(self, model: keras.Model) -> RunState:
        """Reads the newest checkpoint, puts its weights into `model` (checked to be the model
        it was saved from: the same variables' shapes and dtypes in the same order) and returns
        the :class:`RunState`."""
        state = self.latest()
        want = [(tuple(w.shape), str(w.dtype)) for w in state.weights]
        have = [(tuple(v.shape), str(np.dtype(v.dtype))) for v in model.variables]
        if want != have:
            diff = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
            raise ValueError(
                f"checkpoint {self.latest_path()} is not of this model: it holds {len(want)} variables, the model "
                f"{len(have)}, and variable {diff} differs ({want[diff] if diff < len(want) else 'none'} saved, "
                f"{have[diff] if diff < len(have) else 'none'} in the model: shape, dtype); give the checkpoint_dir "
                f"of this model's run, or start without resume")
        for v, value in zip(model.variables, state.weights):
            v.assign(value)
        return state



class EpochSegments:
    """A fit that checkpoints (or may restart a lost worker, :mod:`hetpipe_tf.distributed.process_runner`),
    trained epoch by epoch (see the module docstring): the training
    thread trains one epoch's share of every worker, drains, reports a ``segment`` event and
    waits until the caller's thread has saved and run the epoch's callbacks
    (:func:`hetpipe_tf.runtime.fit_loop.run_fit`'s `epoch_end` and `after_epoch`).

    Args:
      checkpoints: the run's :class:`Checkpoints` (None: drained at every epoch's end, never saved).
      steps_per_epoch, workers: minibatches per epoch of all workers together, and the workers.
      initial_epoch, epochs: as for ``fit``.
      positions: the minibatches each worker has consumed of its shard when the fit starts.
    """

    def __init__(self, checkpoints: Checkpoints | None, steps_per_epoch: int, workers: int, initial_epoch: int,
                 epochs: int, positions: Sequence[int]) -> None:
        if steps_per_epoch < workers:
            raise ValueError(f"steps_per_epoch={steps_per_epoch} is fewer than the {workers} virtual workers: a run "
                             f"that drains at every epoch's end (checkpoint_dir, or on_worker_failure='continue') "
                             f"gives every worker at least one minibatch of each epoch; give steps_per_epoch >= "
                             f"{workers}")
        self.checkpoints = checkpoints
        self.steps_per_epoch = steps_per_epoch
        self.workers = workers
        self.initial_epoch = initial_epoch
        self.epochs = epochs
        self.positions = list(positions)
        self._gate: queue.Queue[bool] = queue.Queue()

    def train(self, events: SegmentEvents, train_epoch: Callable[[list[int], bool], None]) -> None:
        """On the training thread: train_epoch(steps, first) trains each worker's share of the epoch
        (`steps`, one count per worker: :func:`epoch_shares`) and drains (`first`: the fit's first
        epoch)."""
        for epoch in range(self.initial_epoch, self.epochs):
            before = epoch_shares(epoch, self.steps_per_epoch, self.workers)
            after = epoch_shares(epoch + 1, self.steps_per_epoch, self.workers)
            steps = [a - b for a, b in zip(after, before)]
            train_epoch(steps, epoch == self.initial_epoch)
            self.positions = [p + n for p, n in zip(self.positions, steps)]
            events.put("segment", epoch)
            if self._gate.get():
                return

    def epoch_end(self, epoch: int, stopped: bool, events: SegmentEvents, state: Callable[[int, list[int]], RunState],
                  drained: Callable[[list[int]], None] | None = None) -> None:
        """On the caller's thread, at `epoch`'s end: waits for the drain, calls drained(positions)
        (if given) and saves when due; state(epoch, positions) -> the :class:`RunState` to save. A
        stopped epoch (its share not trained) is not saved."""
        if stopped:
            return
        events.get("segment")
        if drained is not None:
            drained(self.positions)
        if self.checkpoints is not None and self.checkpoints.due(epoch, self.epochs):
            self.checkpoints.save(state(epoch + 1, self.positions))

    def after_epoch(self, epoch: int, stopped: bool) -> None:
        """The epoch's callbacks have run: the training thread goes on (or ends, if `stopped`)."""
        self._gate.put(stopped)

    def release(self) -> None:

        """Lets a waiting training thread end (fit failed)."""
        self._gate.put(True)
