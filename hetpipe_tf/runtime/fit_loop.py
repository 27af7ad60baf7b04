"""A Keras-like ``fit`` driven by pipelines that train in other threads.

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
import threading

import keras
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops as _variable_ops

from hetpipe_tf.runtime.stage_runtime import NonFiniteError


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

    def sync_optimizer(completed):
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
                sync_optimizer(completed)
                if model.stop_training or stopped:
                    if not stopped:
                        request_stop()
                    stopped = True
                    break
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
    step, called after every step: its iteration count follows the completed updates, so that a
    schedule's learning rate reads right, and a learning rate a callback set reaches every copy
    (each copy computes a schedule from its own iterations). Per step it assigns one variable and
    reads one; the copies are set only when the value changed, or the copies did (a virtual
    worker's process started again)."""

    def __init__(self, model, template, optimizers):
        self._model, self._template, self._optimizers = model, template, optimizers
        self._set = (None, ())  # the learning rate the copies were last given, and which copies

    def __call__(self, completed):
        template = self._model.optimizer if getattr(self._model, "optimizer", None) is not None else self._template
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


def epoch_steps(dataset):
    """Minibatches in one pass over `dataset` (a finite tf.data.Dataset)."""
    steps = int(dataset.cardinality())
    if steps <= 0:
        raise ValueError("steps_per_epoch is needed: the dataset's length is unknown or infinite")
    return steps


def batch_size_of(dataset):
    """The static batch size of a dataset of (inputs, labels)."""
    import tensorflow as tf

    size = tf.nest.flatten(dataset.element_spec[0])[0].shape[0]
    if size is None:
        raise ValueError(f"the dataset's batch size must be static (batch(..., drop_remainder=True)); its "
                         f"element spec is {dataset.element_spec}")
    return int(size)
