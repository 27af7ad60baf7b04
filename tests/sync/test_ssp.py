"""BSP, SSP and ASP behind the synchronisation seam (§2.2): WSP's instructions with a wave of one
minibatch, the simulated servers' gate, the bounds each keeps and the ones each refuses, and one
run with a process per virtual worker (the runs in one process are in tests/runtime/test_wsp_runner.py)."""
import json
import os
import subprocess
import sys

import pytest

from hetpipe_tf.pipeline.hetpipe import hetpipe_schedule
from hetpipe_tf.pipeline.instructions import Backward, Forward
from hetpipe_tf.pipeline.schedule import combinations, get_sync
from hetpipe_tf.pipeline.simulator import simulate_workers
from hetpipe_tf.sync.staleness import Bounds, StalenessViolation, check
from hetpipe_tf.sync.wsp import MERGED, MergePulled, PullWeights, PushUpdate


@pytest.mark.parametrize("sync", ["bsp", "ssp", "asp"])
def test_a_push_and_a_pull_after_every_minibatch_and_p_plus_nm_plus_1_waits_for_the_pull_of_p(sync):
    s = hetpipe_schedule(num_stages=2, steps=6, num_in_flight=2, sync=sync)
    for program in s.programs:
        ins = [i for stream in program.streams for task in stream for i in task.instructions]
        assert [(i.minibatch, i.wave) for i in ins if isinstance(i, PushUpdate)] == [(p, p - 1) for p in range(1, 7)]
        # minibatch 1 + Nm + c is the first stashed after the push of c + 1: pulls 0..3 gate 4..6
        assert [i.wave for i in ins if isinstance(i, PullWeights)] == [0, 1, 2, 3]
        assert [i.wave for i in ins if isinstance(i, MergePulled)] == [0, 1, 2, 3]
        assert [(i.minibatch, i.waits) for t in program.streams[0] for i in t.instructions
                if isinstance(i, Forward) and i.waits] == [(p, ((MERGED, p - 3),)) for p in range(3, 7)]
    assert {("hetpipe", name) for name in ("bsp", "ssp", "asp")} <= set(combinations())


def _run(sync, bound, speeds=(1.0, 4.0), nm=1, n=12, k=2):
    schedules = [hetpipe_schedule(k, n, nm, sync=sync) for _ in speeds]

    def duration(agent, ins):
        return {Forward: 1.0, Backward: 2.0}.get(type(ins), 0.0) * speeds[agent[0]]

    servers = get_sync(sync).simulation_model(bound, push_time=lambda a, i: 0.5, pull_time=lambda a, i: 0.5)
    return simulate_workers(schedules, duration, parameter_servers=servers)


def _pushed(result, minibatch):
    """When every stage of every worker had pushed `minibatch` (its arrival at the servers)."""
    return max(s.end + 0.5 for s in result.spans
               if isinstance(s.instruction, PushUpdate) and s.instruction.minibatch == minibatch)


@pytest.mark.parametrize("sync,s,nm", [("bsp", 0, 1), ("ssp", 1, 1), ("ssp", 3, 2)])
def test_simulated_minibatch_p_starts_after_every_worker_pushed_p_minus_nm_minus_s(sync, s, nm):
    result = _run(sync, s, nm=nm)
    fast = {sp.instruction.minibatch: sp.start for sp in result.spans
            if sp.stage == (0, 0) and isinstance(sp.instruction, Forward)}
    bounded = [p for p in fast if p - nm - s >= 1]
    assert bounded and all(fast[p] >= _pushed(result, p - nm - s) + 0.5 for p in bounded)
    # and the fast worker does run into it: one of its minibatches starts right when allowed
    assert any(fast[p] == pytest.approx(_pushed(result, p - nm - s) + 0.5) for p in bounded)


def test_simulated_asp_answers_every_pull_once_its_own_push_arrived_and_the_fast_worker_is_not_held_back():
    result = _run("asp", 0)
    # asked as the push leaves: its arrival (0.5) and the answer's transfer (0.5), no other worker's
    assert result.pulls and all(answered == pytest.approx(asked + 1.0) for _, _, _, asked, answered in result.pulls)
    ends = {w: max(sp.end for sp in result.spans if sp.stage[0] == w) for w in (0, 1)}
    assert ends[0] < ends[1] / 3  # 4x faster, it ends long before the slow one
    alone = _run("asp", 0, speeds=(1.0,))
    assert ends[0] == pytest.approx(max(sp.end for sp in alone.spans))  # as if it trained alone


@pytest.mark.parametrize("sync,bound,message", [
    ("bsp", 2, "BSP waits for every worker at every minibatch: its staleness bound is 0, so staleness_bound must "
               "be 0, got 2; give 0, or sync='ssp' for a bound of 2 minibatches"),
    ("asp", 1, r"ASP bounds no staleness \(its pulls never wait.* must be 0, got 1; give 0, or sync='ssp' for a bound "
               r"of 1 minibatches"),
    ("ssp", -1, "SSP's staleness bound s must be >= 0, got -1"),
])
def test_a_bound_a_scheme_cannot_keep_is_refused_naming_what_is_allowed(sync, bound, message):
    scheme = get_sync(sync)
    with pytest.raises(ValueError, match=message):
        scheme.bind(0, None, bound, 1.0)
    with pytest.raises(ValueError, match=message):
        scheme.simulation_model(bound, push_time=None, pull_time=None)


