"""Checkpoints of a run of virtual workers under WSP, and resuming from them (HetPipe §3, §5).

**What is saved**, at the end of every `save_every_epochs`-th epoch and of the last one:
the global weights (every variable of the Keras model, trainable and not, in the model's
order: the parameter servers' values and worker 0's random-seed state), every virtual
worker's every stage's optimizer variables (iterations, learning rate, slots), each
worker's clock at the servers, the number of epochs completed, each worker's position in
its shard of the data (the minibatches it has consumed) and the plan (each worker's stage
boundaries and Nm, which the optimizer state belongs to).

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
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

#: The checkpoint format this module writes and reads.
FORMAT = 1
_PREFIX = "ckpt"
_KEY = "{}/.ATTRIBUTES/VARIABLE_VALUE"


@dataclass
class RunState:
    """A run at an epoch's end. `weights`: the Keras model's variables' values in its order;
    `optimizers`: per worker, per stage, its optimizer variables' values; `clocks`: each worker's
    clock; `positions`: the minibatches each worker has consumed of its shard; `plan`: what
    :func:`plan_signature` gives."""
    epoch: int
    weights: list
    optimizers: list
    clocks: list
    positions: list
    plan: dict


def plan_signature(num_in_flight, boundaries):
    """What the optimizer state of a checkpoint belongs to: Nm and each worker's stage
    boundaries (first layer call of each stage)."""
    return {"num_in_flight": int(num_in_flight), "boundaries": [[int(b) for b in w] for w in boundaries]}


def stage_optimizer_state(runtimes):
    """The optimizer variables' values of each of `runtimes` (StageRuntimes)."""
    return [[v.numpy() for v in rt.optimizer.variables] for rt in runtimes]


def set_stage_optimizer_state(runtimes, states):
    """Gives each of `runtimes` its saved optimizer variables' values."""
    for rt, values in zip(runtimes, states):
        if len(values) != len(rt.optimizer.variables):
            raise ValueError(f"stage {rt.index}'s optimizer has {len(rt.optimizer.variables)} variables, the "
                             f"checkpoint {len(values)}: it was saved with another optimizer")
        for v, value in zip(rt.optimizer.variables, values):
            v.assign(value)


def skip_consumed(shards, positions):
    """Each worker's shard (a repeated tf.data.Dataset) after the minibatches it consumed."""
    return [s.skip(int(p)) if p else s for s, p in zip(shards, positions)]


def epoch_share(epoch, steps_per_epoch, workers):
    """The minibatches each worker has consumed after `epoch` epochs of `steps_per_epoch`
    minibatches of all workers together (each worker trains the same number)."""
    return -(-epoch * steps_per_epoch // workers)


class Checkpoints:
    """A run's checkpoints in `directory` (see the module docstring).

    Args:
      directory: where they go (created if missing).
      save_every_epochs: save at the end of every epoch whose number (counted from 1) is a
        multiple of this, and of a fit's last epoch.
      max_to_keep: how many of the newest to keep.
    """

    def __init__(self, directory, save_every_epochs=1, max_to_keep=2):
        if not isinstance(save_every_epochs, int) or isinstance(save_every_epochs, bool) or save_every_epochs < 1:
            raise ValueError(f"save_every_epochs must be an integer >= 1, got {save_every_epochs!r}")
        if not directory:
            raise ValueError(f"a checkpoint directory is needed, got {directory!r}")
        self.directory = os.fspath(directory)
        self.save_every_epochs = save_every_epochs
        self.max_to_keep = max_to_keep

    def due(self, epoch, epochs):
        """Whether the end of `epoch` (counted from 0) of a fit of `epochs` is saved."""
        return (epoch + 1) % self.save_every_epochs == 0 or epoch + 1 == epochs

    def save(self, state):
        """Writes `state` as the newest checkpoint; returns its path."""
        optimizers = [np.asarray(v) for worker in state.optimizers for stage in worker for v in stage]
        meta = {"format": FORMAT, "epoch": int(state.epoch), "clocks": [int(c) for c in state.clocks],
                "positions": [int(p) for p in state.positions], "plan": state.plan,
                "weights": [[list(np.shape(w)), str(np.asarray(w).dtype)] for w in state.weights],
                "optimizers": [[len(stage) for stage in worker] for worker in state.optimizers]}
        with tf.device("/device:CPU:0"):
            checkpoint = tf.train.Checkpoint(
                meta=tf.Variable(json.dumps(meta)), weights=[tf.Variable(np.asarray(w)) for w in state.weights],
                optimizers=[tf.Variable(v) for v in optimizers])
        manager = tf.train.CheckpointManager(checkpoint, self.directory, max_to_keep=self.max_to_keep,
                                             checkpoint_name=_PREFIX)
        return manager.save(checkpoint_number=state.epoch)

    def latest_path(self):
        """The newest complete checkpoint's path, or None."""
        return tf.train.latest_checkpoint(self.directory) if os.path.isdir(self.directory) else None

    def latest(self):
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
        flat = iter(range(sum(sum(w) for w in meta["optimizers"])))
        optimizers = [[[reader.get_tensor(_KEY.format(f"optimizers/{next(flat)}")) for _ in range(n)]
                       for n in worker] for worker in meta["optimizers"]]
        return RunState(epoch=meta["epoch"], weights=weights, optimizers=optimizers, clocks=meta["clocks"],
                        positions=meta["positions"], plan=meta["plan"])

    def restore_model(self, model):
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

    def check_plan(self, saved, planned):
        """A clear error unless `saved` (a :func:`plan_signature`) fits the run `planned`: the
        same number of workers, of stages in each and Nm, whose optimizer state it holds (the
        cuts may differ: the planner's profile is measured anew, and the run keeps the saved ones)."""
        shape = lambda plan: (plan["num_in_flight"], [len(b) for b in plan["boundaries"]])  # noqa: E731
        if shape(saved) != shape(planned):
            raise ValueError(f"checkpoint {self.latest_path()} was saved under the plan {saved}, this run's "
                             f"plan is {planned}: resuming needs the same number of virtual workers, of stages in "
                             f"each and Nm; give the run's cluster, policy, vw_size and num_in_flight again")


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

    def __init__(self, checkpoints, steps_per_epoch, workers, initial_epoch, epochs, positions):
        self.checkpoints = checkpoints
        self.steps_per_epoch = steps_per_epoch
        self.workers = workers
        self.initial_epoch = initial_epoch
        self.epochs = epochs
        self.positions = list(positions)
        self._gate = queue.Queue()

    def train(self, events, train_epoch):
        """On the training thread: train_epoch(steps, first) trains `steps` minibatches of every
        worker and drains (`first`: the fit's first epoch)."""
        for epoch in range(self.initial_epoch, self.epochs):
            steps = (epoch_share(epoch + 1, self.steps_per_epoch, self.workers)
                     - epoch_share(epoch, self.steps_per_epoch, self.workers))
            train_epoch(steps, epoch == self.initial_epoch)
            self.positions = [p + steps for p in self.positions]
            events.put("segment", epoch)
            if self._gate.get():
                return

    def epoch_end(self, epoch, stopped, events, state, drained=None):
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

    def after_epoch(self, epoch, stopped):
        """The epoch's callbacks have run: the training thread goes on (or ends, if `stopped`)."""
        self._gate.put(stopped)

    def release(self):
        """Lets a waiting training thread end (fit failed)."""
        self._gate.put(True)
