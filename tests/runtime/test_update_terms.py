"""What every stage's update of a minibatch takes from the others (hetpipe_tf.runtime.update_terms):
a clip by the global norm, dynamic loss scaling, and the summed gradient of tied weights."""
import keras
import numpy as np
import pytest

from hetpipe_tf.pipeline.executor import PipelineError
from hetpipe_tf.planning.model_graph import SharedLayerError
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.stage.verdicts import NonFiniteError
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from hetpipe_tf.runtime.wsp_runner import WSPRunner
from tests.helpers import models
from tests.helpers.data import gpt2_batches
from tests.helpers.references import stale_sgd_run

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS = 6


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="d0"),
                             keras.layers.Dense(8, activation="tanh", name="d1"), keras.layers.Dense(5, name="d2")],
                            name="m")


def _batches(planted=None, scale=3e4):
    """STEPS minibatches; the one at index `planted` with inputs so large that float16 overflows."""
    rng = np.random.default_rng(0)
    out = [(rng.normal(size=(4, 6)).astype("float32"), rng.integers(0, 5, size=4)) for _ in range(STEPS)]
    if planted is not None:
        x, y = out[planted]
        out[planted] = (x * scale, y)
    return out


def _keras_trained(optimizer, batches, make_model=_model):
    model = make_model()
    model.compile(optimizer=optimizer, loss=LOSS, run_eagerly=True)
    for x, y in batches:
        model.train_on_batch(x, y)
    return model


def _pipeline(optimizer, k, nm, make_model=_model, **config):
    model = make_model()
    vw = VirtualWorker(model, ",".join(["cpu"] * k), num_in_flight=nm, optimizer=optimizer, loss=LOSS, timeout_s=60,
                       references=[(1.0, 1.0)] * k, **config)
    return model, vw


def _max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def _values(variables):
    return [v.numpy() for v in variables]


def _clipped():
    return keras.optimizers.Adam(0.05, global_clipnorm=0.3)


@pytest.mark.parametrize("k", [2, 3])
def test_global_clipnorm_at_nm1_equals_keras(k):
    want = _values(_keras_trained(_clipped(), _batches()).weights)
    unclipped = _values(_keras_trained(keras.optimizers.Adam(0.05), _batches()).weights)
    assert _max_difference(want, unclipped) > 1e-3  # the clip changes the training
    model, vw = _pipeline(_clipped(), k, 1)
    vw.train(iter(_batches()), STEPS)
    assert _max_difference(_values(model.weights), want) < 1e-6


def test_global_clipnorm_at_nm_k_clips_each_minibatch_on_every_stage_by_one_norm():
    k = 3
    model, vw = _pipeline(_clipped(), k, k, record_provenance=True)
    vw.train(iter(_batches()), STEPS)
    want = stale_sgd_run(_model(), _batches(), k, _clipped())[0]
    assert _max_difference(_values(model.trainable_variables), want) < 1e-6
    factors = [{p: t.numpy() for p, t in rt.applied_terms.items()} for rt in vw.runtimes]
    assert all(sorted(f) == list(range(1, STEPS + 1)) for f in factors)
    for p in range(1, STEPS + 1):
        assert len({float(f[p][0]) for f in factors}) == 1, [f[p] for f in factors]
    assert min(float(f[0]) for f in factors[0].values()) < 1.0  # some minibatches were clipped


def test_global_clipnorm_needs_a_schedule_that_waits_for_every_stage():
    with pytest.raises(ValueError, match="global clipping and loss scaling needs every stage's gradient .* "
                                         "schedule 'gpipe' cannot .* can: .*hetpipe"):
        RunConfig(num_in_flight=2, schedule="gpipe", optimizer=_clipped(), loss=LOSS)


# Loss scaling --------------------------------------------------------------------------------

def _loss_scaled():
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=2.0 ** 10,
                                               dynamic_growth_steps=2)


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy("float32")


