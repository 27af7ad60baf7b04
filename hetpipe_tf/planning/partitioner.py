"""Cutting a model's layers into contiguous stages (HetPipe §7).

Pure functions; no TensorFlow. §7 minimises the slowest stage ("minimize the
maximum execution time of the partitions") subject to every stage's memory:

* :func:`balanced_boundaries` balances additive per-node costs (e.g. a FLOP estimate)
  over devices of given speeds, with no memory model;
* :func:`partition_milp` solves the memory-constrained problem over a
  :class:`hetpipe_tf.planning.cost_model.CostModel` as a MILP (HiGHS, as §7 uses CPLEX), and
  :func:`partition_dp` solves the same problem exactly by dynamic programming, as a
  cross-check;
* :func:`best_partition` finds the best of the devices' distinct orders (the extended HetPipe's partitioner, which tries every device order) by branch
  and bound (:class:`_OrderSearch`), the MILP or the dynamic program then cutting that order;
  :func:`fits_some_order` says whether any of them fits.
"""
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.pipeline.emulation import format_breakdown, format_bytes
from hetpipe_tf.planning.cluster import Device, DeviceType
from hetpipe_tf.planning.cost_model import REAL_DEVICE_RESERVE, CostModel, StageCost, neighbour
from hetpipe_tf.planning.milp import Program

#: Seconds or bytes per segment or cut, as numpy computes them.
Floats = npt.NDArray[np.float64]
#: Which cuts (or (lo, hi) pairs) qualify.
Mask = npt.NDArray[np.bool_]
#: A stage's own costs at a position on a device type: (time const, time prefix, memory const,
#: memory prefix, activations held, capacity).
Own = tuple[float, Floats, float, Floats, int, int]
#: A device's (node, type name): what costs see of it.
PoolKey = tuple[str, str]
#: The types of a unit of devices placed together, and how many such units are left.
Units = tuple[tuple[tuple[DeviceType, ...], int], ...]


def balanced_boundaries(costs: Sequence[float], num_stages: int, allowed_cuts: Iterable[int] | None = None,
                        speeds: Sequence[float] | None = None) -> tuple[int, ...]:
    """Stage boundaries minimising the largest stage time, exactly.

    Args:
      costs: per-node cost (e.g. seconds, or a FLOP estimate), in topological order.
      num_stages: k, the number of stages.
      allowed_cuts: node indices a stage may start at (default: all of 1..n-1).
      speeds: relative speed of the device of each stage (default all 1); stage s
        takes sum(costs in s) / speeds[s].

    Returns:
      The start node of each stage, beginning with 0.

    Raises:
      ValueError: `num_stages` < 1, `speeds` not one positive number per stage, or too few nodes
        or allowed cuts for `num_stages` stages.
    """
    n = len(costs)
    k = int(num_stages)
    if k < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    rates = tuple(speeds) if speeds is not None else (1.0,) * k
    if len(rates) != k or any(v <= 0 for v in rates):
        raise ValueError(f"speeds must be {k} positive numbers, got {list(rates)}")
    cuts = sorted(set(range(1, n)) if allowed_cuts is None else set(allowed_cuts))
    if k - 1 > len(cuts):
        raise ValueError(f"cannot cut {n} layer calls into {k} stages: only {len(cuts)} "
                         f"cut points are allowed")
    starts = [0] + cuts  # candidate stage starts
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    bounds_at = starts + [n]

    def stage_time(s: int, i: int, j: int) -> float:  # stage s covers candidate starts i..j-1
        return (prefix[bounds_at[j]] - prefix[bounds_at[i]]) / rates[s]

    _, chosen = _minmax_dp(len(starts), k, stage_time)
    if chosen is None:
        raise ValueError(f"cannot cut {n} layer calls into {k} stages")
    return tuple(starts[i] for i in chosen)


class InfeasiblePartitionError(HetPipeUsageError, ValueError):
    """No cut of the model into stages fits the devices' memory."""


@dataclass(frozen=True)
class Partition:
    """Stages of one virtual worker: the device order, segment boundaries and their costs."""
    devices: tuple[Device, ...]
    boundaries: tuple[int, ...]  # first segment of each stage
    stages: tuple[StageCost, ...]
    num_in_flight: int

    @property
    def bottleneck(self) -> float:
        """The slowest stage's time per minibatch (§7 minimises it)."""
        return max(s.time for s in self.stages)


