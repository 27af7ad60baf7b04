"""`auto` (issue 29): the policies' allocations, more sizes, mixes of compositions, cut off by bounds."""
import json
import random

import pytest

from hetpipe_tf.pipeline.schedule import NO_SYNC, get_sync
from hetpipe_tf.planning import planner
from hetpipe_tf.planning.allocation import (AllocationError, allocate, compositions, describe, mixed_allocations,
                                            pack_workers)
from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from hetpipe_tf.planning.cost_model import CostModel, link_flows
from hetpipe_tf.planning.planner import PlanError, pace_bounds, plan, predict
from hetpipe_tf.planning.request import PlanRequest, PlanRequestError
from hetpipe_tf.sync.wsp import WSP_SCHEME
from tests.helpers.profiles import random_cluster, random_profile
from tests.helpers.profiles import model_profile


def small():
    """A model of 6 segments on the paper cluster, Nm <= 4: auto's whole search in about a second."""
    return load_cluster("paper"), model_profile(n=6), {"max_num_in_flight": 4}


def test_auto_beats_or_equals_every_policy_and_shows_them_beside_its_choice():
    cluster, profile, few = small()
    auto = plan(profile, cluster, PlanRequest(policy="auto", **few))
    assert auto.policy.startswith("auto: ")
    beside = {a.policy: a for a in auto.alternatives}
    for policy in ("np", "ed", "hd"):
        alone = plan(profile, cluster, PlanRequest(policy=policy, placement="default", **few))  # as auto plans it
        assert auto.minibatches_per_s >= alone.minibatches_per_s - 1e-9
        if describe(allocate(cluster, policy)) != auto.allocation:  # the others are printed beside it
            assert beside[policy.upper()].images_per_s == pytest.approx(alone.images_per_s)
            assert beside[policy.upper()].allocation == alone.allocation
    assert any(n.startswith("auto: ") and "cut off by their bound" in n for n in auto.notes)
    d = auto.to_dict()
    assert {a["policy"] for a in d["alternatives"]} >= {"NP", "ED", "HD"} - {auto.policy[6:]}
    assert "beside it (auto):" in auto.format()


def test_a_time_budget_returns_the_best_so_far_and_says_what_it_left_out():
    cluster, profile, few = small()
    quick = plan(profile, cluster, PlanRequest(policy="auto", time_budget_s=1e-6, **few))
    best_policy = max(plan(profile, cluster, PlanRequest(policy=p, **few)).minibatches_per_s
                      for p in ("np", "ed", "hd"))
    assert quick.minibatches_per_s == pytest.approx(best_policy)  # the policies' own are always planned
    assert "not tried within the time budget" in quick.notes[-1]
    with pytest.raises(PlanRequestError, match="time_budget_s bounds the search of policy 'auto'.*got 5 with policy 'hd'"):
        PlanRequest(policy="hd", time_budget_s=5)
    with pytest.raises(PlanRequestError, match="time_budget_s .* got 0"):
        PlanRequest(policy="auto", time_budget_s=0)


def test_mixes_take_the_most_workers_at_least_as_fast_as_each_rate():
    cluster = load_cluster("paper")  # 4 V, 4 R, 4 G, 4 Q
    rates = {(("V", 2),): 1.0, (("G", 2), ("R", 2)): 1.0, (("Q", 4),): 0.5, (("R", 1),): 0.1}
    mixes = mixed_allocations(cluster, rates, limit=2)
    label, workers = mixes[0]  # at rate 1: 2 x VV and 2 x GGRR (4 workers, worth 4)
    assert sorted(describe([w]) for w in workers) == ["GGRR", "GGRR", "VV", "VV"]
    assert label == "MIX(2xGGRR, 2xVV)"
    assert all(len({d.node for d in w if d.type.name == t}) <= 1 for w in workers for t in "VRG")  # one node each
    devices = [d for w in workers for d in w]
    assert len(devices) == len(set(devices))
    assert len(mixes) == 2 and len(mixes[1][1]) == 5  # at 0.5: one QQQQ more (worth 2.5 < 4)


