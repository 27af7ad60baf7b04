"""Pipe-SGD behind the synchronisation seam (seed 002, Algorithm 1): the schedule's waits, the
weights every minibatch computed its gradient at (Algorithm 1 recomputed by hand from the same
gradients), the timing model in the simulator, and the errors for what it cannot do."""
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.pipeline.hetpipe import hetpipe_schedule
from hetpipe_tf.pipeline.instructions import ApplyUpdate, Backward, Forward
from hetpipe_tf.pipeline.schedule import check_combination, get_sync
from hetpipe_tf.pipeline.simulator import simulate_workers
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.wsp_runner import WSPRunner
from hetpipe_tf.sync.parameter_server import ParameterServers
from hetpipe_tf.sync.pipe_sgd import (MERGED_AGGREGATE, AllReduceModel, ContributeUpdate, MergeAggregate, PipeSGD,
                                      iteration_seconds, ring_allreduce_seconds, scaling_efficiency)
from tests.helpers import models
from tests.helpers.data import random_batches
from tests.helpers.models import LOSS

LR = 0.05


def test_minibatch_t_waits_for_the_merge_of_the_aggregate_of_t_minus_k_plus_1():
    for k, nm in [(0, 1), (1, 1), (1, 3), (3, 1)]:
        s = hetpipe_schedule(num_stages=2, steps=6, num_in_flight=nm, sync=PipeSGD(staleness=k))
        for program in s.programs:
            tasks = [t for stream in program.streams for t in stream]
            waits = {i.minibatch: i.waits for t in tasks for i in t.instructions if isinstance(i, Forward)}
            assert waits == {t: ((MERGED_AGGREGATE, t - k - 1),) if t - k - 1 >= 1 else () for t in range(1, 7)}
            ins = [i for t in tasks for i in t.instructions]
            assert [i.minibatch for i in ins if isinstance(i, ContributeUpdate)] == list(range(1, 7))
            assert [i.minibatch for i in ins if isinstance(i, MergeAggregate)] == list(range(1, 7))  # all T merged
            # k > Nm: merge j waits until this stage contributed j + k - Nm (version j + k is stashed then)
            assert [i.after for i in ins if isinstance(i, MergeAggregate)] == [
                j + k - nm if k > nm and j + k - nm <= 6 else 0 for j in range(1, 7)]


def _workers(stages):
    return [WorkerSpec(",".join(["cpu"] * stages), tuple(f"/device:CPU:{w * stages + s}" for s in range(stages)))
            for w in range(2)]


def _algorithm_1(model, data, k):
    """Algorithm 1 by hand: w[t] = w[0] + Σ_{j <= t-(k+1)} A_j, where A_j = -lr·Σ_workers g_w[j] and
    g_w[j] is worker w's gradient of minibatch j at w[j]; the run ends with every aggregate in."""
    w0 = [v.numpy().copy() for v in model.trainable_variables]
    ref = keras.models.clone_model(model)
    aggregates = []
    for t in range(1, len(data[0]) + 1):
        w_t = [a + sum(agg[i] for agg in aggregates[:max(t - k - 1, 0)]) for i, a in enumerate(w0)]
        for v, value in zip(ref.trainable_variables, w_t):
            v.assign(value)
        total = [np.zeros_like(a) for a in w0]
        for batches in data:
            x, y = batches[t - 1]
            with tf.GradientTape() as tape:
                loss = LOSS(y, ref(x))
            total = [s + g.numpy() for s, g in zip(total, tape.gradient(loss, ref.trainable_variables))]
        aggregates.append([-LR * g for g in total])
    return [a + sum(agg[i] for agg in aggregates) for i, a in enumerate(w0)]


