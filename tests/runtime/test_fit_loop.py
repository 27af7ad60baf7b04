"""Keras's fit protocol over training on another thread (hetpipe_tf.runtime.fit_loop)."""
import threading
import time

import keras
import pytest

from hetpipe_tf.runtime.fit_loop import Events, FitOptions, run_fit


def _model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


class _Training:
    """Training of one worker, 3 steps per epoch of 4 samples, that `train` reports
    (a hetpipe_tf.runtime.fit_loop.Training)."""
    workers, steps_per_epoch, batch_size, timeout_s, waits_between_epochs = 1, 3, 4, 10.0, False

    def __init__(self, model, train, epoch_end=lambda *_: {}, stage_optimizers=()):
        self.model, self.optimizer = model, model.optimizer
        self.train, self.epoch_end, self._stage_optimizers = train, epoch_end, list(stage_optimizers)

    def stage_optimizers(self):
        return self._stage_optimizers

    def after_epoch(self, epoch, stopped):
        pass

    def request_stop(self):
        pass

    def abort(self):
        pass


def test_wait_finished_keeps_the_events_it_passes():
    events = Events()
    events.put("snapshot", "state after the last update")
    events.finished()
    events.wait_finished(1.0)
    assert events.get("snapshot") == "state after the last update"


def test_the_last_epoch_ends_after_training_has_finished():
    """A minibatch is counted before its wave is pushed: the last epoch's logs and weights are
    taken only once the training thread ended (its last push landed)."""
    pushed = threading.Event()
    seen = []

    def train(events):
        events.put("started", time.perf_counter())
        for _ in range(2 * 3):
            events.put("done", ({"loss": 1.0}, time.perf_counter()))
        time.sleep(0.3)  # the last wave's push, after its minibatches were reported
        pushed.set()

    def epoch_end(epoch, stopped, events):
        seen.append((epoch, pushed.is_set()))
        return {}

    model = _model()
    run_fit(_Training(model, train, epoch_end), FitOptions(epochs=2, verbose=0))
    assert seen[-1] == (1, True)


def _fit_counting(callbacks, copy):
    def train(events):
        events.put("started", time.perf_counter())
        for _ in range(2 * 3):
            events.put("done", ({"loss": 1.0}, time.perf_counter()))

    model = _model()
    run_fit(_Training(model, train, stage_optimizers=[copy]), FitOptions(epochs=2, callbacks=callbacks, verbose=0))
    return model


def test_a_callback_with_step_hooks_sees_the_iterations_and_sets_the_learning_rate_at_every_step():
    copy = keras.optimizers.SGD(0.1)  # a stage's copy of the optimizer

    class Steps(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append((int(self.model.optimizer.iterations), float(copy.learning_rate)))
            self.model.optimizer.learning_rate = 0.01 * len(self.seen)  # the copy follows before the next step

    steps = Steps()
    _fit_counting([steps], copy)
    # After step n's hooks, the iterations count the n completed updates; the copy has the rate set at step n - 1.
    assert [i for i, _ in steps.seen] == list(range(6))
    assert [lr for _, lr in steps.seen] == pytest.approx([0.1, 0.01, 0.02, 0.03, 0.04, 0.05])


def test_without_step_hooks_the_optimizer_follows_at_the_epochs_ends():
    copy = keras.optimizers.SGD(0.1)

    class Epochs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(int(self.model.optimizer.iterations))
            self.model.optimizer.learning_rate = 0.5

    epochs = Epochs()
    model = _fit_counting([epochs], copy)
    assert epochs.seen == [3, 6] and int(model.optimizer.iterations) == 6
    assert abs(float(copy.learning_rate) - 0.5) < 1e-7
