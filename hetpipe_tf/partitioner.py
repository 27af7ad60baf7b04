"""Cutting a model's layers into contiguous stages (HetPipe §7).

Pure functions of per-node costs; no TensorFlow. §7 minimises the slowest
stage ("minimize the maximum execution time of the partitions"); this module
holds the exact dynamic program over contiguous ranges that does so for
additive per-node costs.
"""
import math


def balanced_boundaries(costs, num_stages, allowed_cuts=None, speeds=None):
    """Stage boundaries minimising the largest stage time, exactly.

    Args:
      costs: per-node cost (e.g. seconds, or a FLOP estimate), in topological order.
      num_stages: k, the number of stages.
      allowed_cuts: node indices a stage may start at (default: all of 1..n-1).
      speeds: relative speed of the device of each stage (default all 1); stage s
        takes sum(costs in s) / speeds[s].

    Returns:
      The start node of each stage, beginning with 0.
    """
    n = len(costs)
    k = int(num_stages)
    if k < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    speeds = tuple(speeds) if speeds is not None else (1.0,) * k
    if len(speeds) != k or any(v <= 0 for v in speeds):
        raise ValueError(f"speeds must be {k} positive numbers, got {list(speeds)}")
    cuts = sorted(set(range(1, n)) if allowed_cuts is None else set(allowed_cuts))
    if k - 1 > len(cuts):
        raise ValueError(f"cannot cut {n} layer calls into {k} stages: only {len(cuts)} "
                         f"cut points are allowed")
    starts = [0] + cuts  # candidate stage starts
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    # best[s][i]: the best max stage time when stages s..k-1 cover nodes starts[i]..n.
    m = len(starts)
    best = [[math.inf] * m for _ in range(k + 1)]
    choice = [[None] * m for _ in range(k + 1)]
    for i in range(m):
        best[k - 1][i] = (prefix[n] - prefix[starts[i]]) / speeds[k - 1]
    for s in range(k - 2, -1, -1):
        for i in range(m):
            for j in range(i + 1, m):
                t = max((prefix[starts[j]] - prefix[starts[i]]) / speeds[s], best[s + 1][j])
                if t < best[s][i]:
                    best[s][i], choice[s][i] = t, j
    bounds, i = [0], 0
    for s in range(k - 1):
        i = choice[s][i]
        if i is None:
            raise ValueError(f"cannot cut {n} layer calls into {k} stages")
        bounds.append(starts[i])
    return tuple(bounds)
