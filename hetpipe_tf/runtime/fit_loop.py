"""The one ``fit`` of every runner, Keras's, driven by pipelines that train in other threads.

:func:`fit` is written once for the three runners (:class:`Runner`): one virtual worker
(:class:`hetpipe_tf.runtime.virtual_worker.VirtualWorker`), several in this process
(:class:`hetpipe_tf.runtime.wsp_runner.WSPRunner`) and several in processes of their own
(:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`): each worker's shard of the data,
the epochs (run across without draining, or trained one by one when checkpoints are saved or a
lost worker may restart, :class:`hetpipe_tf.runtime.checkpoint.EpochSegments`), the weights each
epoch ended with in the Keras model, validation, the callbacks, the trace and the emulation's
warning.

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
from typing import Protocol

import keras
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops as _variable_ops

from hetpipe_tf.runtime.checkpoint import EpochSegments
from hetpipe_tf.runtime.optimizers import check_optimizer, inner_optimizer
from hetpipe_tf.runtime.stage.verdicts import NonFiniteError
from hetpipe_tf.runtime.worker_data import epoch_steps, mean_batch_size, worker_shards


#: The longest fit waits for its training threads after stopping them on an error.
ABORT_GRACE_S = 5.0


class Events:
    """Events from training threads, taken by kind; other kinds wait their turn."""

    def __init__(self, producers=1):
        self._queue = queue.Queue()
        self._pending = collections.defaultdict(collections.deque)
        self._producers = producers
        self._finished = 0
        self.errors = []

    def put(self, kind, payload=None):
        self._queue.put((kind, payload))

    def finished(self, error=None):
        """A training thread ends (with its error, if any)."""
        self._queue.put(("finished", error))

    def get(self, kind):
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

    def forgive(self, error):
        """`error` was handled by the caller: wait_finished no longer raises it."""
        self.errors.remove(error)

    def wait_finished(self, timeout):
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


class Runner(Protocol):
    """What :func:`fit` trains: `num_workers` virtual workers of a run configured by `config`,
    whose global weights end in `model`."""
    model: keras.Model
    config: object
    num_workers: int
    trace: object  # the TraceRecorder of the last training, or None

    def begin_fit(self, shards, positions) -> None:
        """Before training: `shards`, each worker's endless stream of minibatches, of which a
        resumed run has consumed `positions`."""

    def train_segment(self, steps, events, first, trace, epoch_ends) -> None:
        """Trains `steps` minibatches of every worker, each where it ended (the fit's `first`: at its
        position) and returns. Reports to `events` ("started" per worker when `first`, "done" per
        minibatch with (logs, completion time)); a runner that can records every stage's state
        right after each minibatch of `epoch_ends` ("snapshot")."""

    def drain(self) -> None:
        """After a train, every stage takes the global weights (the run goes on from there)."""

    def after_drain(self, positions) -> None:
        """The workers drained between epochs, at `positions` in their shards."""

    def epoch_weights(self, events, stopped) -> None:
        """Puts the weights the epoch ended with into the Keras model (for validation and callbacks)."""

    def evaluate(self, dataset) -> dict:
        """Loss and metrics of the Keras model on `dataset`."""

    def epoch_logs(self) -> dict:
        """The runner's own logs of an epoch."""

    def run_state(self, epoch, positions, plan):
        """The run as a checkpoint holds it (:class:`hetpipe_tf.runtime.checkpoint.RunState`)."""

    def stage_optimizers(self) -> list:
        """The stages' optimizer copies (whose learning rate follows the user's optimizer)."""

    def request_stop(self) -> None:
        """Admit no more minibatches."""

    def abort(self) -> None:
        """Stop every worker now."""

    def emulation_report(self):
        """The emulation's figures of the training (None without emulated devices)."""

    def end_fit(self) -> None:
        """After training: the global weights in the Keras model."""

    @property
    def trains_by_epoch(self) -> bool:
        """Whether every fit trains epoch by epoch, draining between them (a lost worker may restart)."""


