"""The one ``fit`` of every runner, Keras's, driven by pipelines that train in other threads.

:func:`fit` (a runner, the data, the :class:`FitOptions`) is written once for the three runners:
one virtual worker (:class:`hetpipe_tf.runtime.virtual_worker.VirtualWorker`, a :class:`Runner`),
several in this process (:class:`hetpipe_tf.runtime.wsp_runner.WSPRunner`) and several in
processes of their own (:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`), both
:class:`GlobalWeightsRunner` s: each worker's shard of the data, the epochs (run across without
draining, or, for a runner with global weights, trained one by one when checkpoints are saved or
a lost worker may restart, :class:`hetpipe_tf.runtime.checkpoint.EpochSegments`), the weights each
epoch ended with in the Keras model, validation, the callbacks, the trace and the emulation's
warning (:class:`RunnerTraining`).

Training threads (one per virtual worker) put events on an :class:`Events` queue:
``started``, ``done`` (a minibatch's update is in: its logs and when it completed; logs None
for a minibatch that a lost virtual worker will not train, which counts as a step of the
epoch, without an update, in no mean and in no throughput),
``snapshot`` and ``finished``. :func:`run_fit` runs on the caller's thread: Keras
callbacks, History and progress bar, running epoch means like Keras's, throughput
from completion times (not from when this loop saw them), the learning rate that
callbacks set, ``stop_training``, and on any error or Ctrl-C it stops the training
threads before leaving. A minibatch whose loss is not finite ends training with its
error, unless a ``keras.callbacks.TerminateOnNaN`` is given: that callback then sees the
minibatch's logs and stops training as in Keras (the model keeps the weights of the
last completed epoch, none of that minibatch's update).
"""
import collections
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


import keras
import tensorflow as tf

from hetpipe_tf.compat import gen_resource_variable_ops as _variable_ops
from hetpipe_tf.pipeline.emulation import EmulationReport
from hetpipe_tf.pipeline.trace import TraceRecorder
from hetpipe_tf.runtime.checkpoint import Checkpoints, EpochSegments, PlanCuts, RunState
from hetpipe_tf.runtime.optimizers import check_optimizer, inner_optimizer
from hetpipe_tf.runtime.run_config import RunConfig
from hetpipe_tf.runtime.stage.verdicts import NonFiniteError
from hetpipe_tf.runtime.worker_data import epoch_steps, mean_batch_size, worker_shards


#: The longest fit waits for its training threads after stopping them on an error.
ABORT_GRACE_S = 5.0


class Events:
    """Events from training threads, taken by kind; other kinds wait their turn."""

    def __init__(self, producers: int = 1) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._pending: collections.defaultdict[str, collections.deque[Any]] = collections.defaultdict(
            collections.deque)
        self._producers = producers
        self._finished = 0
        self.errors: list[BaseException] = []

    def put(self, kind: str, payload: Any = None) -> None:
        self._queue.put((kind, payload))

    def finished(self, error: BaseException | None = None) -> None:
        """A training thread ends (with its error, if any)."""
        self._queue.put(("finished", error))

    def get(self, kind: str) -> Any:
        """The payload of the next `kind` event; raises a training thread's error, or if every
        thread finished without one."""
        while True:
            if self._pending[kind]:
                return self._pending[kind].popleft()
            got, payload = self._queue.get()
            if got == "finished":
                self._finished += 1
                if payload is not None:
                    self.errors.append(payload)
                    raise payload
                if self._finished == self._producers and not self._pending[kind]:
                    raise RuntimeError(f"training finished while fit() waited for a {kind!r} event")
                continue
            self._pending[got].append(payload)

    def forgive(self, error: BaseException) -> None:
        """`error` was handled by the caller: wait_finished no longer raises it."""
        self.errors.remove(error)

    def wait_finished(self, timeout: float) -> None:
        """Waits for every training thread to finish, keeping their other events; re-raises the
        first error, or raises TimeoutError when they did not finish within `timeout` seconds."""
        while self._finished < self._producers:
            try:
                got, payload = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"training did not finish within {timeout:g} s (timeout_s) after its last "
                                   f"minibatch was counted; a stage or a worker's process hangs") from None
            if got == "finished":
                self._finished += 1
                if payload is not None:
                    self.errors.append(payload)
            else:  # kept for a later get (the last epoch's snapshot, say)
                self._pending[got].append(payload)
        if self.errors:
            raise self.errors[0]


