"""What a stage does with a non-finite loss or gradient: it stops the run, names the minibatch,
the virtual worker and the stage, and applies and pushes nothing of that minibatch."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.pipeline.executor import PipelineError
from hetpipe_tf.pipeline.instructions import Backward, Forward, ReleaseWeights, StashWeights
from hetpipe_tf.runtime.stage.verdicts import NonFiniteError
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from tests.helpers import models
from tests.helpers.data import random_batches
from tests.helpers.models import LOSS
from tests.helpers.runners import wsp_runner


def _poisoned(model, n, bad, seed=0):
    """n minibatches; minibatch `bad` (1-based) holds a NaN input."""
    batches = random_batches(model, n, seed=seed)
    x, y = batches[bad - 1]
    x = x.copy()
    x[0, 0] = np.nan
    batches[bad - 1] = (x, y)
    return batches


def _nan_carrying_mlp():
    """The test mlp without its ReLU: with oneDNN, the fused MatMul + BiasAdd + Relu of a compiled
    stage turns a NaN input into 0 on some CPUs (this one with AVX-512 and AMX), so the NaN would
    reach the gradient but not the loss (the apply's check then stops the run: the test of a NaN
    gradient with a finite loss below). Without it the NaN reaches the loss on every CPU."""
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(8), keras.layers.Dense(5)], name="mlp")


def _weights(vw):
    return [v.numpy() for rt in vw.runtimes for v in rt.trainable]


def test_a_nan_loss_stops_the_run_naming_minibatch_worker_and_stage_and_applies_nothing_of_it():
    keras.utils.set_random_seed(0)
    model = _nan_carrying_mlp()
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=30)
    vw.train(iter(random_batches(model, 4)), 4)
    before = _weights(vw)
    with pytest.raises(PipelineError, match=r"virtual worker 0: stage 0 failed at .*minibatch 3: the loss is nan on "
                                            r"stage 1 \(the last\); nothing of it was applied on any stage") as info:
        vw.train(iter(_poisoned(model, 6, bad=3)), 6)
    cause = info.value.__cause__
    assert isinstance(cause, NonFiniteError) and (cause.minibatch, cause.stage) == (3, 1)
    after = _weights(vw)
    assert all(np.isfinite(w).all() for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))  # minibatches 1 and 2 were applied


def test_a_nan_gradient_with_a_finite_loss_is_refused_by_the_apply():
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = models.mlp()

    def finite_loss_nan_gradient(y_true, y_pred):  # sqrt at 0: value 0, gradient inf * 0 = NaN
        return LOSS(y_true, y_pred) + tf.reduce_mean(tf.sqrt(tf.square(y_pred) * 0.0))

    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1),
                       loss=finite_loss_nan_gradient, timeout_s=30)
    # The verdict goes upstream with the gradient: the first stage applies nothing of minibatch 1 either,
    # and fails the run before it reports the minibatch done, naming the stage and weight that went bad.
    with pytest.raises(PipelineError, match=r"stage 0 failed at \[Backward\(1\).*minibatch 1: the gradient of "
                                            r"stage 1 is not finite \(NaN or Inf in mlp/dense_\d+/kernel"):
        vw.train(iter(random_batches(model, 4)), 4)
    assert all(np.isfinite(w).all() for w in _weights(vw))


def test_a_nan_gradient_of_the_last_minibatch_is_refused_before_the_run_ends():
    keras.utils.set_random_seed(0)
    model = models.mlp()

    def finite_loss_nan_gradient(y_true, y_pred):
        return LOSS(y_true, y_pred) + tf.reduce_mean(tf.sqrt(tf.square(y_pred) * 0.0))

    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1),
                       loss=finite_loss_nan_gradient, timeout_s=30)
    before = [v.numpy() for v in model.trainable_weights]
    with pytest.raises(PipelineError, match=r"minibatch 1: the gradient of stage \d is not finite"):
        vw.train(iter(random_batches(model, 1)), 1)  # one minibatch: no next apply reads the verdict
    assert all(np.array_equal(b, w) for b, w in zip(before, _weights(vw)))  # nothing of it was applied


def test_a_nan_in_one_worker_pushes_nothing_of_it_to_the_parameter_servers():
    keras.utils.set_random_seed(0)
    model = _nan_carrying_mlp()
    nm, n = 2, 8
    runner = wsp_runner(model, ("1,1", "1,1"), nm, 0, loss=LOSS)
    with pytest.raises(PipelineError, match=r"virtual worker 1: stage \d failed at .*minibatch 5: the loss is nan on "
                                            r"stage 1"):
        runner.train([random_batches(model, n), _poisoned(model, n, bad=5, seed=1)], n)
    values = runner.servers.values()
    assert all(np.isfinite(v).all() for v in values.values())
    clocks, _ = runner.servers.clock.clocks()
    assert clocks[1] <= (5 - 1) // nm  # waves 0 and 1 (minibatches 1..4) at most; not wave 2, which holds 5


def test_terminate_on_nan_stops_fit_as_in_keras_and_the_model_keeps_finite_weights():
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = _nan_carrying_mlp()
    batches = _poisoned(model, 12, bad=9)
    data = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=(
        tf.TensorSpec(batches[0][0].shape, tf.float32), tf.TensorSpec(batches[0][1].shape, tf.int64)))
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=2, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=30)
    history = vw.fit(data, epochs=3, steps_per_epoch=4, callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0)
    assert model.stop_training
    assert len(history.history["loss"]) == 3 and np.isnan(history.history["loss"][-1])
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
    assert int(model.optimizer.iterations) <= 8  # applied updates only: not minibatch 9, whose loss was nan


def test_a_pass_timed_on_the_stages_device_consumes_nothing_and_changes_no_state():
    """StageRuntime.timed_solo_pass (the reference of a stage on another task's device): both
    passes timed, the minibatch's inputs and stashed version still there for its real passes."""
    keras.utils.set_random_seed(0)
    model = models.mlp()
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=30)
    (x, y), = random_batches(model, 1)
    vw.prepare(x, y)
    first, last = vw.runtimes
    for rt in vw.runtimes:
        rt.run((StashWeights(0),))
    first.set_loaded(0, vw.staged.split_inputs(x)[0])
    state = [v.numpy() for rt in vw.runtimes for v in rt.trainable + rt.non_trainable]
    forward, backward = first.timed_solo_pass(0)
    assert forward > 0 and backward > 0
    first.run((Forward(0),))  # its inputs and w_0 are still there
    last.set_received(0, first.sent(0))
    last.set_labels(0, y)
    assert all(t > 0 for t in last.timed_solo_pass(0))
    last.run((Forward(0), Backward(0)))
    first.set_output_gradients(0, last.input_gradients(0))
    first.run((Backward(0),))
    after = [v.numpy() for rt in vw.runtimes for v in rt.trainable + rt.non_trainable]
    assert all(np.array_equal(a, b) for a, b in zip(state, after))


