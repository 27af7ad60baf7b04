import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.api.callbacks import PipelineTensorBoard
from hetpipe_tf.pipeline.instructions import Backward, Forward
from hetpipe_tf.runtime.checkpoint import Checkpoints
from hetpipe_tf.runtime.compiled import traces_made
from hetpipe_tf.runtime.fit_loop import FitOptions, fit
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.virtual_worker import Dilation, VirtualWorker
from tests.helpers import models
from tests.helpers.data import mlp_dataset as _dataset
from tests.helpers.models import LOSS
from tests.helpers.references import clone, stale_sgd_reference


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []
        self.epoch_weights = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch", batch, sorted(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch", epoch, sorted(logs)))
        self.epoch_weights.append([v.numpy() for v in self.model.trainable_variables])

    def on_train_end(self, logs=None):
        self.calls.append("train_end")


def test_fit_behaves_like_keras_fit():
    keras.utils.set_random_seed(1)
    model = models.mlp()
    vw = VirtualWorker(model, "1,0.5", num_in_flight=2, optimizer=keras.optimizers.SGD(0.1),
                       loss=LOSS, metrics=["accuracy"], timeout_s=60)
    recorder = Recorder()
    history = vw.fit(_dataset(5), epochs=3, validation_data=_dataset(2, seed=1), callbacks=[recorder], verbose=0)
    assert history is model.history
    assert set(history.history) >= {"loss", "accuracy", "val_loss", "val_accuracy", "images_per_s",
                                    "emulated_overrun_fraction"}
    assert all(len(v) == 3 for v in history.history.values())
    assert recorder.calls[0] == "train_begin" and recorder.calls[-1] == "train_end"
    assert [c[1] for c in recorder.calls if c[0] == "batch"] == [0, 1, 2, 3, 4] * 3
    # The last epoch ends with the last update: its validation used the final weights.
    assert history.history["val_loss"][-1] == pytest.approx(vw.evaluate(_dataset(2, seed=1))["loss"], abs=1e-5)
    assert np.isfinite(history.history["loss"]).all()


def test_epoch_end_weights_are_the_state_right_after_the_epochs_last_update():
    keras.utils.set_random_seed(2)
    model = models.mlp()
    data = _dataset(6)
    batches = [(x.numpy(), y.numpy()) for x, y in data]
    # Epoch 1 ends after update 6; the pipeline has already started minibatches 7 and 8.
    want, _ = stale_sgd_reference(model, batches, 3, keras.optimizers.SGD(0.1))
    vw = VirtualWorker(model, "1,1,1", num_in_flight=3, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=60)
    recorder = Recorder()
    vw.fit(data, epochs=2, callbacks=[recorder], verbose=0)
    for got, w in zip(recorder.epoch_weights[0], want):
        np.testing.assert_allclose(got, w, atol=1e-5)


def test_stop_training_stops_the_pipeline_early():
    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    model = models.mlp()
    vw = VirtualWorker(model, "1,1", num_in_flight=2, optimizer="sgd", loss=LOSS, timeout_s=60)
    history = vw.fit(_dataset(20), epochs=5, callbacks=[StopAt()], verbose=0)
    assert len(history.history["loss"]) == 1
    assert vw.report.steps < 10
    assert all(rt.stash.stats().num_versions == 0 for rt in vw.runtimes)
    vw.fit(_dataset(4), epochs=1, verbose=0)  # the next run starts clean


def test_failing_callback_stops_every_stage():
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("callback failed")

    model = models.mlp()
    vw = VirtualWorker(model, "1,1", num_in_flight=2, optimizer="sgd", loss=LOSS, timeout_s=60)
    with pytest.raises(RuntimeError, match="callback failed"):
        vw.fit(_dataset(50), epochs=4, callbacks=[Boom()], verbose=0)
    assert not [t for t in threading.enumerate() if t.name.startswith("hetpipe-")]
    vw.fit(_dataset(3), epochs=1, verbose=0)