@pytest.mark.parametrize("k,nm,stages", [(0, 1, 1), (1, 2, 2), (2, 1, 1)])
def test_the_weights_are_those_of_algorithm_1_and_k_0_is_synchronous_all_reduce_sgd(k, nm, stages):
    keras.utils.set_random_seed(1)
    model = models.mlp()
    data = [random_batches(model, 6, seed=w) for w in range(2)]
    want = _algorithm_1(model, data, k)
    config = RunConfig(num_in_flight=nm, staleness_bound=0, optimizer=keras.optimizers.SGD(LR), loss=LOSS,
                       timeout_s=60, sync=PipeSGD(staleness=k), record_provenance=True)
    runner = WSPRunner(model, _workers(stages), config, ["/device:CPU:0"])
    runner.train([iter(d) for d in data], 6)
    for v, expected in zip(model.trainable_variables, want):  # the servers mirror worker 0's replica
        np.testing.assert_allclose(v.numpy(), expected, atol=1e-6, err_msg=v.path)
    final = {v.path: v.numpy() for v in model.trainable_variables}
    for vw in runner.vws:  # and every replica is that one
        for rt in vw.runtimes:
            for v, got in zip(rt.stage.trainable_variables, rt.trainable):
                np.testing.assert_allclose(got.numpy(), final[v.path], atol=1e-6)
    # the update applied at iteration t is the aggregate of t - (k + 1): minibatch t's weights on every
    # stage held exactly the aggregates of 1 .. t-(k+1), of both workers
    for stage in range(stages):
        for (w, t), (_, merged) in runner.provenance(stage).items():
            assert merged == {(v, j) for v in (0, 1) for j in range(1, t - k)}, (stage, w, t)


def test_the_simulated_iteration_time_is_the_seeds_max_of_compute_and_communicate():
    """Seed 002: l_total = T·max(l_up + l_comp, l_comm) for k >= 1; k = 0 overlaps nothing."""
    forward, backward, update = 1.0, 2.0, 0.5

    def duration(agent, ins):
        return {Forward: forward, Backward: backward, MergeAggregate: update}.get(type(ins), 0.0)

    for k, communicate in [(1, 2.0), (1, 6.0), (0, 2.0)]:
        steps = 40
        schedules = [hetpipe_schedule(1, steps, 1, sync=PipeSGD(staleness=k)) for _ in range(2)]
        result = simulate_workers(schedules, duration, parameter_servers=AllReduceModel(lambda a, i, p: communicate))
        done = result.completion_times((0, 0), MergeAggregate)
        period = (done[30] - done[10]) / 20  # the steady state, away from the start and the final merges
        assert period == pytest.approx(iteration_seconds(update, forward + backward, communicate, staleness=k))
    assert iteration_seconds(0.5, 3.0, 2.0) == 3.5 and iteration_seconds(0.5, 3.0, 6.0) == 6.0
    # scaling efficiency: linear speed-up once compute bound, (l_up + l_comp) / l_comm when not
    assert scaling_efficiency(0.5, 3.0, 2.0) == 1.0 and scaling_efficiency(0.5, 3.0, 7.0) == 0.5


def test_the_ring_all_reduce_time_is_the_seeds_formula():
    # 2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ + S for p = 4, n = 1000
    assert ring_allreduce_seconds(4, 1000, 0.01, 1e-3, 1e-4, 0.2) == pytest.approx(
        6 * 0.01 + 1.5 * 1000 * 1e-3 + 0.75 * 1000 * 1e-4 + 0.2)
    assert ring_allreduce_seconds(1, 1000, 0.01, 1e-3) == 0.0


def test_the_planners_model_charges_each_links_share_of_the_compressed_bytes():
    # ring all-reduce: 2(p-1)/p of the (compressed) bytes; quant8's ring all-gather: (p-1) payloads of a quarter
    for compression, share in [("none", 1.5), ("truncate16", 0.75), ("quant8", 0.75)]:
        model = PipeSGD(compression=compression).simulation_model(0, push_time=lambda a, i: 8.0, pull_time=None)
        agents = [(w, 0) for w in range(4)]
        for w, time in zip(range(4), (1.0, 3.0, 2.0, 0.5)):
            model.receive((w, 0), ("allreduce", 1), ContributeUpdate(1), time)
            if w < 3:
                assert model.answers(agents) == []  # every worker's contribution is needed
        assert {a: t for a, _, _, t in model.answers(agents)} == {a: 3.0 + share * 8.0 for a in agents}
        assert model.answers(agents) == []  # once
    assert PipeSGD(compression="quant8").compression.link_share(2) == PipeSGD().compression.link_share(2) / 4