def test_per_minibatch_bounds_require_every_other_workers_minibatches_up_to_p_minus_nm_minus_s():
    b = Bounds(num_in_flight=2, staleness_bound=1, wave_size=1)
    assert (b.s_local, b.s_global) == (1, 2)  # missing at most the latest Nm - 1 + s = 2
    assert b.waves_required(3) == set() and b.waves_required(4) == {0} and b.waves_required(7) == {0, 1, 2, 3}
    assert Bounds(num_in_flight=2, staleness_bound=None, wave_size=1).waves_required(100) == set()
    ok = {(0, 4): ((1, 2), {(1, 0)}), (1, 3): ((1,), set())}
    assert check(ok, 2, 1, 2, sync="ssp") == 2
    with pytest.raises(StalenessViolation, match=r"broke the BSP bounds .* worker 0 minibatch 4: global updates "
                                                 r"\(worker, wave\) \[\(1, 1\)\] missing"):
        check(ok, 2, 0, 2, sync="bsp")
    # ASP requires nothing of the other workers, but still the pipeline's own local bound
    assert check({(0, 9): ((1, 2, 3, 4, 5, 6, 7), set())}, 2, 0, 2, sync="asp") == 1
    with pytest.raises(StalenessViolation, match=r"local updates \[7\] missing"):
        check({(0, 9): ((1, 2, 3, 4, 5, 6), set())}, 2, 0, 2, sync="asp")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAIN = """
import json, sys
import numpy as np, keras, tensorflow as tf
from hetpipe_tf import HetPipeStrategy

strategy = HetPipeStrategy(cluster="local", policy="ed", vw_size=2, num_in_flight=2, staleness_bound=1,
                           dilation=1.0, launch="processes", timeout_s=60, sync="ssp")
keras.utils.set_random_seed(3)
x = np.random.default_rng(0).normal(size=(128, 6)).astype("float32")
with strategy.scope():
    data = tf.data.Dataset.from_tensor_slices((x, np.full((128, 4), -1000.0, "float32"))).batch(8, drop_remainder=True)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="first"),
                              keras.layers.Dense(4, name="frozen", trainable=False)])
    # |y_pred + 1000| = y_pred + 1000: the gradients depend on the data only, not on the weights seen
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mean_absolute_error")
start = [v.numpy() for v in model.trainable_variables]
with tf.GradientTape() as tape:
    loss = tf.add_n([tf.reduce_mean(model(x[i:i + 8])) for i in range(0, 128, 8)])
grads = tape.gradient(loss, model.trainable_variables)
model.fit(data, epochs=1, verbose=0)
error = max(float(np.abs(v.numpy() - (w - 0.05 * g.numpy())).max())
            for v, w, g in zip(model.trainable_variables, start, grads))
print("RESULT " + json.dumps({"error": error, "clocks": list(strategy.runner.servers.clock.clocks()[0]),
                              "processes": type(strategy.runner).__name__}))
"""


@pytest.mark.slow
def test_ssp_with_a_process_per_virtual_worker_applies_every_minibatch_once_and_clocks_count_minibatches():
    # 16 minibatches, 8 per virtual worker, each in its own process attached to the chief's servers:
    # the global weights are the start minus lr times every minibatch's gradient, and the clocks
    # count minibatches (WSP's, waves of Nm = 2, would be 4).
    proc = subprocess.run([sys.executable, "-c", TRAIN], cwd=ROOT, capture_output=True, text=True, timeout=500)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["processes"] == "ProcessRunner" and result["clocks"] == [8, 8]
    assert result["error"] < 1e-5


def test_the_planner_gives_each_worker_its_own_pace_under_asp_and_the_slowest_one_under_bsp_and_ssp():
    from hetpipe_tf.planning.cluster import load_cluster
    from hetpipe_tf.planning.planner import plan, simulate_plan
    from hetpipe_tf.planning.request import PlanRequest
    from tests.helpers.profiles import model_profile

    plans = {sync: plan(model_profile(), load_cluster("paper"), PlanRequest(policy="np", num_in_flight=1, sync=sync))
             for sync in ("bsp", "ssp", "asp")}
    for sync in ("bsp", "ssp"):  # NP's workers differ (§8.1): every one at the slowest's pace
        assert len(set(plans[sync].per_worker)) == 1
    asp = plans["asp"]
    assert len(set(asp.per_worker)) == 4 and asp.minibatches_per_s == pytest.approx(sum(asp.per_worker))
    assert min(asp.per_worker) == pytest.approx(plans["bsp"].per_worker[0], rel=0.05)
    assert asp.minibatches_per_s > 1.2 * plans["bsp"].minibatches_per_s
    assert simulate_plan(asp, steps=40)["images_per_s"] > 1.2 * simulate_plan(plans["bsp"], steps=40)["images_per_s"]