@dataclass(frozen=True)
class FitOptions:
    """What a fit is asked, as ``keras.Model.fit``'s arguments of the same names, and for a run
    with global weights: `checkpoints` (:class:`hetpipe_tf.runtime.checkpoint.Checkpoints`: it
    trains epoch by epoch, draining at each epoch's end, and saves there when due), `plan` (the
    run's cuts, a :class:`hetpipe_tf.runtime.checkpoint.PlanCuts`, saved with them) and `positions`
    (the minibatches each worker's shard has already given, skipped). `steps_per_epoch` None: the data's length; `trace_path`: where the
    trace of every worker is written."""
    epochs: int = 1
    steps_per_epoch: int | None = None
    callbacks: Sequence[keras.callbacks.Callback] | None = None
    verbose: int | str = "auto"
    validation_data: tf.data.Dataset | None = None
    trace_path: str | None = None
    initial_epoch: int = 0
    checkpoints: Checkpoints | None = None
    positions: Sequence[int] | None = None
    plan: PlanCuts | None = None


class Runner(Protocol):
    """What :func:`fit` trains, every runner: `num_workers` virtual workers of a run configured by
    `config`, whose weights end in `model`."""
    model: keras.Model
    config: RunConfig
    num_workers: int
    trace: TraceRecorder | None  # of the last training

    def begin_fit(self, shards: Sequence[Iterable], positions: Sequence[int]) -> None:
        """Before training: `shards`, each worker's endless stream of minibatches, of which a
        resumed run has consumed `positions`."""

    def release_fit_data(self) -> None:
        """After training, done or failed: lets go of the fit's streams of minibatches, so that
        their tf.data iterators end now, in the fit's thread. An iterator's end waits for its
        threads; left to Python's garbage collector it would come at any later time, in whatever
        thread collects (a stage's, holding up the run for seconds)."""

    def train_segment(self, steps: Sequence[int], events: "Events", first: bool, trace: bool,
                      epoch_ends: Sequence[int]) -> None:
        """Trains `steps[w]` minibatches of each worker w, each where it ended (the fit's `first`: at its
        position) and returns. Reports to `events` ("started" per worker when `first`, "done" per
        minibatch with (logs, completion time)); a runner that can records every stage's state
        right after each minibatch of `epoch_ends` ("snapshot")."""

    def epoch_weights(self, events: "Events", stopped: bool) -> None:
        """Puts the weights the epoch ended with into the Keras model (for validation and callbacks)."""

    def evaluate(self, dataset: tf.data.Dataset) -> dict:
        """Loss and metrics of the Keras model on `dataset`."""

    def stage_optimizers(self) -> list:
        """The stages' optimizer copies (whose learning rate follows the user's optimizer)."""

    def request_stop(self) -> None:
        """Admit no more minibatches."""

    def abort(self) -> None:
        """Stop every worker now."""

    def emulation_report(self) -> EmulationReport | None:
        """The emulation's figures of the training (None without emulated devices)."""


@runtime_checkable
class GlobalWeightsRunner(Runner, Protocol):
    """What a runner of virtual workers synchronised through parameter servers (global weights,
    HetPipe §5) adds: it drains between epochs, saves checkpoints, and may train epoch by epoch."""
    trains_by_epoch: bool  # every fit trains epoch by epoch, draining between them (a lost worker may restart)

    def drain(self) -> None:
        """After a train, every stage takes the global weights (the run goes on from there)."""

    def after_drain(self, positions: Sequence[int]) -> None:
        """The workers drained between epochs, at `positions` in their shards."""

    def epoch_logs(self) -> dict:
        """The runner's own logs of an epoch (the global clock)."""

    def run_state(self, epoch: int, positions: Sequence[int], plan: PlanCuts | None) -> RunState:
        """The run as a checkpoint holds it."""

    def end_fit(self) -> None:
        """After training: the global weights in the Keras model."""


def fit(runner: Runner, x: tf.data.Dataset, options: FitOptions) -> keras.callbacks.History:
    """Trains `runner` on `x` like ``keras.Model.fit`` asked `options`; returns the History.

    Each worker takes its shard of `x` (:func:`hetpipe_tf.runtime.worker_data.worker_shards`); an
    epoch is `steps_per_epoch` minibatches of all workers together, and at its end the weights it
    ended with are in the Keras model for validation and callbacks."""
    training = RunnerTraining(runner, x, options)
    try:
        history = run_fit(training, options)
    finally:
        runner.release_fit_data()
    if training.global_weights:
        runner.end_fit()
    if options.trace_path and runner.trace:
        runner.trace.write(options.trace_path)
    warn_if_not_faithful(runner.emulation_report())
    return history