@pytest.mark.parametrize("make,message", [
    (lambda: PipeSGD(staleness=-1), r"staleness k must be an integer >= 0, got -1; Pipe-SGD's optimum is k = 1"),
    (lambda: PipeSGD(staleness=1.5), r"staleness k must be an integer >= 0, got 1.5"),
    (lambda: PipeSGD(compression="zip"), r"unknown compression 'zip'; Pipe-SGD's are: none, truncate16, quant8"),
    (lambda: check_combination("gpipe", "pipe-sgd"),
     r"the synchronisation scheme 'pipe-sgd' does not work with the schedule 'gpipe'; the combinations that exist"),
    (lambda: get_sync("pipe-sgd").checked_bound(2),
     r"no parameter-server staleness bound: staleness_bound must be 0, got 2; its gradient staleness is k"),
])
def test_what_pipe_sgd_cannot_do_is_refused_naming_what_is_allowed(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_registered_scheme_is_the_seeds_default():
    scheme = get_sync("pipe-sgd")
    assert (scheme.staleness, scheme.compression.name) == (1, "none")
    assert check_combination("hetpipe", "pipe-sgd")[1] is scheme
    assert ApplyUpdate not in scheme.apply_like


def test_uneven_minibatches_are_refused_since_algorithm_1_sums_every_update_as_it_is():
    servers = ParameterServers(models.mlp(), ["/device:CPU:0"], [1, 1], push_weights=(1.5, 0.5))
    with pytest.raises(ValueError, match=r"weights the workers' pushes by their minibatch sizes \(\[1.5, 0.5\]\): "
                                         r"uneven minibatches are for the parameter-server schemes"):
        PipeSGD().bind(0, servers, 0, 5.0)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAIN = """
import json
import numpy as np, keras, tensorflow as tf
from hetpipe_tf import HetPipeStrategy, PipeSGD

K, LR = 1, 0.1
strategy = HetPipeStrategy(cluster="local", policy="ed", vw_size=2, num_in_flight=2, dilation=1.0,
                           launch="processes", timeout_s=60, sync=PipeSGD(staleness=K))
keras.utils.set_random_seed(3)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(128, 6)).astype("float32"), rng.integers(0, 4, size=128)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
with strategy.scope():
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
# Algorithm 1 by hand; worker i of 2 trains minibatches i, i + 2, ... (the even split)
ref = keras.models.clone_model(model)
w0 = [v.numpy() for v in model.trainable_variables]
aggregates = []
for t in range(1, 9):
    for i, v in enumerate(ref.trainable_variables):
        v.assign(w0[i] + sum((agg[i] for agg in aggregates[:max(t - K - 1, 0)]), np.zeros_like(w0[i])))
    total = [np.zeros_like(a) for a in w0]
    for w in range(2):
        b = 2 * (t - 1) + w
        with tf.GradientTape() as tape:
            value = loss(y[8 * b:8 * b + 8], ref(x[8 * b:8 * b + 8]))
        total = [s + g.numpy() for s, g in zip(total, tape.gradient(value, ref.trainable_variables))]
    aggregates.append([-LR * g for g in total])
want = [a + sum(agg[i] for agg in aggregates) for i, a in enumerate(w0)]
model.fit(data, epochs=1, verbose=0)
error = max(float(np.abs(v.numpy() - e).max()) for v, e in zip(model.trainable_variables, want))
moved = max(float(np.abs(e - a).max()) for e, a in zip(want, w0))
print("RESULT " + json.dumps({"error": error, "moved": moved, "processes": type(strategy.runner).__name__}))
"""


@pytest.mark.slow
def test_with_a_process_per_virtual_worker_the_weights_are_those_of_algorithm_1():
    # 16 minibatches, 8 per virtual worker of 2 stages, each worker in its own process, k = 1
    proc = subprocess.run([sys.executable, "-c", TRAIN], cwd=ROOT, capture_output=True, text=True, timeout=500)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["processes"] == "ProcessRunner"
    assert result["error"] < 1e-5 and result["moved"] > 1e-2
