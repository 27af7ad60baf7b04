"""Keras's fit protocol over training on another thread (hetpipe_tf.runtime.fit_loop)."""
import threading
import time

import keras

from hetpipe_tf.runtime.fit_loop import Events, run_fit


def _model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


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
    run_fit(model, train=train, epochs=2, steps_per_epoch=3, callbacks=None, verbose=0, batch_size=4,
            epoch_end=epoch_end, optimizer=model.optimizer, stage_optimizers=lambda: [],
            request_stop=lambda: None, abort=lambda: None, timeout_s=10.0)
    assert seen[-1] == (1, True)
