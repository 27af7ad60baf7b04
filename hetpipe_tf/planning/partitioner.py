"""Cutting a model's layers into contiguous stages (HetPipe §7).

Pure functions; no TensorFlow. §7 minimises the slowest stage ("minimize the
maximum execution time of the partitions") subject to every stage's memory:

* :func:`balanced_boundaries` balances additive per-node costs (e.g. a FLOP estimate)
  over devices of given speeds, with no memory model;
* :func:`partition_milp` solves the memory-constrained problem over a
  :class:`hetpipe_tf.planning.cost_model.CostModel` as a MILP (HiGHS, as §7 uses CPLEX), and
  :func:`partition_dp` solves the same problem exactly by dynamic programming, as a
  cross-check;
* :func:`best_partition` tries every distinct order of the devices (seed 004).
"""
import contextlib
import itertools
import math
from dataclasses import dataclass


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
    bounds_at = starts + [n]

    def stage_time(s, i, j):  # stage s covers candidate starts i..j-1
        return (prefix[bounds_at[j]] - prefix[bounds_at[i]]) / speeds[s]

    _, chosen = _minmax_dp(len(starts), k, stage_time)
    if chosen is None:
        raise ValueError(f"cannot cut {n} layer calls into {k} stages")
    return tuple(starts[i] for i in chosen)


class InfeasiblePartitionError(ValueError):
    """No cut of the model into stages fits the devices' memory."""


@dataclass(frozen=True)
class Partition:
    """Stages of one virtual worker: the device order, segment boundaries and their costs."""
    devices: tuple
    boundaries: tuple  # first segment of each stage
    stages: tuple  # StageCost per stage
    num_in_flight: int

    @property
    def bottleneck(self):
        """The slowest stage's time per minibatch (§7 minimises it)."""
        return max(s.time for s in self.stages)


class _Coefficients:
    """Prefix sums that make a stage's time and memory linear in its boundaries."""

    def __init__(self, model, devices, num_in_flight):
        p = model.profile
        n, k = p.num_segments, len(devices)
        self.n, self.k = n, k
        copies = model.weight_copies(num_in_flight) + model.optimizer_slots
        self.time_prefix, self.time_const, self.mem_prefix, self.mem_const, self.cap = [], [], [], [], []
        self.held = []
        for q, d in enumerate(devices):
            t, scale = model.times(d.type)
            apply_base = model.apply_seconds(d.type, 0, num_in_flight)
            apply_per_byte = model.apply_seconds(d.type, 1, num_in_flight) - apply_base
            per_seg = [scale * (f + b) + apply_per_byte * w
                       for f, b, w in zip(t.forward, t.backward, p.weight_bytes)]
            self.time_prefix.append(_prefix(per_seg))
            late = 2 * p.pacing_overshoot_seconds if d.type.emulated else 0.0
            self.time_const.append(scale * (t.forward_overhead + t.backward_overhead) + apply_base
                                   + model.executor_seconds(q, k) + late)
            held = model.schedule.activations_held(q, k, num_in_flight)
            self.held.append(held)
            self.mem_prefix.append(_prefix([w * copies + s + held * a for w, s, a in
                                            zip(p.weight_bytes, p.state_bytes, p.activation_bytes)]))
            self.mem_const.append(0 if d.type.on_host else _reserve())
            self.cap.append(d.type.memory)
        self.cut = p.cut_bytes
        # link[q][c]: seconds for the bytes crossing cut c to reach stage q from stage q - 1
        self.link_in = [[0.0] * (n + 1)] + [
            [model.link_seconds(p.cut_bytes[c] if c < n else 0, devices[q - 1], devices[q])
             for c in range(n + 1)] for q in range(1, k)]
        self.link_grad = [[model.link_seconds(p.cut_bytes[c] if c < n else 0, devices[q + 1], devices[q])
                           for c in range(n + 1)]
                          for q in range(k - 1)] + [[0.0] * (n + 1)]

    def time(self, q, lo, hi):
        t = self.time_const[q] + self.time_prefix[q][hi] - self.time_prefix[q][lo]
        if q > 0:
            t += self.link_in[q][lo]
        if q < self.k - 1:
            t += self.link_grad[q][hi]
        return t

    def memory(self, q, lo, hi):
        m = self.mem_const[q] + self.mem_prefix[q][hi] - self.mem_prefix[q][lo]
        if q > 0:
            m += self.held[q] * self.cut[lo]
        return m