class _Tables:
    """What a stage costs on a device type at a position, as prefix sums over the segments, and
    what crosses each cut between two devices: shared by every order of one worker's devices.

    A stage's time and memory depend on its device's type and its position (the schedule's
    activations held, the executor's instructions), and the links into and out of it on the
    nodes of its neighbours only (§7).

    A layer called in several segments (tied weights) counts in each of them, as if every call
    were on a stage of its own: each holds a replica and receives the others' gradients of every
    minibatch, from a neighbouring stage's device. A cut that keeps calls together is charged
    more than it costs (the cost model's stage costs are exact); the plans with every shared
    layer on one stage are planned apart (:func:`hetpipe_tf.planning.profile.colocated`)."""

    def __init__(self, model: CostModel, num_stages: int, num_in_flight: int) -> None:
        self.model, self.k, self.num_in_flight = model, num_stages, num_in_flight
        self.n = model.profile.num_segments
        self.cut = model.profile.cut_bytes
        self._own: dict[tuple[str, int], Own] = {}
        self._links: dict[tuple[str, str], Floats] = {}
        self._exchanges: dict[tuple[str | None, str], Floats] = {}

    def own(self, device_type: DeviceType, q: int) -> Own:
        """(time const, time prefix, memory const, memory prefix, activations held, capacity) of a
        stage at position q on `device_type`, its links left out.

        Returns:
            The tuple.
        """
        key = (device_type.name, q)
        if key not in self._own:
            model, p, nm = self.model, self.model.profile, self.num_in_flight
            t, scale = model.times(device_type)
            apply_base = model.apply_seconds(device_type, 0, nm)
            apply_per_byte = model.apply_seconds(device_type, 1, nm) - apply_base
            per_seg = [scale * (f + b) + apply_per_byte * w
                       for f, b, w in zip(t.forward, t.backward, p.weight_bytes)]
            late = 2 * p.pacing_overshoot_seconds if device_type.emulated else 0.0
            time_const = (scale * (t.forward_overhead + t.backward_overhead) + apply_base
                          + model.executor_seconds(q, self.k) + late)
            held = model.schedule.activations_held(q, self.k, nm)
            copies = model.weight_copies(nm) + model.optimizer_slots
            mem = [w * copies + s + held * a for w, s, a in zip(p.weight_bytes, p.state_bytes, p.activation_bytes)]
            self._own[key] = (time_const, np.array(_prefix(per_seg)), 0 if device_type.on_host else REAL_DEVICE_RESERVE,
                              np.array(_prefix(mem), dtype=float), held, device_type.memory)
        return self._own[key]

    def link(self, src: Device, dst: Device) -> Floats:
        """Seconds for what crosses each cut c = 0..n to go from device `src` to device `dst`."""
        key = (src.node, dst.node)
        if key not in self._links:
            self._links[key] = np.array([self.model.link_seconds(self.cut[c] if c < self.n else 0, src, dst)
                                         for c in range(self.n + 1)])
        return self._links[key]

    def exchange(self, partner: Device | None, device: Device) -> Floats:
        """Prefix sums over the segments of the seconds `device` takes to receive the gradients of
        the tied layers each segment calls from `partner` (None: no other stage, zeros).

        Returns:
            The prefix sums.
        """
        key = (None if partner is None else partner.node, device.node)
        if key not in self._exchanges:
            per_segment = [0.0] * self.n
            if partner is not None:
                for _, segments, nbytes in self.model.profile.shared_weights:
                    for i in segments:
                        per_segment[i] += self.model.link_seconds(nbytes, partner, device)
            self._exchanges[key] = np.array(_prefix(per_segment))
        return self._exchanges[key]

    def stage_times(self, q: int, device: Device, before: Device | None, after: Device | None
                    ) -> tuple[Floats, Floats]:
        """(time, memory) of stage q on `device` for every (lo, hi) as (n + 1) x (n + 1) arrays
        (inf where hi <= lo), with the device `before` it and `after` it (None at the ends).

        Returns:
            The two arrays.
        """
        time_const, time_prefix, mem_const, mem_prefix, held, _ = self.own(device.type, q)
        time_prefix = time_prefix + self.exchange(before if before is not None else after, device)
        time = (time_const + time_prefix)[None, :] - time_prefix[:, None]
        if before is not None:
            time = time + self.link(before, device)[:, None]
        if after is not None:
            time = time + self.link(after, device)[None, :]
        memory = (mem_const + mem_prefix)[None, :] - mem_prefix[:, None]
        if before is not None:
            memory = memory + (held * np.array(self.cut + (0,), dtype=float))[:, None]
        return np.where(_UPPER[self.n], time, math.inf), memory


