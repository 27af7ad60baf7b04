"""The planner's faster searches choose what trying every case one by one chose (issue 29).

Each reference is the search as it was before: every grouping of HD, the first most alike kept;
every distinct order of a worker's devices cut by the dynamic program, the first best kept, and
every order for Max_m (tests/planning/test_partitioner.py); every virtual worker simulated. On
random small clusters (seeded) HD must give the same workers, and a whole plan on the paper's
cluster and on small random clusters the same allocation, Nm, cuts and prediction.
"""
import itertools
import json
import random

import pytest

from hetpipe_tf.pipeline.simulator import simulate_workers
from hetpipe_tf.planning import allocation, planner
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.planning.allocation import AllocationError, _by_node, _compute, _equal_shares, _spread, describe
from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from hetpipe_tf.planning.partitioner import distinct_orders, fits
from tests.helpers.profiles import one_by_one, random_cluster, random_profile


def every_grouping(cluster, vw_size=None, group_size=2, first_in_order=True):
    """HD by trying every grouping of the nodes; the first most alike kept."""
    nodes = _by_node(cluster)
    vw_size = vw_size or min(len(v) for v in nodes.values())

    def groupings(items):
        if not items:
            yield ()
            return
        for others in itertools.combinations(items[1:], group_size - 1):
            rest = [x for x in items[1:] if x not in others]
            for tail in groupings(rest):
                yield ((items[0],) + others,) + tail

    if len(nodes) % group_size:
        raise AllocationError(f"HD: {len(nodes)} nodes do not form groups of {group_size}")
    failed = AllocationError(f"HD: no grouping of the nodes {list(nodes)} into groups of {group_size} gives equal "
                             f"virtual workers of {vw_size} devices")
    best = None
    for grouping in groupings(list(nodes)):
        workers = []
        for group in grouping:
            members = {n: nodes[n] for n in group}
            total = sum(len(v) for v in members.values())
            if total % vw_size:
                break
            try:
                workers += _equal_shares(members, total // vw_size, "HD")
            except AllocationError:
                break
        else:
            score = _spread([sum(_compute(d.type) for d in w) for w in workers]) + _spread(
                [sum(d.type.memory for d in w) for w in workers])
            if best is None or score < best[0] - 1e-12:
                best = (score, tuple(workers))
    if best is None:
        raise failed
    return best[1]


@pytest.mark.parametrize("seed", range(40))
def test_hd_chooses_what_every_grouping_one_by_one_chose(seed, monkeypatch):
    rng = random.Random(seed)
    cluster = random_cluster(rng, max_nodes=8, max_count=4)
    nodes = len(cluster.nodes)
    group = rng.choice([g for g in range(2, nodes + 1) if nodes % g == 0] or [2])
    vw_size = rng.choice([None, 1, 2, 4])

    def names(make):
        try:
            return [[d.name for d in w] for w in make(cluster, vw_size, group)]
        except AllocationError:
            return "no grouping"

    expected = names(every_grouping)
    assert names(allocation.hybrid_distribution) == expected
    monkeypatch.setattr(allocation, "HD_STATES", 0)  # the integer program's way
    assert names(allocation.hybrid_distribution) == expected
    if expected != "no grouping":  # auto's way: the program's first solution, as alike, maybe other nodes
        alike = allocation.hybrid_distribution(cluster, vw_size, group, first_in_order=False)
        assert score(alike) == pytest.approx(score(every_grouping(cluster, vw_size, group)), abs=1e-9)
        assert sorted(d.name for w in alike for d in w) == sorted(d for w in expected for d in w)  # every device once
        monkeypatch.setattr(allocation, "HD_STATES", 1)  # the walk's best when it stops: no more alike than the best
        settled = allocation.hybrid_distribution(cluster, vw_size, group, first_in_order=False)
        assert score(settled) >= score(alike) - 1e-9
        assert sorted(d.name for w in settled for d in w) == sorted(d for w in expected for d in w)


def score(workers):
    return _spread([sum(_compute(d.type) for d in w) for w in workers]) + _spread(
        [sum(d.type.memory for d in w) for w in workers])


def test_hd_on_the_paper_cluster_is_table_3_and_needs_few_states_at_1024_gpus():
    assert describe(allocation.hybrid_distribution(load_cluster("paper"))) == "VVQQ VVQQ RRGG RRGG"
    spec = json.loads(json.dumps(PRESETS["paper"]))
    types = list(spec["device_types"])
    spec["nodes"] = [{"name": f"n{i:03d}", "device_type": types[i % 4], "count": 8} for i in range(128)]
    workers = allocation.hybrid_distribution(load_cluster(spec))
    assert len(workers) == 128 and set(describe(workers).split()) == {"VVVVQQQQ", "RRRRGGGG"}


def reference_planner(monkeypatch):
    """The planner with every search one by one (the searches above, every worker simulated)."""
    monkeypatch.setattr(planner, "best_partition", lambda model, devices, nm, method: one_by_one(model, devices, nm))
    monkeypatch.setattr(planner, "fits_some_order",
                        lambda model, devices, nm: any(fits(model, o, nm) for o in distinct_orders(devices)))
    monkeypatch.setattr(allocation, "hybrid_distribution", every_grouping)
    run_all = simulate_workers
    monkeypatch.setattr(planner, "simulate_workers", lambda *a, same_as=None, **k: run_all(*a, **k))


def plan_outcome(profile, cluster, policy, placement="default"):
    try:
        p = planner.plan(profile, cluster,
                         PlanRequest(policy=policy, placement=placement, method="dp", max_num_in_flight=4))
    except planner.PlanError as e:
        return str(e)
    return (p.allocation, p.num_in_flight, round(p.minibatches_per_s, 9),
            [[d.name for d in w.devices] for w in p.workers], [w.partition.boundaries for w in p.workers])


@pytest.mark.parametrize("seed", range(6))
def test_plans_choose_what_the_searches_one_by_one_chose(seed, monkeypatch):
    rng = random.Random(seed)
    if seed == 0:
        cluster, profile = load_cluster("paper"), random_profile(rng, 8)
    else:
        cluster, profile = random_cluster(rng, max_nodes=4, max_count=3), random_profile(rng)
    cases = [(policy, "default") for policy in ("np", "ed", "hd")] + [("ed", "local")]
    fast = [plan_outcome(profile, cluster, *case) for case in cases]
    reference_planner(monkeypatch)
    assert fast == [plan_outcome(profile, cluster, *case) for case in cases]
