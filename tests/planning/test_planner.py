import json
import subprocess
import sys

import pytest

from hetpipe_tf.planning.allocation import AllocationError, allocate, describe
from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from hetpipe_tf.planning.planner import PlanError, plan
from hetpipe_tf.planning.request import PlanRequest, PlanRequestError
from hetpipe_tf.planning.profile import SegmentTimes
from tests.helpers.profiles import model_profile


@pytest.mark.parametrize("policy,table3", [("np", "VVVV RRRR GGGG QQQQ"), ("ed", "VRGQ VRGQ VRGQ VRGQ"),
                                           ("hd", "VVQQ VVQQ RRGG RRGG")])
def test_policies_give_table_3(policy, table3):
    cluster = load_cluster("paper")
    assert describe(allocate(cluster, policy)) == table3
    p = plan(model_profile(), cluster, PlanRequest(policy=policy))
    assert p.allocation == table3
    d = p.to_dict()
    assert [sorted(w["device_types"]) for w in d["virtual_workers"]] == [sorted(w) for w in table3.split()]
    assert d["num_in_flight"] == p.num_in_flight >= 1 and d["predicted_images_per_s"] > 0
    for w in d["virtual_workers"]:
        layers = [s["layers"] for s in w["stages"]]
        assert layers[0][0] == 0 and layers[-1][1] == 11
        assert all(a[1] + 1 == b[0] for a, b in zip(layers, layers[1:]))  # contiguous ranges
        assert all(s["memory_bytes"]["total"] <= s["capacity_bytes"] for s in w["stages"])


def test_nm_is_the_smallest_max_m_and_within_two_percent_of_the_best():
    p = plan(model_profile(activation=900 * 2 ** 20), load_cluster("paper"), PlanRequest(policy="np"))
    max_m = [w.max_num_in_flight for w in p.workers]
    assert max(p.by_num_in_flight) == min(max_m) < max(max_m)  # NP: the small G node bounds Nm (§8.3)
    best = max(p.by_num_in_flight.values())
    assert p.minibatches_per_s >= 0.98 * best
    assert all(v < 0.98 * best for nm, v in p.by_num_in_flight.items() if nm < p.num_in_flight)


def test_forced_nm_beyond_max_m_says_what_fits():
    with pytest.raises(PlanError, match=r"Nm=16 does not fit: the workers admit at most .*so Nm <= \d+"):
        plan(model_profile(activation=900 * 2 ** 20), load_cluster("paper"), PlanRequest(policy="np", num_in_flight=16))


def test_model_too_big_for_a_worker_names_the_stage():
    with pytest.raises(PlanError, match=r"cannot train synthetic: .* needs .* but holds"):
        plan(model_profile(activation=40 * 2 ** 30), load_cluster("paper"), PlanRequest(policy="np"))


def test_host_pass_seconds_are_each_stage_s_task_cost_plus_its_segments():
    n = 12
    times = SegmentTimes(forward=tuple(0.001 * (i + 1) for i in range(n)), backward=tuple(0.002 * (i + 1) for i in range(n)),
                         forward_overhead=0.0003, backward_overhead=0.0005, source="test")
    p = plan(model_profile(activation=2 ** 20, weights=2 ** 20).with_times("host", times), load_cluster("local"),
             PlanRequest(policy="ed"))
    for w, worker in enumerate(p.workers):
        bounds = list(worker.partition.boundaries) + [n]
        assert p.host_pass_seconds(w) == tuple(
            pytest.approx((0.0003 + sum(times.forward[lo:hi]), 0.0005 + sum(times.backward[lo:hi])))
            for lo, hi in zip(bounds, bounds[1:]))
        assert sum(f + b for f, b in p.host_pass_seconds(w)) == pytest.approx(
            len(bounds[1:]) * 0.0008 + sum(times.forward) + sum(times.backward))
    analytic = plan(model_profile(), load_cluster("paper"), PlanRequest(policy="ed"))
    with pytest.raises(ValueError, match="has no times measured on this host"):
        analytic.host_pass_seconds(0)


@pytest.mark.slow
def test_auto_is_at_least_as_good_as_every_policy():
    cluster, profile = load_cluster("paper"), model_profile()
    auto = plan(profile, cluster, PlanRequest(policy="auto"))
    assert auto.policy.startswith("auto: ")
    for policy in ("np", "ed", "hd"):
        assert auto.minibatches_per_s >= plan(profile, cluster, PlanRequest(policy=policy)).minibatches_per_s - 1e-9


def test_local_placement_needs_equal_workers():
    cluster, profile = load_cluster("paper"), model_profile()
    ed_local = plan(profile, cluster, PlanRequest(policy="ed", placement="local"))
    ed_default = plan(profile, cluster,
                      PlanRequest(policy="ed", placement="default", num_in_flight=ed_local.num_in_flight))
    assert ed_local.minibatches_per_s >= ed_default.minibatches_per_s  # pushes stay inside nodes
    with pytest.raises(PlanError, match="local placement .* needs every virtual worker to hold the same"):
        plan(profile, cluster, PlanRequest(policy="np", placement="local"))


def test_bad_policy():
    with pytest.raises(PlanRequestError, match="unknown policy 'xx'; allowed: np, ed, hd, auto"):
        PlanRequest(policy="xx")
    spec = json.loads(json.dumps(PRESETS["paper"]))
    spec["nodes"][0]["count"] = 3
    with pytest.raises(AllocationError, match="ED: node 'node-R' has 4 devices, which do not split equally over 3"):
        allocate(load_cluster(spec), "ed")


def test_hetpipe_plan_command_prints_json_with_table_3():
    run = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "plan", "--cluster=paper", "--model=resnet50",
                          "--policy=hd", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads(run.stdout)
    assert d["allocation"] == "VVQQ VVQQ RRGG RRGG"
    assert [sorted(w["device_types"]) for w in d["virtual_workers"]] == [["Q", "Q", "V", "V"]] * 2 + [["G", "G", "R", "R"]] * 2
    assert d["predicted_images_per_s"] > 0 and any("analytic" in n for n in d["notes"])


def test_hetpipe_plan_refuses_what_this_host_cannot_measure():
    run = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "plan", "--cluster=local", "--model=gpt2_medium"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "--model=gpt2_medium can be planned for real GPUs (a cluster file or the paper preset), not for cluster " \
           "'local'" in run.stderr


@pytest.mark.slow  # builds the 406M-parameter model (about 10 s, 2.6 GB); the profile's path is tested on a tiny one
def test_hetpipe_plan_predicts_gpt2_medium_with_adamw_where_memory_limits_the_6_gb_cards():
    run = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "plan", "--cluster=paper",
                          "--model=gpt2_medium", "--batch_size=2", "--optimizer=adamw", "--policy=ed", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads(run.stdout)
    assert d["model"] == "gpt2_medium" and d["predicted_images_per_s"] > 0
    on_g = [st for w in d["virtual_workers"] for st in w["stages"] if st["device_type"] == "G"]
    assert on_g and all(0.75 * st["capacity_bytes"] < st["memory_bytes"]["total"] <= st["capacity_bytes"] for st in on_g)
    assert all(st["memory_bytes"]["optimizer slots"] == 2 * st["memory_bytes"]["weights and versions"] /
               (2 + d["num_in_flight"]) for st in on_g)  # AdamW's two slots; WSP's copy, Nm versions and the live one