class _Upper(dict[int, Mask]):
    """lo < hi masks by segment count."""

    def __missing__(self, n: int) -> Mask:
        self[n] = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        return self[n]


_UPPER = _Upper()


class _Coefficients:
    """Prefix sums that make a stage's time and memory linear in its boundaries, for one order."""

    def __init__(self, model: CostModel, devices: Sequence[Device], num_in_flight: int,
                 tables: "_Tables | None" = None) -> None:
        tables = tables or _Tables(model, len(devices), num_in_flight)
        n, k = tables.n, len(devices)
        self.n, self.k = n, k
        self.time_prefix: list[list[float]] = []
        self.mem_prefix: list[list[float]] = []
        self.time_const: list[float] = []
        self.mem_const: list[float] = []
        self.cap: list[int] = []
        self.held: list[int] = []
        for q, d in enumerate(devices):
            time_const, time_prefix, mem_const, mem_prefix, held, cap = tables.own(d.type, q)
            self.time_prefix.append((time_prefix + tables.exchange(neighbour(devices, q), d)).tolist())
            self.time_const.append(time_const)
            self.held.append(held)
            self.mem_prefix.append(mem_prefix.tolist())
            self.mem_const.append(mem_const)
            self.cap.append(cap)
        self.cut = tables.cut
        # link[q][c]: seconds for the bytes crossing cut c to reach stage q from stage q - 1
        self.link_in: list[list[float]] = [[0.0] * (n + 1)] + [tables.link(devices[q - 1], devices[q]).tolist()
                                                               for q in range(1, k)]
        self.link_grad: list[list[float]] = ([tables.link(devices[q + 1], devices[q]).tolist() for q in range(k - 1)]
                          + [[0.0] * (n + 1)])

    def time(self, q: int, lo: int, hi: int) -> float:
        t = self.time_const[q] + self.time_prefix[q][hi] - self.time_prefix[q][lo]
        if q > 0:
            t += self.link_in[q][lo]
        if q < self.k - 1:
            t += self.link_grad[q][hi]
        return t

    def memory(self, q: int, lo: int, hi: int) -> float:
        m = self.mem_const[q] + self.mem_prefix[q][hi] - self.mem_prefix[q][lo]
        if q > 0:
            m += self.held[q] * self.cut[lo]
        return m


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def partition_of(model: CostModel, devices: Sequence[Device], boundaries: Sequence[int],
                 num_in_flight: int) -> Partition:
    """The :class:`Partition` of `devices` cut at `boundaries` with `num_in_flight`, its stages as
    `model` predicts them.

    Returns:
        The Partition.
    """
    return Partition(devices=tuple(devices), boundaries=tuple(boundaries),
                     stages=tuple(model.stages(boundaries, devices, num_in_flight)),
                     num_in_flight=num_in_flight)


def _minmax_dp(n: int, k: int, stage_value: Callable[[int, int, int], float]) -> tuple[float, tuple[int, ...] | None]:
    """Boundaries minimising the largest stage_value(q, lo, hi) over contiguous stages."""
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    choice: list[list[int | None]] = [[None] * (n + 1) for _ in range(k + 1)]
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
        end = choice[q][lo]
        if end is None:
            return math.inf, None
        bounds.append(end)
        lo = end
    return best[0][0], tuple(bounds)