def test_compositions_are_one_or_two_types_of_powers_of_two_a_node_holds():
    comps = compositions(load_cluster("paper"), max_size=6)  # nodes of 4: a worker of at most 4
    assert (("V", 4),) in comps and (("V", 8),) not in comps and (("G", 2), ("V", 2)) in comps
    assert (("G", 2), ("V", 4)) not in comps and all(len(c) <= 2 and sum(n for _, n in c) <= 4 for c in comps)
    assert all(n in (1, 2, 4) for c in comps for _, n in c)
    assert len(compositions(load_cluster("paper"), max_size=2)) == 4 * 2 + 6  # 1 or 2 of a type, or 1 + 1
    (worker,) = pack_workers(load_cluster("paper"), {(("Q", 2), ("V", 1)): 1})
    assert sorted(d.type.name for d in worker) == ["Q", "Q", "V"]


@pytest.mark.parametrize("seed", range(30))
def test_pace_bounds_are_above_every_prediction(seed):
    rng = random.Random(seed)
    cluster, profile = random_cluster(rng), random_profile(rng)
    profile = profile.with_costs(instruction_seconds=rng.choice([0.0, 1e-3, 5e-3]))
    policy = rng.choice(["np", "ed", "hd"])
    try:
        workers = allocate(cluster, policy)
    except AllocationError:
        return
    sync = get_sync(rng.choice(["wsp", "ssp", "asp"])) if len(workers) > 1 else NO_SYNC
    bound = rng.choice([0, 1, 3]) if sync.name in ("wsp", "ssp") else 0  # ASP keeps no bound
    placement = rng.choice(["default", "local"]) if policy == "ed" else "default"
    model = CostModel(profile, cluster, link_flows=link_flows(workers), sync=sync)
    solved = planner._Solved("dp", 6)
    most = min(solved.max_m(model, w) for w in workers)
    for nm in range(1, most + 1):
        parts = solved.partitions(model, workers, nm)
        total, per = predict(model, parts, nm, bound, placement)
        paces = pace_bounds(model, parts, nm, bound, placement)
        assert total <= sum(planner.long_run_pace(sync, paces)) * (1 + 1e-9)


def test_an_allocation_that_cannot_beat_the_best_is_not_simulated(monkeypatch):
    cluster, profile, _ = small()
    settings = planner._Settings(profile, cluster, planner.LinkModel(), 1.0, 1, None, planner.HETPIPE,
                                 WSP_SCHEME, "default", 0, None, None)
    group = allocate(cluster, "np")
    full = settings.plan(group, "np", planner._Solved("dp", 4), [])
    simulated = []
    real = planner.predict
    monkeypatch.setattr(planner, "predict", lambda *a, **k: simulated.append(a[2]) or real(*a, **k))
    assert settings.plan(group, "np", planner._Solved("dp", 4), [], floor=10 * full.minibatches_per_s) is None
    assert simulated == []
    floored = settings.plan(group, "np", planner._Solved("dp", 4), [], floor=0.5 * full.minibatches_per_s)
    assert (floored.num_in_flight, floored.minibatches_per_s) == (full.num_in_flight, full.minibatches_per_s)
    assert set(floored.by_num_in_flight) <= set(full.by_num_in_flight)


def test_auto_on_a_cluster_of_two_node_sizes_and_three_types():
    spec = json.loads(json.dumps(PRESETS["paper"]))
    spec["nodes"] = [{"name": "a", "device_type": "V", "count": 2}, {"name": "b", "device_type": "R", "count": 4},
                     {"name": "c", "device_type": "Q", "count": 2}, {"name": "d", "device_type": "V", "count": 2}]
    cluster, profile, few = load_cluster(spec), model_profile(n=6), {"max_num_in_flight": 4}
    auto = plan(profile, cluster, PlanRequest(policy="auto", **few))
    with pytest.raises(PlanError, match="HD: no grouping of the nodes"):
        plan(profile, cluster, PlanRequest(policy="hd", **few))
    best = max((plan(profile, cluster, PlanRequest(policy=p, **few)) for p in ("np", "ed")),
               key=lambda p: p.minibatches_per_s)
    assert auto.minibatches_per_s >= best.minibatches_per_s - 1e-9
    used = [d for w in auto.workers for d in w.devices]
    assert len(used) == len(set(used)) and set(used) <= set(cluster.devices())