def fit(runner, x, *, epochs=1, steps_per_epoch=None, callbacks=None, verbose="auto", validation_data=None,
        trace_path=None, initial_epoch=0, checkpoints=None, positions=None, plan=None):
    """Trains `runner` (a :class:`Runner`) like ``keras.Model.fit``; returns the History.

    Each worker takes its shard of `x` (:func:`hetpipe_tf.runtime.worker_data.worker_shards`); an
    epoch is `steps_per_epoch` minibatches of all workers together, and at its end the weights it
    ended with are in the Keras model for validation and callbacks. With `checkpoints`
    (:class:`hetpipe_tf.runtime.checkpoint.Checkpoints`) it trains epoch by epoch, draining at
    each epoch's end, and saves there when due (`plan`: the plan signature saved with it;
    `positions`: the minibatches each worker's shard has already given, skipped; `initial_epoch`:
    the epoch a resumed run starts at). `trace_path` writes the trace of every worker."""
    steps_per_epoch = steps_per_epoch or epoch_steps(x)
    k = runner.num_workers
    sizes = runner.config.minibatch_sizes
    positions = positions or [0] * k
    runner.begin_fit(worker_shards(x, k, sizes), positions)
    segments = None if checkpoints is None and not runner.trains_by_epoch else EpochSegments(
        checkpoints, steps_per_epoch, k, initial_epoch, epochs, positions)
    traced = trace_path is not None

    def train(events):
        if segments is None:  # across the epochs without draining
            epoch_ends = [(e - initial_epoch) * steps_per_epoch // k for e in range(initial_epoch + 1, epochs + 1)]
            runner.train_segment(-(-(epochs - initial_epoch) * steps_per_epoch // k), events, True, traced,
                                 epoch_ends)
            return

        def train_epoch(steps, first):  # each worker goes on in its data where the last epoch ended
            runner.train_segment(steps, events, first, traced, ())
            runner.drain()

        segments.train(events, train_epoch)

    def epoch_end(epoch, stopped, events):
        if segments is not None:
            segments.epoch_end(epoch, stopped, events, lambda e, p: runner.run_state(e, p, plan), runner.after_drain)
        runner.epoch_weights(events, stopped)
        logs = {f"val_{key}": v for key, v in runner.evaluate(validation_data).items()} if validation_data else {}
        logs.update(runner.epoch_logs())
        report = runner.emulation_report()
        if report is not None:
            logs["emulated_overrun_fraction"] = report.overrun_fraction
        return logs

    history = run_fit(
        runner.model, train=train, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks,
        verbose=verbose, batch_size=mean_batch_size(x, sizes), epoch_end=epoch_end, workers=k,
        optimizer=check_optimizer(runner.config.optimizer), stage_optimizers=runner.stage_optimizers,
        request_stop=runner.request_stop, abort=lambda: (segments and segments.release(), runner.abort()),
        timeout_s=runner.config.timeout_s, initial_epoch=initial_epoch, after_epoch=segments and segments.after_epoch)
    runner.end_fit()
    if trace_path and runner.trace:
        runner.trace.write(trace_path)
    warn_if_not_faithful(runner.emulation_report())
    return history


def done_event(events):
    """What reports a minibatch done to `events`: on_minibatch_done(..., logs) -> a "done" event
    with its logs and when it completed."""
    return lambda *where_and_logs: events.put("done", (where_and_logs[-1], time.perf_counter()))


def warn_if_not_faithful(report):
    """Prints the emulation's warning line to stderr when `report` (or None) was not faithful."""
    line = report.warning() if report is not None else None
    if line:
        print(line, file=sys.stderr, flush=True)


def run_fit(model, *, train, epochs, steps_per_epoch, callbacks, verbose, batch_size, epoch_end,
            optimizer, stage_optimizers, request_stop, abort, timeout_s, workers=1, initial_epoch=0,
            after_epoch=None):
    """Runs Keras's fit protocol over training that runs in another thread; returns the History.

    Args:
      train: train(events) trains for the whole fit, reporting to `events` (an
        :class:`Events`); it runs on a thread of its own, started after on_train_begin.
      epoch_end: epoch_end(epoch, stopped, events) -> extra epoch logs; it puts the weights
        the epoch ended with into the Keras model (validation and callbacks see them).
      optimizer: the user's optimizer: ``model.optimizer`` (what callbacks read and set)
        unless the model has one.
      stage_optimizers: () -> the stages' copies of the optimizer, which follow it
        (:class:`LearningRateFollower`).
      request_stop: asks the training to stop admitting minibatches.
      abort: stops the training now.
      workers: how many `started` events the training reports.
      initial_epoch: the epoch to start at, as Keras's (`epochs` is the index of the last one
        plus 1; the optimizers' iterations count from ``initial_epoch * steps_per_epoch``).
      after_epoch: after_epoch(epoch, stopped) once an epoch's callbacks have run (`stopped`:
        training ends there), for training that waits for them between epochs.
    """
    if getattr(model, "optimizer", None) is None:
        model.optimizer = optimizer  # callbacks read and set its learning rate
    events = Events()

    def run():
        error = None
        try:
            train(events)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the caller's thread
            error = exc
        events.finished(error)

    follow = LearningRateFollower(model, optimizer, stage_optimizers)
    # Only a callback's step hooks see or set the optimizer within an epoch: without one, it
    # follows at the epochs' starts and ends alone (each step's following costs two host round trips).
    each_step = _has_step_hooks(callbacks)

    def sync_optimizer(completed, step_end=False):
        if each_step or not step_end:
            follow(completed)

    verbose = 1 if verbose == "auto" else verbose
    cbs = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0, model=model,
                                       verbose=verbose, epochs=epochs, steps=steps_per_epoch)
    model.stop_training = False
    cbs.on_train_begin()
    start_thread(run, "hetpipe-fit")
    history_logs, stopped, completed = {}, False, initial_epoch * steps_per_epoch
    try:
        t_epoch = min(events.get("started") for _ in range(workers))
        for epoch in range(initial_epoch, epochs):
            cbs.on_epoch_begin(epoch)
            sync_optimizer(completed)
            sums, count, t_done = {}, 0, t_epoch
            for step in range(steps_per_epoch):
                cbs.on_train_batch_begin(step)
                try:
                    logs, t_done = events.get("done")
                except Exception as exc:  # noqa: BLE001 - re-raised unless TerminateOnNaN takes it
                    logs = _terminate_on_nan_logs(exc, callbacks)
                    if logs is None:
                        raise
                    events.forgive(exc)
                    stopped = True
                # Logs None: a minibatch that a lost virtual worker will not train, a step without an update.
                trained = logs is not None
                completed += 1 if trained and not stopped else 0  # the optimizers' iterations count applied updates
                for k, v in (logs or {}).items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += trained
                cbs.on_train_batch_end(step, {k: v / max(count, 1) for k, v in sums.items()})
                sync_optimizer(completed, step_end=True)
                if model.stop_training or stopped:
                    if not stopped:
                        request_stop()
                    stopped = True
                    break
            sync_optimizer(completed)  # validation and the epoch's callbacks see its iterations
            epoch_logs = {k: v / max(count, 1) for k, v in sums.items()}
            if t_done > t_epoch:
                epoch_logs["images_per_s"] = count * batch_size / (t_done - t_epoch)
            t_epoch = t_done
            if after_epoch is None and (stopped or epoch + 1 == epochs):
                # The run's last pushes land before its last logs are taken and the global
                # weights go into the model (a minibatch is counted before its wave is pushed).
                # Training that waits for after_epoch has drained before its epoch_end instead.
                events.wait_finished(timeout_s)
            epoch_logs.update(epoch_end(epoch, stopped, events))
            cbs.on_epoch_end(epoch, epoch_logs)
            sync_optimizer(completed)
            history_logs = epoch_logs
            if model.stop_training and not stopped:
                stopped = True
                request_stop()
            if after_epoch:
                after_epoch(epoch, stopped or epoch + 1 == epochs)
            if stopped:
                break
        events.wait_finished(timeout_s)
    except BaseException:
        # A callback failed, training failed, or the user interrupted: stop every stage and
        # let the training threads end before leaving, but not for longer than ABORT_GRACE_S:
        # a thread can be in a call to a lost task or in a server's wait until its timeout.
        abort()
        try:
            events.wait_finished(min(timeout_s, ABORT_GRACE_S))
        except BaseException:  # noqa: BLE001 - their errors follow from the abort
            pass
        raise
    cbs.on_train_end(history_logs)
    return model.history


#: A callback's hooks that run at each step.
_STEP_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


def _has_step_hooks(callbacks):
    """Whether any of `callbacks` has a hook of its own (not keras.callbacks.Callback's) that runs at each step."""
    return any(getattr(type(cb), hook) is not getattr(keras.callbacks.Callback, hook)
               for cb in callbacks or () for hook in _STEP_HOOKS)


def _terminate_on_nan_logs(error, callbacks):
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

    def __init__(self, model, template, optimizers):
        self._model, self._template, self._optimizers = model, template, optimizers
        self._set = (None, ())  # the learning rate the copies were last given, and which copies
        self._inner = (None, None)  # (the optimizer callbacks see, its inner optimizer), checked once

    def __call__(self, completed):
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


def start_thread(target, name):
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
