import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.planning.uneven import push_weights
from hetpipe_tf.runtime.worker_data import worker_shards
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.wsp_runner import WSPRunner
from hetpipe_tf.sync.parameter_server import ParameterServers, layer_of
from tests.helpers import models

SERVERS = ["/device:CPU:0", "/device:CPU:1"]


def _layers(model):
    return [layer_of(v.path) for v in model.trainable_variables]


def test_default_placement_puts_layers_round_robin_on_the_servers():
    model = models.mlp()
    ps = ParameterServers(model, SERVERS, [2])
    layers = list(dict.fromkeys(_layers(model)))
    assert layers == [f"mlp/{layer.name}" for layer in model.layers]  # a layer, not the model
    for v in model.trainable_variables:
        want = SERVERS[layers.index(layer_of(v.path)) % 2]
        assert ps.device_of[v.path] == want
        assert tf.DeviceSpec.from_string(ps.variables[v.path].device).device_index == int(want[-1])
        np.testing.assert_array_equal(ps.variables[v.path].numpy(), v.numpy())


def test_local_placement_follows_the_layer_map_and_names_a_missing_layer():
    model = models.mlp()
    layers = list(dict.fromkeys(_layers(model)))
    ps = ParameterServers(model, SERVERS, [1], "local", {name: SERVERS[1] for name in layers})
    assert set(ps.device_of.values()) == {SERVERS[1]}
    with pytest.raises(ValueError, match=f"local placement needs the server of layer '{layers[-1]}'"):
        ParameterServers(model, SERVERS, [1], "local", {name: SERVERS[0] for name in layers[:-1]})
    with pytest.raises(ValueError, match="unknown parameter placement 'nearest'; allowed: default, local"):
        ParameterServers(model, SERVERS, [1], "nearest")
    with pytest.raises(ValueError, match="at least one parameter-server device"):
        ParameterServers(model, [], [1])


def test_push_adds_the_update_and_pull_waits_for_the_wave():
    model = models.mlp()
    ps = ParameterServers(model, SERVERS, [1, 1])
    paths = [v.path for v in model.trainable_variables]
    before = ps.values()
    ones = [tf.ones_like(before[p]) for p in paths]
    ps.push(0, 0, 0, paths, ones)
    with pytest.raises(tf.errors.DeadlineExceededError, match="behind: virtual worker 1: stage 0"):
        ps.pull(paths, 0, timeout=0.3)
    ps.push(1, 0, 0, paths, ones)
    values, clocks = ps.pull(paths, 0, timeout=5)
    assert clocks == (1, 1)
    for p, got in zip(paths, values):
        np.testing.assert_allclose(got.numpy(), before[p].numpy() + 2, atol=1e-6)
    ps.write_to(model)
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), before[paths[0]].numpy() + 2, atol=1e-6)


def test_batchnorm_statistics_are_kept_but_not_integer_state():
    model = models.cnn()  # BatchNorm, and Dropout's integer seed state
    ps = ParameterServers(model, SERVERS, [1])
    state = {v.path for v in model.non_trainable_variables}
    kept = state & set(ps.variables)
    assert {p.rsplit("/", 1)[1] for p in kept} == {"moving_mean", "moving_variance"}
    assert all(p in ps.variables for p in (v.path for v in model.trainable_variables))


def test_weighted_pushes_apply_each_update_once_scaled_by_its_workers_weight():
    # Uneven minibatches (issue 14 item 4): w_global += a_i * u, each push once; a process that
    # attaches to the run reads the same weights from the first server.
    model = models.mlp()
    ps = ParameterServers(model, SERVERS, [1, 1], push_weights=push_weights((32, 16)))
    assert ps.push_weights == pytest.approx((4 / 3, 2 / 3))
    attached = ParameterServers(model, SERVERS, [1, 1], run=ps.run, variable_devices=ps.variable_devices())
    assert attached.push_weights == ps.push_weights
    paths = [v.path for v in model.trainable_variables]
    before = ps.values()
    ps.push(0, 0, 0, paths, [tf.ones_like(before[p]) for p in paths])
    attached.push(1, 0, 0, paths, [3 * tf.ones_like(before[p]) for p in paths])
    values, clocks = ps.pull(paths, 0, timeout=5)
    assert clocks == (1, 1)
    for p, got in zip(paths, values):
        np.testing.assert_allclose(got.numpy(), before[p].numpy() + 4 / 3 + 3 * 2 / 3, atol=1e-6)
    with pytest.raises(ValueError, match=r"push_weights must be one positive weight per virtual worker \(2\), got "
                                         r"\[1.0\]: give n \* b_i / B"):
        ParameterServers(model, SERVERS, [1, 1], push_weights=[1.0])


def _dense_model():
    keras.utils.set_random_seed(5)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(x)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def test_uneven_minibatches_with_weighted_pushes_equal_sgd_on_the_concatenated_batch():
    # D = 0, Nm = 1, two workers of 6 and 2 samples (two stages each): every round's global step
    # is SGD's on the round's 8 samples (mean loss) at rate n * lr, n = 2 (see the module docstring
    # of hetpipe_tf.sync.parameter_server), which even sizes give with every weight 1.
    lr, sizes, rounds = 0.1, (6, 2), 5
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rounds * 8, 6)).astype("float32")
    y = rng.normal(size=(rounds * 8, 3)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True)
    loss = keras.losses.MeanSquaredError()
    model = _dense_model()
    reference, unweighted = ([v.numpy().copy() for v in model.trainable_variables] for _ in range(2))
    twin = _dense_model()
    for r in range(rounds):
        xs, ys = x[8 * r:8 * r + 8], y[8 * r:8 * r + 8]
        for v, w in zip(twin.trainable_variables, reference):
            v.assign(w)
        with tf.GradientTape() as tape:
            mean = loss(ys, twin(xs))
        for w, g in zip(reference, tape.gradient(mean, twin.trainable_variables)):
            w -= len(sizes) * lr * g.numpy()
        # What unweighted pushes would do: each worker's mean-loss gradient counted alike.
        for v, w in zip(twin.trainable_variables, unweighted):
            v.assign(w)
        with tf.GradientTape(persistent=True) as tape:
            parts = [loss(ys[:6], twin(xs[:6])), loss(ys[6:], twin(xs[6:]))]
        for part in parts:
            for w, g in zip(unweighted, tape.gradient(part, twin.trainable_variables)):
                w -= lr * g.numpy()
    runner = WSPRunner(model, [WorkerSpec("1,1", ("/device:CPU:0", "/device:CPU:1")),
                               WorkerSpec("1,1", ("/device:CPU:2", "/device:CPU:3"))],
                       RunConfig(num_in_flight=1, staleness_bound=0, optimizer=keras.optimizers.SGD(lr), loss=loss,
                                 dilation=1, timeout_s=60, minibatch_sizes=sizes), SERVERS)
    runner.train(worker_shards(data, 2, sizes), rounds)
    assert runner.servers.clock.clocks() == ((rounds, rounds), rounds)
    for v, want in zip(model.trainable_variables, reference):
        np.testing.assert_allclose(v.numpy(), want, atol=1e-6, err_msg=v.path)
    assert max(np.abs(v.numpy() - w).max() for v, w in zip(model.trainable_variables, unweighted)) > 1e-3