def test_solo_times_are_taken_with_what_a_stage_receives_already_on_its_device(monkeypatch):
    """Moving activations, gradients and labels between devices is communication, which the
    emulation does not pad: measure_stage_times puts them on the receiving stage's device before
    it times the pass (timed with them elsewhere, the pass would hold the copy, which pacing
    then dilates as if it were compute)."""
    from hetpipe_tf.runtime.stage import StageRuntime
    from hetpipe_tf.runtime.stage.timing import measure_stage_times

    keras.utils.set_random_seed(0)
    model = models.mlp()
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=30, tf_devices=("/device:CPU:0", "/device:CPU:1"))
    (x, y), = random_batches(model, 1)
    vw.prepare(x, y)
    assert len({rt.device for rt in vw.runtimes}) == 2
    where = []

    def recording(name):
        original = getattr(StageRuntime, name)

        def record(self, p, tensors=None, *rest):
            placed = [tf.DeviceSpec.from_string(t.device) for t in tf.nest.flatten(tensors) if t is not None]
            own = tf.DeviceSpec.from_string(self.device)
            where.extend((name, self.index, (d.device_type, d.device_index) == (own.device_type, own.device_index))
                         for d in placed)
            return original(self, p, tensors, *rest)

        monkeypatch.setattr(StageRuntime, name, record)

    for name in ("set_received", "set_labels", "set_output_gradients"):
        recording(name)
    times = measure_stage_times(vw.runtimes, vw.staged.split_inputs, x, y, repeats=2)
    assert len(times) == 2 and all(t > 0 for stage in times for t in stage.values())
    assert {(name, stage) for name, stage, _ in where} == {("set_received", 1), ("set_labels", 1),
                                                           ("set_output_gradients", 0)}
    assert all(on_its_device for *_, on_its_device in where), where


def test_a_merge_moves_the_live_weights_and_the_versions_stashed_from_its_first_minibatch_only():
    """§5: merging global weights pulled after wave c adds (pulled - base) to w_local and to the
    versions of the minibatches that will run on them, not to those stashed before."""
    keras.utils.set_random_seed(0)
    model = models.mlp()
    vw = VirtualWorker(model, "cpu", num_in_flight=2, optimizer=keras.optimizers.SGD(0.1), loss=LOSS, timeout_s=30,
                       record_provenance=True)
    (x, y), = random_batches(model, 1)
    vw.prepare(x, y)
    rt, = vw.runtimes
    before = [v.numpy() for v in rt.trainable]
    rt.run((StashWeights(3), StashWeights(5)))
    base = rt.synchronisation.values()
    pulled = [b + 0.5 for b in base]
    new_base = rt.synchronisation.merge_pulled(base, pulled, first_minibatch=4, included={(0, 0), (1, 0)})
    dtypes = [v.dtype for v in rt.trainable]
    assert all(np.allclose(n, p) for n, p in zip(new_base, pulled))
    assert all(np.allclose(v.numpy(), w + 0.5) for v, w in zip(rt.trainable, before))
    assert all(np.array_equal(v, w) for v, w in zip(rt.stash.get(3, dtypes), before))
    assert all(np.allclose(v, w + 0.5) for v, w in zip(rt.stash.get(5, dtypes), before))
    assert rt.provenance.live_globals == {(0, 0), (1, 0)}
    rt.run((ReleaseWeights(3), ReleaseWeights(5)))
    assert rt.stash.stats().num_versions == 0
