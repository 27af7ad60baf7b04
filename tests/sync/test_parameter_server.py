import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.sync.parameter_server import ParameterServers, layer_of
from tests.cli import test_models

SERVERS = ["/device:CPU:0", "/device:CPU:1"]


def _layers(model):
    return [layer_of(v.path) for v in model.trainable_variables]


def test_default_placement_puts_layers_round_robin_on_the_servers():
    model = test_models.mlp()
    ps = ParameterServers(model, SERVERS, [2])
    layers = list(dict.fromkeys(_layers(model)))
    assert layers == [f"mlp/{layer.name}" for layer in model.layers]  # a layer, not the model
    for v in model.trainable_variables:
        want = SERVERS[layers.index(layer_of(v.path)) % 2]
        assert ps.device_of[v.path] == want
        assert tf.DeviceSpec.from_string(ps.variables[v.path].device).device_index == int(want[-1])
        np.testing.assert_array_equal(ps.variables[v.path].numpy(), v.numpy())


def test_local_placement_follows_the_layer_map_and_names_a_missing_layer():
    model = test_models.mlp()
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
    model = test_models.mlp()
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
    model = test_models.cnn()  # BatchNorm, and Dropout's integer seed state
    ps = ParameterServers(model, SERVERS, [1])
    state = {v.path for v in model.non_trainable_variables}
    kept = state & set(ps.variables)
    assert {p.rsplit("/", 1)[1] for p in kept} == {"moving_mean", "moving_variance"}
    assert all(p in ps.variables for p in (v.path for v in model.trainable_variables))