def _prefix(values):
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _reserve():
    from hetpipe_tf.planning.cost_model import REAL_DEVICE_RESERVE
    return REAL_DEVICE_RESERVE


def _result(model, devices, boundaries, num_in_flight):
    return Partition(devices=tuple(devices), boundaries=tuple(boundaries),
                     stages=tuple(model.stages(boundaries, devices, num_in_flight)),
                     num_in_flight=num_in_flight)


def _minmax_dp(n, k, stage_value):
    """Boundaries minimising the largest stage_value(q, lo, hi) over contiguous stages."""
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    choice = [[None] * (n + 1) for _ in range(k + 1)]
    for lo in range(n):
        best[k - 1][lo] = stage_value(k - 1, lo, n)
    for q in range(k - 2, -1, -1):
        for lo in range(n):
            for hi in range(lo + 1, n - (k - 2 - q)):
                v = max(stage_value(q, lo, hi), best[q + 1][hi])
                if v < best[q][lo]:
                    best[q][lo], choice[q][lo] = v, hi
    bounds, lo = [0], 0
    for q in range(k - 1):
        lo = choice[q][lo]
        if lo is None:
            return math.inf, None
        bounds.append(lo)
    return best[0][0], tuple(bounds)


def _infeasible(model, devices, num_in_flight, co):
    """The error for a device order nothing fits: the cut closest to fitting, its worst stage."""
    _, bounds = _minmax_dp(co.n, co.k, lambda q, lo, hi: co.memory(q, lo, hi) / co.cap[q])
    stages = model.stages(bounds, devices, num_in_flight)
    worst = max(stages, key=lambda s: s.memory_total / s.capacity)
    from hetpipe_tf.pipeline.emulation import format_breakdown, format_bytes
    return InfeasiblePartitionError(
        f"{model.profile.model} does not fit devices {[d.name for d in devices]} with Nm={num_in_flight} "
        f"at batch {model.profile.batch_size}: at best, stage {worst.position} (segments "
        f"{worst.segments[0]}..{worst.segments[1] - 1}) on {worst.device.name} ({worst.device.type.label}) "
        f"needs {format_bytes(worst.memory_total)} ({format_breakdown(worst.memory)}) but holds "
        f"{format_bytes(worst.capacity)}")


def partition_dp(model, devices, num_in_flight):
    """The exact dynamic program: boundaries minimising the slowest stage under memory (§7).

    Args:
      model: a :class:`hetpipe_tf.planning.cost_model.CostModel`.
      devices: the virtual worker's devices, in stage order.
      num_in_flight: Nm.
    """
    co = _Coefficients(model, devices, num_in_flight)
    if co.k > co.n:
        raise InfeasiblePartitionError(f"{co.k} devices but only {co.n} segments to place")

    def value(q, lo, hi):
        return co.time(q, lo, hi) if co.memory(q, lo, hi) <= co.cap[q] else math.inf

    best, bounds = _minmax_dp(co.n, co.k, value)
    if bounds is None or best == math.inf:
        raise _infeasible(model, devices, num_in_flight, co)
    return _result(model, devices, bounds, num_in_flight)