def _infeasible(model: CostModel, devices: Sequence[Device], num_in_flight: int, co: _Coefficients
                ) -> InfeasiblePartitionError:
    """The error for a device order nothing fits: the cut closest to fitting, its worst stage."""
    _, bounds = _minmax_dp(co.n, co.k, lambda q, lo, hi: co.memory(q, lo, hi) / co.cap[q])
    stages = model.stages(bounds or (0,), devices, num_in_flight)
    worst = max(stages, key=lambda s: s.memory_total / s.capacity)
    return InfeasiblePartitionError(
        f"{model.profile.model} does not fit devices {[d.name for d in devices]} with Nm={num_in_flight} "
        f"at batch {model.profile.batch_size}: at best, stage {worst.position} (segments "
        f"{worst.segments[0]}..{worst.segments[1] - 1}) on {worst.device.name} ({worst.device.type.label}) "
        f"needs {format_bytes(worst.memory_total)} ({format_breakdown(worst.memory)}) but holds "
        f"{format_bytes(worst.capacity)}")


def partition_dp(model: CostModel, devices: Sequence[Device], num_in_flight: int) -> Partition:
    """The exact dynamic program: boundaries minimising the slowest stage under memory (§7).

    Args:
      model: a :class:`hetpipe_tf.planning.cost_model.CostModel`.
      devices: the virtual worker's devices, in stage order.
      num_in_flight: Nm.

    Returns:
      The Partition.

    Raises:
      InfeasiblePartitionError: no cut fits the devices' memory (the message names the stage,
        its need and the device's capacity).
    """
    co = _Coefficients(model, devices, num_in_flight)
    if co.k > co.n:
        raise InfeasiblePartitionError(f"{co.k} devices but only {co.n} segments to place")

    def value(q: int, lo: int, hi: int) -> float:
        return co.time(q, lo, hi) if co.memory(q, lo, hi) <= co.cap[q] else math.inf

    best, bounds = _minmax_dp(co.n, co.k, value)
    if bounds is None or best == math.inf:
        raise _infeasible(model, devices, num_in_flight, co)
    return partition_of(model, devices, bounds, num_in_flight)


def partition_milp(model: CostModel, devices: Sequence[Device], num_in_flight: int,
                   time_limit: float = 60.0) -> Partition:
    """The same problem as a mixed-integer linear program solved by HiGHS (scipy.optimize.milp).

    Binary y[c, q] says stage q ends right before segment c. With prefix sums P(c), a
    stage's compute is P(end) - P(start) and its memory likewise, so every stage's time
    and memory are linear in y; T bounds every stage's time and is minimised.

    Returns:
        The Partition.

    Raises:
        InfeasiblePartitionError: no cut fits the devices' memory.
    """
    co = _Coefficients(model, devices, num_in_flight)
    n, k = co.n, co.k
    if k > n:
        raise InfeasiblePartitionError(f"{k} devices but only {n} segments to place")
    if k == 1:
        if co.memory(0, 0, n) > co.cap[0]:
            raise _infeasible(model, devices, num_in_flight, co)
        return partition_of(model, devices, (0,), num_in_flight)
    cuts = range(1, n)
    nvar = len(cuts) * (k - 1) + 1  # y, then T

    def y(c: int, q: int) -> int:
        return (q * len(cuts)) + (c - 1)

    program = Program(nvar)
    add = program.add
    for q in range(k - 1):  # each boundary at exactly one cut
        add([(y(c, q), 1.0) for c in cuts], 1.0, 1.0)
    for q in range(k - 2):  # boundaries in order, every stage non-empty
        add([(y(c, q), float(c)) for c in cuts] + [(y(c, q + 1), -float(c)) for c in cuts], -np.inf, -1.0)
    t_index = nvar - 1
    for q in range(k):
        tc: list[tuple[int, float]] = []
        mc: list[tuple[int, float]] = []
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
    x = program.solve(cost, integrality, np.zeros(nvar), np.concatenate([np.ones(nvar - 1), [np.inf]]),
                      time_limit=time_limit)
    if x is None:
        raise _infeasible(model, devices, num_in_flight, co)
    bounds_out = [0] + [next(c for c in cuts if x[y(c, q)] > 0.5) for q in range(k - 1)]
    return partition_of(model, devices, tuple(bounds_out), num_in_flight)


