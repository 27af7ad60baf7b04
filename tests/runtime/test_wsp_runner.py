"""Several virtual workers under Wave Synchronous Parallel, in one process (§5).

The multi-process runs on TensorFlow's distributed runtime are in test_launch.py.
"""
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.runtime.wsp_runner import WorkerSpec, WSPRunner
from hetpipe_tf.sync import staleness
from tests.cli import test_models
from tests.pipeline.test_executor import LOSS, _batches


class AddBias(keras.layers.Layer):
    def build(self, input_shape):
        self.bias = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="bias")

    def call(self, x):
        return x + self.bias


def constant_gradient_model():
    """Every trainable weight's gradient depends on the data only (the Dense layer after the
    first is frozen), so SGD's result does not depend on which weights a minibatch saw."""
    keras.utils.set_random_seed(3)
    x = keras.Input((6,))
    h = keras.layers.Dense(5, name="first")(x)
    frozen = keras.layers.Dense(4, name="frozen", trainable=False)
    h = frozen(h)
    y = AddBias(name="bias")(h)
    return keras.Model(x, y)


def mean_output(y_true, y_pred):
    del y_true
    return tf.reduce_mean(y_pred)


def constant_gradients(model, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x))
    return {v.path: g.numpy() for v, g in zip(model.trainable_variables,
                                                tape.gradient(loss, model.trainable_variables))}


def exact_sgd_case(model, n, workers=2, lr=0.05):
    """n minibatches per worker, and the weights SGD must end with: w0 - lr * every gradient."""
    data = [[(np.random.default_rng(10 * w + i).normal(size=(4, 6)).astype("float32"), np.zeros(4, "int64"))
             for i in range(n)] for w in range(workers)]
    expected = {v.path: v.numpy().copy() for v in model.trainable_variables}
    for batches in data:
        for x, _ in batches:
            for p, g in constant_gradients(model, x).items():
                expected[p] -= lr * g
    return data, expected


def _runner(model, speeds, nm, d, **kw):
    workers, n = [], 0
    for s in speeds:
        k = len(s.split(","))
        workers.append(WorkerSpec(s, tuple(f"/device:CPU:{(n + j) % 4}" for j in range(k))))
        n += k
    return WSPRunner(model, workers, num_in_flight=nm, staleness_bound=d, ps_devices=["/device:CPU:0"],
                     optimizer=keras.optimizers.SGD(0.05), **dict({"timeout_s": 60}, **kw))


@pytest.mark.parametrize("speeds,d", [
    (("1,1", "0.5,0.5"), 0),
    (("1,1", "0.25,0.25", "0.5,1"), 1),
    (("1,1", "0.25,0.25"), 4),
])
def test_every_minibatch_of_every_worker_keeps_the_wsp_bounds(speeds, d):
    keras.utils.set_random_seed(0)
    model = test_models.mlp()
    nm, n = 3, 24
    runner = _runner(model, speeds, nm, d, loss=LOSS, record_provenance=True)
    runner.train([_batches(model, n, seed=i) for i in range(len(speeds))], n)
    for stage in range(2):
        checked = staleness.check(runner.provenance(stage), nm, d, len(speeds))
        assert checked == n * len(speeds)
    clocks, global_clock = runner.servers.clock.clocks()
    assert clocks == (n // nm,) * len(speeds) and global_clock == n // nm


def test_seed_001_example_d0_nm4():
    keras.utils.set_random_seed(0)
    model = test_models.mlp()
    runner = _runner(model, ("1,1", "0.5,0.5"), nm=4, d=0, loss=LOSS, record_provenance=True)
    runner.train([_batches(model, 16, seed=i) for i in range(2)], 16)
    records = runner.provenance(0)
    local, pushed = records[(0, 11)]
    assert set(local) == set(range(1, 8))  # the local updates of 5..7 ...
    assert {(1, 0)} <= set(pushed)  # ... and the other worker's global updates of 1..4
    local, pushed = records[(0, 12)]
    assert {(1, 0), (1, 1)} <= set(pushed)  # minibatch 12 waited for wave 1 of every worker
    staleness.check(records, 4, 0, 2)


@pytest.mark.parametrize("nm,n", [(3, 12), (3, 10), (2, 7)])
def test_global_weights_hold_every_update_of_every_worker_exactly_once(nm, n):
    # With data-only gradients the global result is w0 - lr * (sum of every worker's gradients),
    # whatever the staleness: a lost, or doubly applied, update shows. n % Nm != 0 checks that
    # the last, partial wave is pushed too.
    model = constant_gradient_model()
    frozen = model.get_layer("frozen").get_weights()
    data, expected = exact_sgd_case(model, n)
    runner = _runner(model, ("1,1", "0.5,0.5"), nm, d=1, loss=mean_output)
    runner.train(data, n)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)
    for got, want in zip(model.get_layer("frozen").get_weights(), frozen):
        np.testing.assert_array_equal(got, want)
    assert runner.servers.clock.clocks()[0] == (-(-n // nm),) * 2


def test_a_second_run_goes_on_where_the_first_ended():
    # As a second keras fit does: its waves follow the first run's at the servers, and the
    # global weights hold every update of both runs exactly once.
    model = constant_gradient_model()
    data, expected = exact_sgd_case(model, 12)
    runner = _runner(model, ("1,1", "0.5,0.5"), nm=3, d=0, loss=mean_output)
    runner.train([d[:7] for d in data], 7)
    assert runner.servers.clock.clocks() == ((3, 3), 3)
    runner.train([d[7:] for d in data], 5)
    assert runner.servers.clock.clocks() == ((5, 5), 5)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)


def test_a_failed_worker_ends_every_pull_and_the_next_run_starts_clean():
    model = constant_gradient_model()
    data, expected = exact_sgd_case(model, 6)

    def fail_at_4(minibatch):
        if minibatch == 4:
            raise RuntimeError("device lost")
        return 1.0

    runner = _runner(model, ("1,1", "1,1"), nm=2, d=0, loss=mean_output, timeout_s=120, dilation=1)
    runner.vws[1].slowdown = fail_at_4
    started = time.monotonic()
    with pytest.raises(Exception, match="device lost"):
        runner.train(data, 6)
    # Worker 0 waited in a pull for worker 1's wave: the abort ended it, not its 120 s timeout.
    assert time.monotonic() - started < 60
    deadline = time.monotonic() + 10
    while _pipeline_threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pipeline_threads()
    assert runner.aborted.startswith("virtual worker 1 failed")
    failed = runner.servers
    with pytest.raises(tf.errors.AbortedError, match="virtual worker 1 failed"):
        failed.clock.wait(0, timeout=60)
    # The next run gets new servers, holding the Keras model's weights.
    runner.vws[1].slowdown = None
    runner.train(data, 6)
    assert runner.servers is not failed and runner.servers.clock.clocks() == ((3, 3), 3)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)