def partition_milp(model, devices, num_in_flight, time_limit=60.0):
    """The same problem as a mixed-integer linear program solved by HiGHS (scipy.optimize.milp).

    Binary y[c, q] says stage q ends right before segment c. With prefix sums P(c), a
    stage's compute is P(end) - P(start) and its memory likewise, so every stage's time
    and memory are linear in y; T bounds every stage's time and is minimised.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    import numpy as np

    co = _Coefficients(model, devices, num_in_flight)
    n, k = co.n, co.k
    if k > n:
        raise InfeasiblePartitionError(f"{k} devices but only {n} segments to place")
    if k == 1:
        if co.memory(0, 0, n) > co.cap[0]:
            raise _infeasible(model, devices, num_in_flight, co)
        return _result(model, devices, (0,), num_in_flight)
    cuts = range(1, n)
    nvar = len(cuts) * (k - 1) + 1  # y, then T

    def y(c, q):
        return (q * len(cuts)) + (c - 1)

    rows, lb, ub = [], [], []

    def add(coeffs, low, high):
        row = np.zeros(nvar)
        for i, v in coeffs:
            row[i] += v
        rows.append(row)
        lb.append(low)
        ub.append(high)

    for q in range(k - 1):  # each boundary at exactly one cut
        add([(y(c, q), 1.0) for c in cuts], 1.0, 1.0)
    for q in range(k - 2):  # boundaries in order, every stage non-empty
        add([(y(c, q), float(c)) for c in cuts] + [(y(c, q + 1), -float(c)) for c in cuts], -np.inf, -1.0)
    t_index = nvar - 1
    for q in range(k):
        tc, mc = [], []
        t_const = co.time_const[q]
        m_const = co.mem_const[q]
        if q < k - 1:  # + P(end)
            tc += [(y(c, q), co.time_prefix[q][c] + co.link_grad[q][c]) for c in cuts]
            mc += [(y(c, q), co.mem_prefix[q][c]) for c in cuts]
        else:
            t_const += co.time_prefix[q][n]
            m_const += co.mem_prefix[q][n]
        if q > 0:  # - P(start), + what crosses into the stage
            tc += [(y(c, q - 1), -co.time_prefix[q][c] + co.link_in[q][c]) for c in cuts]
            mc += [(y(c, q - 1), -co.mem_prefix[q][c] + co.held[q] * co.cut[c]) for c in cuts]
        add(tc + [(t_index, -1.0)], -np.inf, -t_const)
        add(mc, -np.inf, co.cap[q] - m_const)
    cost = np.zeros(nvar)
    cost[t_index] = 1.0
    integrality = np.ones(nvar)
    integrality[t_index] = 0
    bounds = Bounds(np.zeros(nvar), np.concatenate([np.ones(nvar - 1), [np.inf]]))
    with _quiet_stdout():  # HiGHS prints debug lines of its own
        res = milp(cost, constraints=LinearConstraint(np.array(rows), lb, ub), integrality=integrality,
                   bounds=bounds, options={"time_limit": time_limit, "mip_rel_gap": 0.0})
    if res.x is None:
        raise _infeasible(model, devices, num_in_flight, co)
    bounds_out = [0] + [next(c for c in cuts if res.x[y(c, q)] > 0.5) for q in range(k - 1)]
    return _result(model, devices, tuple(bounds_out), num_in_flight)


@contextlib.contextmanager
def _quiet_stdout():
    """Silences file descriptor 1 (C-level prints) for the duration."""
    import os
    import sys
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def fits(model, devices, num_in_flight):
    """Whether some cut of the model over `devices`, in this order, fits their memory."""
    co = _Coefficients(model, devices, num_in_flight)
    if co.k > co.n:
        return False
    worst, _ = _minmax_dp(co.n, co.k, lambda q, lo, hi: co.memory(q, lo, hi) / co.cap[q])
    return worst <= 1.0


MAX_ORDERS = 720


def distinct_orders(devices, limit=MAX_ORDERS):
    """The orders of `devices` that differ in their (node, type) sequence, which is all costs see.

    When there are more than `limit` of them, only the orders that keep each node's devices
    together are tried (every order of the nodes), which is also what keeps slow inter-node
    links few.
    """
    keys = [(d.node, d.type.name) for d in devices]
    counts = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    total = math.factorial(len(keys))
    for c in counts.values():
        total //= math.factorial(c)
    pools = {}
    for d in devices:
        pools.setdefault((d.node, d.type.name), []).append(d)
    if total > limit:
        blocks = list(pools.values())
        return [tuple(d for block in perm for d in block) for perm in itertools.permutations(blocks)][:limit]
    out = []

    def extend(prefix, remaining):
        if not remaining:
            used = {k: 0 for k in pools}
            order = []
            for k in prefix:
                order.append(pools[k][used[k]])
                used[k] += 1
            out.append(tuple(order))
            return
        for k in list(remaining):
            remaining[k] -= 1
            if not remaining[k]:
                del remaining[k]
            extend(prefix + [k], remaining)
            remaining[k] = remaining.get(k, 0) + 1

    extend([], dict(counts))
    return out


def best_partition(model, devices, num_in_flight, method="milp"):
    """The best partition over every distinct order of the devices (seed 004)."""
    solve = {"milp": partition_milp, "dp": partition_dp}[method]
    best, errors = None, []
    for order in distinct_orders(devices):
        try:
            part = solve(model, order, num_in_flight)
        except InfeasiblePartitionError as e:
            errors.append(e)
            continue
        if best is None or part.bottleneck < best.bottleneck - 1e-12:
            best = part
    if best is None:
        raise errors[0]
    return best