def fits(model: CostModel, devices: Sequence[Device], num_in_flight: int) -> bool:
    """Whether some cut of the model over `devices`, in this order, fits their memory."""
    co = _Coefficients(model, devices, num_in_flight)
    if co.k > co.n:
        return False
    worst, _ = _minmax_dp(co.n, co.k, lambda q, lo, hi: co.memory(q, lo, hi) / co.cap[q])
    return worst <= 1.0


MAX_ORDERS = 720


def _pools(devices: Iterable[Device]) -> dict[PoolKey, list[Device]]:
    """The worker's devices by (node, type), in order of first appearance."""
    pools: dict[PoolKey, list[Device]] = {}
    for d in devices:
        pools.setdefault((d.node, d.type.name), []).append(d)
    return pools


def _count_orders(pools: dict[PoolKey, list[Device]], limit: int) -> int:
    """How many orders differ in their (node, type) sequence, counted up to limit + 1."""
    total, placed = 1, 0
    for pool in pools.values():
        for i in range(1, len(pool) + 1):
            placed += 1
            total = total * placed // i
            if total > limit:
                return limit + 1
    return total


def distinct_orders(devices: Sequence[Device], limit: int = MAX_ORDERS) -> list[tuple[Device, ...]]:
    """The orders of `devices` that differ in their (node, type) sequence, which is all costs see.

    When there are more than `limit` of them, only orders that keep each node's devices together
    are listed (the first `limit` orders of the nodes). :func:`best_partition` searches the same
    orders, without listing them.

    Returns:
        The orders.
    """
    pools = _pools(devices)
    blocks = _count_orders(pools, limit) > limit
    out: list[tuple[Device, ...]] = []

    def visit(prefix: tuple[Device, ...]) -> bool:
        if len(prefix) == len(devices):
            out.append(prefix)
        return len(out) < limit

    _walk_orders(pools, blocks, lambda prefix, key, left: key, visit)
    return out


def _walk_orders(pools: dict[PoolKey, list[Device]], blocks: bool,
                 signature: Callable[[Sequence[Device], PoolKey, int], Hashable],
                 visit: Callable[[tuple[Device, ...]], bool]) -> None:
    """Calls visit(prefix) for every prefix of the orders, in distinct_orders' sequence (the
    devices' (node, type) keys in the order of a recursion over the keys left, or the nodes'
    permutations in order); visit returns False to skip the orders that start with the prefix.
    Of siblings with equal signature(prefix, key, devices left of the key), only the first is
    walked."""
    if blocks:
        keys = list(pools)

        def extend_blocks(prefix: list[Device], left: list[PoolKey]) -> None:
            if prefix and not visit(tuple(prefix)):
                return
            seen: set[Hashable] = set()
            for key in left:
                sig = signature(prefix, key, len(pools[key]))
                if sig not in seen:
                    seen.add(sig)
                    extend_blocks(prefix + pools[key], [k for k in left if k != key])

        extend_blocks([], keys)
        return

    def extend(prefix: list[Device], remaining: dict[PoolKey, int]) -> None:
        if prefix and not visit(tuple(prefix)):
            return
        seen: set[Hashable] = set()
        for key in list(remaining):
            sig = signature(prefix, key, remaining[key])
            if sig in seen:
                continue
            seen.add(sig)
            remaining[key] -= 1
            if not remaining[key]:
                del remaining[key]
            pool = pools[key]
            extend(prefix + [pool[len(pool) - 1 - remaining.get(key, 0)]], remaining)
            remaining[key] = remaining.get(key, 0) + 1

    extend([], {k: len(v) for k, v in pools.items()})


