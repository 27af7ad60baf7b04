import itertools
import json
import random

import pytest

from hetpipe_tf.pipeline.schedule import NO_SYNC
from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from hetpipe_tf.planning.cost_model import CostModel
from hetpipe_tf.planning.partitioner import (InfeasiblePartitionError, balanced_boundaries, best_partition,
                                            distinct_orders, fits, fits_some_order, partition_dp, partition_milp)
from hetpipe_tf.planning.profile import Profile, SegmentTimes
from tests.helpers.profiles import one_by_one, random_cluster, random_profile
from hetpipe_tf.sync.wsp import WSP_SCHEME


def _brute(costs, k, speeds, allowed):
    best = None
    for cuts in itertools.combinations(sorted(allowed), k - 1):
        b = (0,) + cuts
        ends = cuts + (len(costs),)
        t = max(sum(costs[lo:hi]) / v for lo, hi, v in zip(b, ends, speeds))
        if best is None or t < best[0] - 1e-12:
            best = (t, b)
    return best[0]


@pytest.mark.parametrize("seed", range(25))
def test_dynamic_program_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    k = rng.randint(1, min(4, n))
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    speeds = [rng.choice([0.5, 1.0, 2.0]) for _ in range(k)]
    allowed = [c for c in range(1, n) if rng.random() < 0.8] or list(range(1, n))
    if len(allowed) < k - 1:
        allowed = list(range(1, n))
    b = balanced_boundaries(costs, k, allowed_cuts=allowed, speeds=speeds)
    ends = b[1:] + (n,)
    got = max(sum(costs[lo:hi]) / v for lo, hi, v in zip(b, ends, speeds))
    assert got == pytest.approx(_brute(costs, k, speeds, allowed))
    assert b[0] == 0 and set(b[1:]) <= set(allowed)


def test_errors():
    with pytest.raises(ValueError, match="only 1 cut points"):
        balanced_boundaries([1, 1, 1], 3, allowed_cuts=[1])
    with pytest.raises(ValueError, match="speeds"):
        balanced_boundaries([1, 1], 2, speeds=[1.0])
    with pytest.raises(ValueError, match="num_stages"):
        balanced_boundaries([1], 0)


def _random_instance(rng):
    n = rng.randint(2, 10)
    spec = json.loads(json.dumps(PRESETS["local"]))
    spec["device_types"]["F"]["memory"] = f"{rng.randint(20, 120)}K"
    spec["device_types"]["S"]["memory"] = f"{rng.randint(20, 120)}K"
    cluster = load_cluster(spec)
    profile = Profile(
        model="random", batch_size=4, starts=tuple(range(n)),
        weight_bytes=tuple(rng.randint(0, 3000) for _ in range(n)),
        state_bytes=tuple(rng.randint(0, 300) for _ in range(n)),
        activation_bytes=tuple(rng.randint(100, 8000) for _ in range(n)),
        cut_bytes=(0,) + tuple(rng.randint(1, 10 ** 9) for _ in range(n - 1)),
        forward_flops=(1,) * n, backward_flops=(1,) * n, traffic_bytes=(1,) * n, kernels=(1,) * n,
        times={"host": SegmentTimes(tuple(rng.uniform(0.1, 3) for _ in range(n)),
                                    tuple(rng.uniform(0.1, 5) for _ in range(n)), 0.2, 0.1, "random")},
        apply_base=0.01, apply_per_byte=1e-5)
    k = rng.randint(1, min(4, n))
    devices = rng.sample(cluster.devices(), k)
    model = CostModel(profile, cluster, dilation=rng.choice([1.0, 3.0]), optimizer_slots=rng.randint(0, 2),
                      sync=WSP_SCHEME if rng.random() < 0.5 else NO_SYNC)
    return model, devices, rng.randint(1, 4)


@pytest.mark.parametrize("seed", range(40))
def test_milp_equals_dynamic_program(seed):
    rng = random.Random(seed)
    model, devices, nm = _random_instance(rng)
    try:
        dp = partition_dp(model, devices, nm)
    except InfeasiblePartitionError:
        with pytest.raises(InfeasiblePartitionError):
            partition_milp(model, devices, nm)
        return
    milp = partition_milp(model, devices, nm)
    assert milp.bottleneck == pytest.approx(dp.bottleneck, rel=1e-6)
    for part in (dp, milp):
        assert all(s.memory_total <= s.capacity for s in part.stages)
        assert part.boundaries[0] == 0 and list(part.boundaries) == sorted(set(part.boundaries))


def test_infeasible_names_the_stage_its_need_and_the_capacity():
    rng = random.Random(1)
    model, devices, _ = _random_instance(rng)
    spec = json.loads(json.dumps(PRESETS["local"]))
    spec["device_types"]["F"]["memory"] = "1K"
    spec["device_types"]["S"]["memory"] = "1K"
    tiny = CostModel(model.profile, load_cluster(spec))
    with pytest.raises(InfeasiblePartitionError,
                       match=r"does not fit devices .* at best, stage \d+ \(segments \d+\.\.\d+\) on host-[FS]:\d "
                             r"\(emulated (fast|slow)\) needs .* but holds 1\.0 KiB"):
        partition_milp(tiny, tiny.cluster.devices()[:2], 2)


def test_device_orders_are_distinct_by_node_and_type():
    cluster = load_cluster("paper")
    v0, v1, r0 = cluster.devices()[0], cluster.devices()[1], cluster.devices()[4]
    assert len(distinct_orders([v0, v1, r0])) == 3
    rng = random.Random(5)
    model, _, _ = _random_instance(rng)
    spec = json.loads(json.dumps(PRESETS["local"]))
    spec["device_types"]["F"]["memory"] = spec["device_types"]["S"]["memory"] = "100G"
    roomy = CostModel(model.profile, load_cluster(spec), dilation=2.0)
    devices = roomy.cluster.devices()[1:]
    best = best_partition(roomy, devices, 2, method="dp")
    assert best.bottleneck == min(partition_dp(roomy, o, 2).bottleneck for o in distinct_orders(devices))
    assert best.bottleneck == pytest.approx(best_partition(roomy, devices, 2, method="milp").bottleneck)


def random_worker(rng, cluster):
    devices = list(cluster.devices())
    return tuple(rng.sample(devices, rng.randint(1, min(5, len(devices)))))


def outcome(solve, *args):
    try:
        part = solve(*args)
    except InfeasiblePartitionError as e:
        return str(e)
    return [d.name for d in part.devices], part.boundaries, part.bottleneck


@pytest.mark.parametrize("seed", range(60))
def test_the_order_search_chooses_what_every_order_one_by_one_chose(seed):
    rng = random.Random(seed)
    cluster = random_cluster(rng)
    devices = random_worker(rng, cluster)
    nodes = sorted({d.node for d in devices})
    flows = tuple(((a, b), rng.randint(1, 3)) for i, a in enumerate(nodes) for b in nodes[i + 1:])
    model = CostModel(random_profile(rng), cluster, link_flows=flows if rng.random() < 0.5 else (),
                      optimizer_slots=rng.randint(0, 2), sync=WSP_SCHEME)
    nm = rng.randint(1, 4)
    assert outcome(best_partition, model, devices, nm, "dp") == outcome(one_by_one, model, devices, nm)
    assert fits_some_order(model, devices, nm) == any(fits(model, o, nm) for o in distinct_orders(devices))
