"""The planner's faster searches choose what trying every case one by one chose (issue 29).

The reference is the search as it was before: every grouping of HD, the first most alike kept.
On random small clusters (seeded) HD must give the same workers.
"""
import itertools
import json
import random

import pytest

from hetpipe_tf.planning import allocation
from hetpipe_tf.planning.allocation import AllocationError, _by_node, _compute, _equal_shares, _spread, describe
from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from tests.planning.test_partitioner import random_cluster


def every_grouping(cluster, vw_size=None, group_size=2):
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


def test_hd_on_the_paper_cluster_is_table_3_and_needs_few_states_at_1024_gpus():
    assert describe(allocation.hybrid_distribution(load_cluster("paper"))) == "VVQQ VVQQ RRGG RRGG"
    spec = json.loads(json.dumps(PRESETS["paper"]))
    types = list(spec["device_types"])
    spec["nodes"] = [{"name": f"n{i:03d}", "device_type": types[i % 4], "count": 8} for i in range(128)]
    workers = allocation.hybrid_distribution(load_cluster(spec))
    assert len(workers) == 128 and set(describe(workers).split()) == {"VVVVQQQQ", "RRRRGGGG"}