class _OrderSearch:
    """Branch and bound over the orders of one virtual worker's devices (the extended HetPipe, §7).

    The orders are those of :func:`distinct_orders`: every order that differs in its (node,
    type) sequence, or, beyond MAX_ORDERS of them, every order of the worker's nodes with each
    node's devices together; they are walked in the same sequence, as a tree of prefixes. Along a
    prefix the dynamic program runs forwards: ``best[c]``, the least slowest stage of the stages
    placed so far when the next stage starts at segment c, is extended by one device in O(n^2)
    (numpy). A prefix is cut off when

    * no order that starts with it fits the devices' memory (memory depends on the devices'
      types only, so this is decided once per (position, remaining types, reachable cuts)); or
    * its bound, min over c of max(best[c], the segments from c on spread over the remaining
      devices at their best speed on any segment), cannot beat the best order found so far by
      more than 1e-12 (the tie rule of trying the orders one by one: the first best one is kept);
    * a sibling before it differs only by nodes the links cannot tell apart (same type, same
      devices left, not the previous device's node, every pair of the worker's nodes shared by
      as many workers): its subtree is the same with two nodes swapped, so it holds an order as
      good that comes first.

    Beyond MAX_ORDERS distinct orders, at most MAX_ORDERS prefixes are extended once an order
    that fits is known (the search is then not exhaustive, as the first MAX_ORDERS orders of the
    nodes were not before; the best of a few orders, :meth:`_seed_orders`, is known from the
    start)."""

    def __init__(self, model: CostModel, devices: Sequence[Device], num_in_flight: int, limit: int = MAX_ORDERS
                 ) -> None:
        self.model, self.devices, self.num_in_flight = model, tuple(devices), num_in_flight
        self.k = len(self.devices)
        self.tables = _Tables(model, self.k, num_in_flight)
        self.n = self.tables.n
        self.pools = _pools(self.devices)
        self.blocks = _count_orders(self.pools, limit) > limit
        self.budget = limit if self.blocks else None
        nodes = sorted({d.node for d in self.devices})
        flows = dict(model.link_flows)
        self.symmetric = len({flows.get((a, b), 1) for i, a in enumerate(nodes) for b in nodes[i + 1:]}) <= 1
        self._dead: set[tuple[int, Units, bytes]] = set()

    # Memory: which cuts a prefix can reach ------------------------------------------------------
    def _reach(self, reach: Mask, q: int, device_type: DeviceType) -> Mask:
        """Cuts the stage after q can start at, when stage q on `device_type` starts at one of `reach`."""
        time_const, time_prefix, mem_const, mem_prefix, held, cap = self.tables.own(device_type, q)
        memory = (mem_const + mem_prefix)[None, :] - mem_prefix[:, None]
        if q > 0:
            memory = memory + (held * np.array(self.tables.cut + (0,), dtype=float))[:, None]
        ok = (memory <= cap) & _UPPER[self.n] & reach[:, None]
        out: Mask = np.asarray(ok.any(axis=0))
        out[self.n - (self.k - q - 1) + 1:] = False  # the later stages need a segment each
        return out

    def _fits_rest(self, q: int, reach: Mask, remaining: Units) -> bool:
        """Whether the types `remaining` (a sorted tuple of (types of a unit, count)) can take
        the stages from q on, starting at a cut in `reach`.

        Returns:
            Whether they can.
        """
        if not reach.any():
            return False
        if not remaining:
            return bool(reach[self.n])
        key = (q, remaining, reach.tobytes())
        if key in self._dead:
            return False
        for i, (types, count) in enumerate(remaining):
            r = reach
            for j, t in enumerate(types):
                r = self._reach(r, q + j, t)
            rest = remaining[:i] + ((types, count - 1),) * (count > 1) + remaining[i + 1:]
            if self._fits_rest(q + len(types), r, rest):
                return True
        self._dead.add(key)
        return False

    def _units_left(self, used: dict[PoolKey, int]) -> Units:
        """The remaining units' types as a sorted tuple of (types, count)."""
        counts: dict[tuple[DeviceType, ...], int] = {}
        if self.blocks:
            for key, pool in self.pools.items():
                if used.get(key, 0) < len(pool):  # a node's devices go together: all placed, or none
                    types = tuple(d.type for d in pool)
                    counts[types] = counts.get(types, 0) + 1
        else:
            for key, pool in self.pools.items():
                left = len(pool) - used.get(key, 0)
                if left:
                    counts[(pool[0].type,)] = counts.get((pool[0].type,), 0) + left
        return tuple(sorted(counts.items(), key=lambda kv: [t.name for t in kv[0]] + [kv[1]]))

    def fits(self) -> bool:
        """Whether some order fits the devices' memory (with some cut)."""
        if self.k > self.n:
            return False
        start = np.zeros(self.n + 1, dtype=bool)
        start[0] = True
        return self._fits_rest(0, start, self._units_left({}))

    # Time: the best order -----------------------------------------------------------------------
    def best_order(self) -> tuple[float, tuple[Device, ...]] | None:
        """(slowest stage, order) of the best order that fits, or None if none does.

        The orders are walked in their sequence and the first within 1e-12 of the best kept, as
        trying them one by one keeps it; the bound cuts off a prefix that cannot come within
        1e-12 of the best found, which starts as the best of a few orders (fastest devices first,
        slowest first, most memory first), so that it cuts from the start.

        Returns:
            The pair, or None.
        """
        if self.k > self.n or not self.fits():
            return None
        speeds = self._speeds()
        work = np.concatenate([[0.0], np.cumsum(self._segment_times(self.devices[0].type))])
        total_speed = sum(speeds[d.type.name] for d in self.devices)
        seeds = [(self._value(order), order) for order in self._seed_orders(speeds)]
        best = min(seeds, key=lambda s: s[0])
        least = [best[0]]  # the least value known
        # (value, order) of the orders reached within 1e-12 of the least known then, in sequence
        within: list[tuple[float, tuple[Device, ...]]] = []
        extended = [0]
        arrays: dict[int, Floats] = {}  # q -> best[c] over cuts c where stage q starts, along the current prefix

        def visit(prefix: tuple[Device, ...]) -> bool:
            top = len(prefix) - 1
            added = len(self.pools[(prefix[-1].node, prefix[-1].type.name)]) if self.blocks else 1
            for q in range(top + 1 - added, top + 1):  # the positions before are the parent's
                arrays[q] = self._extend(arrays, prefix, q)
                extended[0] += 1
            f = arrays[top]
            if top == self.k - 1:
                value = float(np.maximum(f, self._last_stage(prefix)).min())
                if value <= least[0] + 1e-12:
                    within.append((value, prefix))
                    least[0] = min(least[0], value)
                return False
            if self.budget is not None and extended[0] >= self.budget and least[0] < math.inf:
                return False
            left = total_speed - sum(speeds[d.type.name] for d in prefix[:-1])  # stage `top` on
            bound = float(np.maximum(f, (work[self.n] - work) / left).min()) if left > 0 else float(f.min())
            if bound > least[0] + 1e-12:
                return False
            reach = self._reach(np.isfinite(f), top, prefix[top].type)
            return self._fits_rest(top + 1, reach, self._units_left(self._used(prefix)))

        self._walk(visit)
        found = next(((v, o) for v, o in within if v <= least[0] + 1e-12), None)
        if found is None and best[0] < math.inf:  # the walk stopped by its budget before reaching it
            found = best
        return found

    def _seed_orders(self, speeds: dict[str, float]) -> list[tuple[Device, ...]]:
        """A few orders among those searched: devices (beyond MAX_ORDERS: nodes) fastest first,
        slowest first, and with the most memory first.

        Returns:
            The orders.
        """
        units = list(self.pools.values()) if self.blocks else [[d] for d in self.devices]
        out: list[tuple[Device, ...]] = []
        keys: tuple[Callable[[list[Device]], Any], ...] = (
            lambda u: -speeds[u[0].type.name], lambda u: speeds[u[0].type.name],
            lambda u: (-u[0].type.memory, -speeds[u[0].type.name]))
        for key in keys:
            ordered = sorted(units, key=key)
            taken: dict[tuple[str, str], int] = {}
            order: list[Device] = []  # each (node, type)'s devices in their pool's order
            for unit in ordered:
                for d in unit:
                    pool = (d.node, d.type.name)
                    order.append(self.pools[pool][taken.get(pool, 0)] if not self.blocks else d)
                    taken[pool] = taken.get(pool, 0) + 1
            out.append(tuple(order))
        return out

    def _value(self, order: Sequence[Device]) -> float:
        """The slowest stage of the best cut of `order`, inf if none fits."""
        arrays: dict[int, Floats] = {}
        for q in range(self.k):
            arrays[q] = self._extend(arrays, order, q)
        return float(np.maximum(arrays[self.k - 1], self._last_stage(order)).min())

    def _extend(self, arrays: dict[int, Floats], prefix: Sequence[Device], q: int) -> Floats:
        """best[c] where stage q starts, from stage q - 1's (every device up to q known)."""
        start: Floats = np.full(self.n + 1, math.inf)
        if q == 0:
            start[0] = 0.0
            return start
        time, memory = self.tables.stage_times(q - 1, prefix[q - 1], prefix[q - 2] if q > 1 else None, prefix[q])
        stage = np.where(memory <= self.tables.own(prefix[q - 1].type, q - 1)[5], time, math.inf)
        f: Floats = np.maximum(arrays[q - 1][:, None], stage).min(axis=0)
        f[self.n - (self.k - q) + 1:] = math.inf  # the later stages need a segment each
        return f

    def _last_stage(self, prefix: Sequence[Device]) -> Floats:
        q = self.k - 1
        time, memory = self.tables.stage_times(q, prefix[q], prefix[q - 1] if q > 0 else None, None)
        return np.where(memory[:, self.n] <= self.tables.own(prefix[q].type, q)[5], time[:, self.n], math.inf)

    def _used(self, prefix: Iterable[Device]) -> dict[PoolKey, int]:
        """How many devices of each (node, type) `prefix` places."""
        used: dict[PoolKey, int] = {}
        for d in prefix:
            key = (d.node, d.type.name)
            used[key] = used.get(key, 0) + 1
        return used

    def _speeds(self) -> dict[str, float]:
        """Per device type: its best speed on any segment relative to the reference type (the
        worker's first), 1 / min over segments of (its time / the reference's).

        Returns:
            The speeds by type.
        """
        ref = self._segment_times(self.devices[0].type)
        out: dict[str, float] = {}
        for d in self.devices:
            if d.type.name not in out:
                ratios = [m / r for m, r in zip(self._segment_times(d.type), ref) if r > 0]
                slowest = min(ratios) if ratios else 0.0
                out[d.type.name] = 1.0 / slowest if slowest > 0 else math.inf
        return out

    def _segment_times(self, device_type: DeviceType) -> Floats:
        times: Floats = np.diff(self.tables.own(device_type, 0)[1])
        return times

    def _walk(self, visit: Callable[[tuple[Device, ...]], bool]) -> None:
        """The orders' prefixes in distinct_orders' sequence, skipping a sibling that only swaps
        two nodes the links cannot tell apart (a node of the previous device differs from both)."""
        def signature(prefix: Sequence[Device], key: PoolKey, left: int) -> Hashable:
            if not self.symmetric or (prefix and prefix[-1].node == key[0]):
                return key
            return (key[1], left)

        _walk_orders(self.pools, self.blocks, signature, visit)