def test_keras_and_pipeline_tensorboard_callbacks_write_scalars(tmp_path):
    model = models.mlp()
    vw = VirtualWorker(model, "1,0.5", num_in_flight=2, optimizer="sgd", loss=LOSS, metrics=["accuracy"],
                       timeout_s=60)
    vw.fit(_dataset(4), epochs=2, verbose=0,
           callbacks=[PipelineTensorBoard(str(tmp_path / "hetpipe"), vw),
                      keras.callbacks.TensorBoard(str(tmp_path / "keras"))])
    tags = set()
    for f in tmp_path.glob("**/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(f)):
            tags.update(v.tag for v in event.summary.value)
    assert {"loss", "accuracy", "images_per_s", "busy_fraction/stage_0", "busy_fraction/stage_1",
            "emulation", "emulated_overrun_fraction"} <= tags
    assert "epoch_loss" in tags  # written by Keras's own TensorBoard callback


def test_bad_inputs_get_clear_errors():
    model = models.mlp()
    with pytest.raises(ValueError, match=r"num_in_flight \(Nm\) must be None or an integer >= 1, got 0"):
        VirtualWorker(model, "1,1", num_in_flight=0, optimizer="sgd", loss=LOSS)
    with pytest.raises(ValueError, match="a loss is needed"):
        VirtualWorker(model, "1,1", optimizer="sgd")
    vw = VirtualWorker(model, "1,1", optimizer="sgd", loss=LOSS)
    with pytest.raises(ValueError, match="steps_per_epoch is needed"):
        vw.fit(_dataset(2).repeat(), epochs=1, verbose=0)


def test_given_references_are_what_the_emulated_devices_pace_to():
    model = models.mlp()
    given = ((0.004, 0.006), (0.002, 0.010))
    vw = VirtualWorker(model, "1,0.5", num_in_flight=2, optimizer="sgd", loss=LOSS, dilation=2.0, references=given)
    vw.train(_dataset(6), 6, trace=True)
    assert [(r[Forward], r[Backward]) for r in vw.references] == list(given)  # not timed again
    assert vw.task_seconds(1, Backward) == pytest.approx(2.0 / 0.5 * 0.010)
    spans = [e for e in vw.trace.events() if e.get("ph") == "X" and e["cat"] in ("Forward", "Backward")]
    for e in spans:  # each pass occupies its device for its target: dilation / speed x the reference given
        kind = Forward if e["cat"] == "Forward" else Backward
        assert e["dur"] * 1e-6 == pytest.approx(vw.task_seconds(e["tid"], kind), rel=1e-3, abs=2e-6)
    with pytest.raises(ValueError, match=r"one \(forward, backward\) pair of seconds > 0 per stage \(2 stages\)"):
        VirtualWorker(model, "1,0.5", optimizer="sgd", loss=LOSS, references=((0.1, 0.1),))
    with pytest.raises(ValueError, match="per stage"):
        VirtualWorker(model, "1,0.5", optimizer="sgd", loss=LOSS, references=((0.1, 0.0), (0.1, "x")))


def test_learning_rate_callbacks_reach_every_stage():
    model = models.mlp()
    vw = VirtualWorker(model, "1,1,1", num_in_flight=2, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=60)
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    vw.fit(_dataset(4), epochs=3, callbacks=[schedule], verbose=0)
    assert model.optimizer is vw.optimizer
    assert [float(rt.optimizer.learning_rate) for rt in vw.runtimes] == pytest.approx([0.1 / 3] * 3)


def test_nm_is_resolved_where_the_worker_is_made_and_a_run_config_gives_it():
    model = models.mlp()
    vw = VirtualWorker(model, "cpu,cpu", loss=LOSS)
    assert vw.num_in_flight == vw.config.num_in_flight == 2  # Nm = the number of stages
    with pytest.raises(ValueError, match=r"RunConfig gives num_in_flight \(Nm\) as an integer, got None"):
        VirtualWorker.from_config(model, WorkerSpec("cpu,cpu"), RunConfig(loss=LOSS))


def test_a_worker_decides_its_dilation_once():
    model = models.mlp()
    given = VirtualWorker(model, "1,1", dilation=2, loss=LOSS)
    assert given.dilation == Dilation(2.0)
    minibatch = next(iter(_dataset(1)))
    with pytest.raises(ValueError, match=r"dilation is decided \(2\): a worker calibrates once"):
        given.calibrate_dilation(minibatch)
    real = VirtualWorker(model, "cpu,cpu", loss=LOSS)  # nothing paced: no probe, the value unused
    assert real.dilation is None and real.calibrate_dilation(minibatch) == Dilation(1.0)


def test_checkpoints_are_refused_without_global_weights(tmp_path):
    vw = VirtualWorker(models.mlp(), "cpu,cpu", loss=LOSS)
    with pytest.raises(ValueError, match="a VirtualWorker has no global weights to save"):
        fit(vw, _dataset(2), FitOptions(checkpoints=Checkpoints(str(tmp_path)), verbose=0))


def test_a_second_fit_traces_nothing_and_goes_on_like_keras():
    # Nm = 1 trains as Keras does; the momentum and the optimizers' iterations carry over from
    # the first call to the second in both.
    keras.utils.set_random_seed(3)
    model = models.mlp()
    ref = clone(model)
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=LOSS, jit_compile=False)
    vw = VirtualWorker(model, "cpu,cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                       loss=LOSS, timeout_s=60)
    first = vw.fit(_dataset(6), epochs=1, verbose=0).history["loss"]
    traced = traces_made()
    assert traced > 0  # the first call traced the stages' tasks
    second = vw.fit(_dataset(6, seed=2), epochs=2, verbose=0).history["loss"]
    assert traces_made() == traced, "a second fit traced again what the first had traced"
    want_first = ref.fit(_dataset(6), epochs=1, verbose=0, shuffle=False).history["loss"]
    want_second = ref.fit(_dataset(6, seed=2), epochs=2, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(first + second, want_first + want_second, rtol=1e-5)
    for got, want in zip(model.weights, ref.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, err_msg=got.path)


def test_a_built_worker_goes_on_as_the_same_worker_of_another_plan_only_if_nothing_but_nm_and_placement_differ():
    """What a switch of plans keeps (hetpipe_tf.runtime.wsp_runner.WSPRunner.keep_workers): a built
    worker serves as another plan's worker of the same devices, cuts, slowdowns and references whose
    configuration differs at most in Nm (up to the versions its stashes hold), placement and dilation."""
    keras.utils.set_random_seed(1)
    model = models.mlp()
    config = RunConfig(num_in_flight=2, optimizer=keras.optimizers.SGD(0.1), loss=LOSS, timeout_s=60)
    spec = WorkerSpec("cpu,cpu", boundaries=(0, 2))
    built = VirtualWorker.from_config(model, spec, config)
    same = VirtualWorker.from_config(model, spec, config.replace(num_in_flight=1, placement="local", dilation=2.0))
    assert not built.can_go_on_as(same)  # not built yet: nothing to keep
    x, y = next(iter(_dataset(1)))
    built.prepare(x, y)
    assert built.can_go_on_as(same)
    other_cuts = VirtualWorker.from_config(model, WorkerSpec("cpu,cpu", boundaries=(0, 1)), config)
    more = VirtualWorker.from_config(model, spec, config.replace(num_in_flight=3))
    other_optimizer = VirtualWorker.from_config(model, spec, config.replace(optimizer=keras.optimizers.SGD(0.1)))
    assert not any(built.can_go_on_as(vw) for vw in (other_cuts, more, other_optimizer))
    built.go_on_under(same.config)
    assert built.num_in_flight == 1 and built.dilation.value == 2.0
    assert built.can_go_on_as(VirtualWorker.from_config(model, spec, config))  # its stashes still hold two