def test_float16_overflow_on_one_stage_skips_the_minibatch_everywhere_as_keras_does(mixed_float16):
    planted = 2  # minibatch 3
    keras_optimizer = _loss_scaled()
    want = _keras_trained(keras_optimizer, _batches(planted))
    assert int(keras_optimizer.iterations) == STEPS - 1
    for k, nm in ((3, 1), (3, 3)):
        model, vw = _pipeline(_loss_scaled(), k, nm)
        vw.train(iter(_batches(planted)), STEPS)
        assert [rt.skipped for rt in vw.runtimes] == [{planted + 1}] * k
        assert [int(rt.optimizer.iterations) for rt in vw.runtimes] == [STEPS - 1] * k
        assert [float(rt.scale_state.scale) for rt in vw.runtimes[:1]] == [float(keras_optimizer.dynamic_scale)]
        assert float(vw.runtimes[-1].loss_scale) == float(keras_optimizer.dynamic_scale)
        if nm == 1:
            assert _max_difference(_values(model.weights), _values(want.weights)) < 1e-6


def test_a_loss_that_is_not_finite_still_fails_the_run_under_loss_scaling(mixed_float16):
    batches = _batches()
    batches[1] = (np.full_like(batches[1][0], np.nan), batches[1][1])
    _, vw = _pipeline(_loss_scaled(), 2, 2)
    with pytest.raises(PipelineError, match=r"minibatch 2: the loss is nan on stage 1 \(the last\)") as raised:
        vw.train(iter(batches), STEPS)
    cause = raised.value.__cause__
    assert isinstance(cause, NonFiniteError) and (cause.minibatch, cause.stage) == (2, 1)


# Tied weights ----------------------------------------------------------------------------------

def _gpt2_causal_lm():
    keras.utils.set_random_seed(8)
    return models.gpt2_causal_lm()


def _replicas_equal(vw):
    assert vw.ties, "the cut replicates no weight"
    for tie in vw.ties:
        values = [vw.runtimes[stage].trainable[position].numpy() for stage, position in tie.replicas]
        assert all(np.array_equal(v, values[0]) for v in values[1:]), tie.path


@pytest.mark.parametrize("nm", [1, 3])
def test_tied_embedding_across_stages_equals_keras(nm):
    data = gpt2_batches(5)
    model, vw = _pipeline(keras.optimizers.SGD(0.1), 3, nm, make_model=_gpt2_causal_lm)
    assert {stage for tie in vw.ties for stage, _ in tie.replicas} == {0, 2}
    vw.train(iter(data), len(data))
    if nm == 1:
        want = _values(_keras_trained(keras.optimizers.SGD(0.1), data, make_model=_gpt2_causal_lm).trainable_variables)
    else:
        want = stale_sgd_run(_gpt2_causal_lm(), data, nm, keras.optimizers.SGD(0.1))[0]
    assert _max_difference(_values(model.trainable_variables), want) < 1e-5
    _replicas_equal(vw)


def test_tied_embedding_under_wsp_is_pushed_once():
    """One worker: the global weights are the local ones exactly when each update reached the
    servers once (a replica pushed by both its stages would count the tied update twice)."""
    model = _gpt2_causal_lm()
    config = RunConfig(num_in_flight=2, staleness_bound=0, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=60)
    runner = WSPRunner(model, [WorkerSpec("cpu,cpu,cpu", references=((1.0, 1.0),) * 3)], config, ["/cpu:0"])
    runner.train([iter(gpt2_batches(6))], 6)
    vw, global_weights = runner.vws[0], runner.servers.values()
    _replicas_equal(vw)
    for tie in vw.ties:
        stage, position = tie.replicas[0]
        np.testing.assert_allclose(global_weights[tie.path], vw.runtimes[stage].trainable[position].numpy(),
                                   atol=1e-6)


def test_a_layer_with_state_called_in_two_stages_is_refused_naming_it():
    shared = keras.layers.BatchNormalization(name="shared_norm")
    i = keras.Input((6,))
    h = keras.layers.Dense(6, name="first")(shared(i))
    model = keras.Model(i, keras.layers.Dense(5, name="out")(shared(h)))
    with pytest.raises(SharedLayerError, match=r"'shared_norm/moving_mean' is non-trainable state of a layer called "
                                               r"in stages \[0, 1\]"):
        VirtualWorker(model, "cpu,cpu", boundaries=(0, 2), optimizer="sgd", loss=LOSS, references=[(1.0, 1.0)] * 2)