def least_slowest_stage(model: CostModel, devices: Sequence[Device], num_in_flight: int = 1) -> float:
    """A lower bound on the slowest stage of every cut of the model over every order of `devices`
    at `num_in_flight`, without cutting: the segments' time spread over the devices at their best
    speed on any segment (the order search's bound before any device is placed).

    Returns:
        The bound, in seconds.
    """
    search = _OrderSearch(model, devices, num_in_flight)
    speeds = search._speeds()
    total = float(search._segment_times(search.devices[0].type).sum())
    return total / sum(speeds[d.type.name] for d in search.devices)


def fits_some_order(model: CostModel, devices: Sequence[Device], num_in_flight: int) -> bool:
    """Whether some order of `devices` among those :func:`best_partition` searches, with some
    cut, fits their memory.

    Returns:
        Whether one fits.
    """
    return _OrderSearch(model, devices, num_in_flight).fits()


def best_partition(model: CostModel, devices: Sequence[Device], num_in_flight: int, method: str = "milp"
                   ) -> Partition:
    """The best partition over the orders of the devices (as the extended HetPipe does; :class:`_OrderSearch`): the
    orders are searched by branch and bound on the dynamic program, and `method` ("milp", §7's
    MILP, or "dp") then cuts the best order, so that the MILP runs once, where it decides.

    Returns:
        The Partition of the best order.
    """
    solve = {"milp": partition_milp, "dp": partition_dp}[method]
    found = _OrderSearch(model, devices, num_in_flight).best_order()
    if found is None:  # the first order's error, as when every order was tried one by one
        return solve(model, tuple(d for pool in _pools(devices).values() for d in pool), num_in_flight)
    return solve(model, found[1], num_in_flight)