class Training(Protocol):
    """What :func:`run_fit` drives: training on a thread of its own, reporting to an
    :class:`Events` queue, and what each epoch's end asks of it."""
    model: keras.Model
    optimizer: keras.optimizers.Optimizer  # the user's: model.optimizer unless the model has one
    workers: int  # how many "started" events the training reports
    steps_per_epoch: int
    batch_size: float  # the mean minibatch size, for the throughput
    timeout_s: float
    waits_between_epochs: bool  # the training waits for after_epoch between epochs (it drains there)

    def train(self, events: Events) -> None:
        """Trains for the whole fit, reporting to `events`; started after on_train_begin."""

    def epoch_end(self, epoch: int, stopped: bool, events: Events) -> dict:
        """Puts the weights the epoch ended with into the Keras model (validation and callbacks see
        them); returns extra epoch logs."""

    def after_epoch(self, epoch: int, stopped: bool) -> None:
        """An epoch's callbacks have run (`stopped`: training ends there)."""

    def stage_optimizers(self) -> list:
        """The stages' copies of the optimizer, which follow it (:class:`LearningRateFollower`)."""

    def request_stop(self) -> None:
        """The training admits no more minibatches."""

    def abort(self) -> None:
        """The training stops now."""


class RunnerTraining:
    """A runner's training as :func:`run_fit` drives it (a :class:`Training`): the whole fit
    without draining, or, for a runner with global weights that checkpoints or may restart a lost
    worker, epoch by epoch (:class:`hetpipe_tf.runtime.checkpoint.EpochSegments`)."""

    def __init__(self, runner: Runner, x: tf.data.Dataset, options: FitOptions):
        self.runner, self.options = runner, options
        self.global_weights = isinstance(runner, GlobalWeightsRunner)
        if options.checkpoints is not None and not self.global_weights:
            raise ValueError(f"checkpoints={options.checkpoints!r}: a {type(runner).__name__} has no global weights "
                             f"to save; HetPipeStrategy(checkpoint_dir=...) saves a run's checkpoints")
        self.model = runner.model
        self.optimizer = check_optimizer(runner.config.optimizer)
        self.workers = runner.num_workers
        self.steps_per_epoch = options.steps_per_epoch or epoch_steps(x)
        self.batch_size = mean_batch_size(x, runner.config.minibatch_sizes)
        self.timeout_s = runner.config.timeout_s
        positions = options.positions or [0] * self.workers
        runner.begin_fit(worker_shards(x, self.workers, runner.config.minibatch_sizes), positions)
        by_epoch = self.global_weights and (options.checkpoints is not None or runner.trains_by_epoch)
        self.segments = EpochSegments(options.checkpoints, self.steps_per_epoch, self.workers, options.initial_epoch,
                                      options.epochs, positions) if by_epoch else None
        self.waits_between_epochs = by_epoch

    @property
    def traced(self) -> bool:
        return self.options.trace_path is not None

    def train(self, events: Events) -> None:
        if self.segments is None:  # across the epochs without draining
            first, epochs, steps = self.options.initial_epoch, self.options.epochs, self.steps_per_epoch
            epoch_ends = [(e - first) * steps // self.workers for e in range(first + 1, epochs + 1)]
            self.runner.train_segment([-(-(epochs - first) * steps // self.workers)] * self.workers, events, True,
                                      self.traced, epoch_ends)
            return
        self.segments.train(events, lambda steps, first: self._train_epoch(events, steps, first))

    def _train_epoch(self, events: Events, steps: Sequence[int], first: bool) -> None:
        """Each worker goes on in its data where the last epoch ended, then drains."""
        self.runner.train_segment(steps, events, first, self.traced, ())
        self.runner.drain()

    def epoch_end(self, epoch: int, stopped: bool, events: Events) -> dict:
        runner = self.runner
        if self.segments is not None:
            self.segments.epoch_end(epoch, stopped, events, lambda e, p: runner.run_state(e, p, self.options.plan),
                                    runner.after_drain)
        runner.epoch_weights(events, stopped)
        validation = self.options.validation_data
        logs = {f"val_{key}": v for key, v in runner.evaluate(validation).items()} if validation else {}
        if self.global_weights:
            logs.update(runner.epoch_logs())
        report = runner.emulation_report()
        if report is not None:
            logs["emulated_overrun_fraction"] = report.overrun_fraction
        return logs

    def after_epoch(self, epoch: int, stopped: bool) -> None:
        if self.segments is not None:
            self.segments.after_epoch(epoch, stopped)

    def stage_optimizers(self) -> list:
        return self.runner.stage_optimizers()

    def request_stop(self) -> None:
        self.runner.request_stop()

    def abort(self) -> None:
        if self.segments is not None:
            self.segments.release()
        self.runner.abort()


def done_event(events: Events) -> Callable[..., None]:
    """What reports a minibatch done to `events`: on_minibatch_done(..., logs) -> a "done" event
    with its logs and when it completed."""
    return lambda *where_and_logs: events.put("done", (where_and_logs[-1], time.perf_counter()))


def warn_if_not_faithful(report: EmulationReport | None) -> None:
    """Prints the emulation's warning line to stderr when `report` (or None) was not faithful."""
    line = report.warning() if report is not None else None
    if line:
        print(line, file=sys.stderr, flush=True)


def run_fit(training: Training, options: FitOptions) -> keras.callbacks.History:
    """Runs Keras's fit protocol (the callbacks, History, progress bar, `epochs` from
    `initial_epoch` as Keras's: the optimizers' iterations count from ``initial_epoch *
    steps_per_epoch``) over `training`, which runs on a thread of its own; returns the History."""
    return KerasLoop(training, options).run()


class KerasLoop:
    """Keras's fit protocol on the caller's thread over a :class:`Training` on another (see the
    module docstring): one :meth:`run`."""

    def __init__(self, training: Training, options: FitOptions):
        self.training, self.options = training, options
        self.model = training.model
        if getattr(self.model, "optimizer", None) is None:
            self.model.optimizer = training.optimizer  # callbacks read and set its learning rate
        self.events = Events()
        self._follow = LearningRateFollower(self.model, training.optimizer, training.stage_optimizers)
        # Only a callback's step hooks see or set the optimizer within an epoch: without one, it
        # follows at the epochs' starts and ends alone (each step's following costs two host round trips).
        self._each_step = _has_step_hooks(options.callbacks)
        verbose = 1 if options.verbose == "auto" else options.verbose
        self.callbacks = keras.callbacks.CallbackList(
            options.callbacks, add_history=True, add_progbar=verbose != 0, model=self.model, verbose=verbose,
            epochs=options.epochs, steps=training.steps_per_epoch)
        self.completed = options.initial_epoch * training.steps_per_epoch  # the updates applied
        self.stopped = False

    def run(self) -> keras.callbacks.History:
        """Trains every epoch, or until stopped; on any error or Ctrl-C it stops the training
        before leaving."""
        self.model.stop_training = False
        self.callbacks.on_train_begin()
        start_thread(self._train, "hetpipe-fit")
        history_logs: dict[str, float] = {}
        try:
            t_epoch = min(self.events.get("started") for _ in range(self.training.workers))
            for epoch in range(self.options.initial_epoch, self.options.epochs):
                history_logs, t_epoch = self._epoch(epoch, t_epoch)
                if self.stopped:
                    break
            self.events.wait_finished(self.training.timeout_s)
        except BaseException:
            # A callback failed, training failed, or the user interrupted: stop every stage and
            # let the training threads end before leaving, but not for longer than ABORT_GRACE_S:
            # a thread can be in a call to a lost task or in a server's wait until its timeout.
            self.training.abort()
            try:
                self.events.wait_finished(min(self.training.timeout_s, ABORT_GRACE_S))
            except BaseException:  # noqa: BLE001 - their errors follow from the abort
                pass
            raise
        self.callbacks.on_train_end(history_logs)
        return self.model.history

    def _train(self) -> None:
        error = None
        try:
            self.training.train(self.events)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error = exc
        self.events.finished(error)

    def _follow_optimizer(self, step_end: bool = False) -> None:
        if self._each_step or not step_end:
            self._follow(self.completed)

    def _epoch(self, epoch: int, t_epoch: float) -> tuple[dict[str, float], float]:
        """One epoch from `t_epoch` (when the last ended); returns its logs and when it ended."""
        training, last = self.training, epoch + 1 == self.options.epochs
        self.callbacks.on_epoch_begin(epoch)
        self._follow_optimizer()
        sums, count, t_done = self._steps(t_epoch)
        self._follow_optimizer()  # validation and the epoch's callbacks see its iterations
        logs = {k: v / max(count, 1) for k, v in sums.items()}
        if t_done > t_epoch:
            logs["images_per_s"] = count * training.batch_size / (t_done - t_epoch)
        if not training.waits_between_epochs and (self.stopped or last):
            # The run's last pushes land before its last logs are taken and the global
            # weights go into the model (a minibatch is counted before its wave is pushed).
            # Training that waits between epochs has drained before its epoch_end instead.
            self.events.wait_finished(training.timeout_s)
        logs.update(training.epoch_end(epoch, self.stopped, self.events))
        self.callbacks.on_epoch_end(epoch, logs)
        self._follow_optimizer()
        if self.model.stop_training and not self.stopped:
            self.stopped = True
            training.request_stop()
        training.after_epoch(epoch, self.stopped or last)
        return logs, t_done

    def _steps(self, t_epoch: float) -> tuple[dict[str, float], int, float]:
        """An epoch's steps: the sums of their logs, the minibatches trained and when the last completed."""
        sums: dict[str, float] = {}
        count, t_done = 0, t_epoch
        for step in range(self.training.steps_per_epoch):
            self.callbacks.on_train_batch_begin(step)
            logs, t_done = self._next_done(t_done)
            # Logs None: a minibatch that a lost virtual worker will not train, a step without an update.
            trained = logs is not None
            self.completed += 1 if trained and not self.stopped else 0  # the optimizers' iterations
            for k, v in (logs or {}).items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += trained
            self.callbacks.on_train_batch_end(step, {k: v / max(count, 1) for k, v in sums.items()})
            self._follow_optimizer(step_end=True)
            if self.model.stop_training or self.stopped:
                if not self.stopped:
                    self.training.request_stop()
                self.stopped = True
                break
        return sums, count, t_done

    def _next_done(self, t_done: float) -> tuple[dict[str, float] | None, float]:
        """The next minibatch's (logs, completion time); a non-finite loss's logs when a
        TerminateOnNaN callback takes them (training then stops), with `t_done` unchanged."""
        try:
            return self.events.get("done")
        except Exception as exc:  # noqa: BLE001 - re-raised unless TerminateOnNaN takes it
            logs = _terminate_on_nan_logs(exc, self.options.callbacks)
            if logs is None:
                raise
            self.events.forgive(exc)
            self.stopped = True
            return logs, t_done


#: A callback's hooks that run at each step.
_STEP_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


def _has_step_hooks(callbacks: Sequence[keras.callbacks.Callback] | None) -> bool:
    """Whether any of `callbacks` has a hook of its own (not keras.callbacks.Callback's) that runs at each step."""
    return any(getattr(type(cb), hook) is not getattr(keras.callbacks.Callback, hook)
               for cb in callbacks or () for hook in _STEP_HOOKS)


def _terminate_on_nan_logs(error: BaseException,
                           callbacks: Sequence[keras.callbacks.Callback] | None) -> dict[str, float] | None:
    """The logs of the minibatch whose non-finite loss ended training, when a TerminateOnNaN
    callback is there to see them; else None."""
    cause = error.__cause__
    if not (isinstance(cause, NonFiniteError) and cause.logs):
        return None
    if not any(isinstance(c, keras.callbacks.TerminateOnNaN) for c in callbacks or ()):
        return None
    return cause.logs


class LearningRateFollower:
    """Keeps the user's optimizer (what callbacks see as model.optimizer) and the stages' copies in
    step, called after every step when a callback has step hooks, else at each epoch's start and
    end: its iteration count follows the completed updates, so that a schedule's learning rate
    reads right, and a learning rate a callback set reaches every copy (each copy computes a
    schedule from its own iterations). Per call it assigns one variable and reads one; the copies
    are set only when the value changed, or the copies did (a virtual worker's process started
    again)."""

    def __init__(self, model: keras.Model, template: keras.optimizers.Optimizer,
                 optimizers: Callable[[], list[Any]]) -> None:
        self._model, self._template, self._optimizers = model, template, optimizers
        # the learning rate the copies were last given, and which copies
        self._set: tuple[float | None, tuple[int, ...]] = (None, ())
        self._inner: tuple[Any, Any] = (None, None)  # (the optimizer callbacks see, its inner optimizer), checked once

    def __call__(self, completed: int) -> None:
        seen = self._model.optimizer if getattr(self._model, "optimizer", None) is not None else self._template
        if seen is not self._inner[0]:
            self._inner = (seen, inner_optimizer(seen))
        template = self._inner[1]
        iterations = template.iterations.value
        _variable_ops.assign_variable_op(iterations.handle, tf.constant(completed, iterations.dtype))
        given = template._learning_rate
        if isinstance(given, keras.optimizers.schedules.LearningRateSchedule):
            return
        if isinstance(given, keras.Variable):  # the op itself: a third of the variable's read's host time
            lr = float(_variable_ops.read_variable_op(given.value.handle, given.value.dtype))
        else:
            lr = float(template.learning_rate)
        optimizers = self._optimizers()
        given = (lr, tuple(map(id, optimizers)))
        if given != self._set:
            for opt in optimizers:
                opt.learning_rate = lr
            self._set = given


def start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