def test_a_worker_that_ends_its_run_early_no_longer_holds_the_others_back():
    # Worker 1 ends after 9 minibatches (stopped, or a shorter share of the data); worker 0's
    # minibatch 16 needs every worker's wave 6 (D = 0, Nm = 2), which worker 1 never pushes:
    # the end of its run retires it at the clock, so worker 0 goes on instead of waiting.
    model = constant_gradient_model()
    data, _ = exact_sgd_case(model, 16)
    _, expected = exact_sgd_case(model, 0)  # the start, then every update applied exactly once:
    for x, _ in data[0] + data[1][:9]:
        for path, g in constant_gradients(model, x).items():
            expected[path] -= 0.05 * g
    servers = _runner(model, ("1,1", "1,1"), nm=2, d=0, loss=mean_output).servers
    workers = [WSPRunner(model, [WorkerSpec("1,1", (f"/device:CPU:{2 * w}", f"/device:CPU:{2 * w + 1}"))],
                         num_in_flight=2, staleness_bound=0, ps_devices=["/device:CPU:0"],
                         optimizer=keras.optimizers.SGD(0.05), loss=mean_output, timeout_s=60, dilation=1,
                         servers=servers, worker_ids=[w]) for w in (0, 1)]
    short = threading.Thread(target=lambda: workers[1].train([data[1][:9]], 9))
    started = time.monotonic()
    short.start()
    workers[0].train([data[0]], 16)
    short.join()
    assert time.monotonic() - started < 30  # not the pull's 60 s timeout
    assert servers.clock.clocks() == ((8, 5), 5)  # worker 1 pushed its partial wave 4; both retired now
    servers.write_to(model)
    for v in model.trainable_variables:  # nothing of the shorter run lost, nothing applied twice
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)


def _pipeline_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("hetpipe-")]


def test_stats_and_trace_show_every_worker():
    keras.utils.set_random_seed(0)
    model = test_models.mlp()
    runner = _runner(model, ("1,1", "0.5,0.5"), nm=2, d=0, loss=LOSS)
    runner.train([_batches(model, 8, seed=i) for i in range(2)], 8, trace=True)
    stats = runner.stats()
    assert [s["worker"] for s in stats] == [0, 1]
    assert all(s["clock"] == 4 and s["clock_distance"] == 0 for s in stats)
    events = runner.trace.events()
    for cat in ("PushUpdate", "PullWeights", "MergePulled", "PullWait"):
        assert {e["pid"] for e in events if e.get("cat") == cat} == {0, 1}, cat


def test_bad_arguments_are_named():
    model = test_models.mlp()
    with pytest.raises(ValueError, match="staleness bound D must be >= 0, got -1"):
        _runner(model, ("1,1",), nm=2, d=-1, loss=LOSS)
    runner = _runner(model, ("1,1", "1,1"), nm=2, d=0, loss=LOSS)
    with pytest.raises(ValueError, match="2 workers but data for 1"):
        runner.train([_batches(model, 4)], 4)
