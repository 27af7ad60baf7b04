"""Grouping a cluster's devices into virtual workers (HetPipe §8.1).

Pure Python. The paper's three policies, written for any cluster of nodes that
each hold devices of one type:

* **NP** (node partition): a virtual worker's devices all come from one node, so
  workers are homogeneous inside and communicate over intra-node links, but
  differ from each other (stragglers).
* **ED** (equal distribution): every node gives each virtual worker the same
  number of devices, so all workers have the same resources.
* **HD** (hybrid distribution): nodes are grouped in groups of ``group_size``
  (2 in the paper); each group's nodes give its workers equal shares. The grouping
  is the one whose workers are most alike "in terms of aggregated computation
  capability and amount of GPU memory" (§8.1): it minimises the relative spread of
  per-worker compute plus the relative spread of per-worker memory. On the paper's
  cluster this picks VVQQ and RRGG (Table 3).

Compute capability is a device type's peak TFLOP/s, or its speed relative to this host for
the devices the host serves (emulated ones and the host CPU) and for accelerators given without a
peak, whose speed is measured on the model (:func:`hetpipe_tf.planning.profile.measured_cluster`).

For ``auto`` (beyond the paper): :func:`candidate_allocations` lists every allocation the
policies make at every worker size and HD group size, and :func:`mixed_allocations` those of
workers of several compositions (:func:`compositions`: one or two device types), given each
composition's predicted rate.
"""
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.planning.cluster import Cluster, Device, DeviceType
from hetpipe_tf.planning.milp import Program

#: A virtual worker's devices, and an allocation's workers.
Worker = tuple[Device, ...]
Workers = tuple[Worker, ...]
#: A worker's device types and how many of each: ((type name, count), ...), sorted.
Composition = tuple[tuple[str, int], ...]
#: A kind of group of nodes: the kinds (indices) of its nodes, sorted.
GroupKind = tuple[int, ...]
#: (least compute, greatest compute, least memory, greatest memory) of workers.
Extremes = tuple[float, float, float, float]
#: One step of HD's walk: (the group's nodes, extremes after it, nodes taken of each kind after it,
#: the group's kind, the least score of a grouping that starts so).
Child = tuple[list[int], Extremes, tuple[int, ...], GroupKind, float]

POLICIES = ("np", "ed", "hd")


class AllocationError(HetPipeUsageError, ValueError):
    """A policy that cannot be applied to a cluster as asked."""


def _compute(device_type: DeviceType) -> float:
    """A device's compute as HD compares workers' (§8.1): an emulated one's speed, a real one's peak,
    or, without a peak, its speed measured on the model against this host's CPU.

    Returns:
        The compute, in the unit described.

    Raises:
        AllocationError: the type gives neither a speed nor a peak.
    """
    speed = device_type.host_speed  # set for every type on the host
    if speed is not None:
        return speed
    if device_type.peak_tflops is not None:
        return device_type.peak_tflops
    if device_type.measured_speed is None:
        raise AllocationError(f"device type {device_type.label!r} gives no peak_tflops, by which HD compares the "
                              f"workers' compute, and has no speed measured on the model yet: give peak_tflops in "
                              f"the cluster description, plan with the model's times for it (measured on a "
                              f"machine with the device), or use the NP or ED policy")
    return device_type.measured_speed


def _one_measure(cluster: Cluster) -> None:
    """HD compares compute in one unit: peak TFLOP/s for every accelerator, or speeds relative to this
    host (emulated devices, the host CPU, accelerators measured here) for every type.

    Raises:
        AllocationError: the types mix peaks and measured speeds.
    """
    peaks = sorted(t.name for t in cluster.device_types.values() if t.peak_tflops is not None)
    measured = sorted(t.name for t in cluster.device_types.values() if t.peak_tflops is None)
    if peaks and measured and any(cluster.device_types[n].measured for n in measured):
        raise AllocationError(f"HD compares the workers' compute in one unit: device types {peaks} give a "
                              f"peak_tflops, {measured} a speed measured on this host: give every accelerator type "
                              f"a peak_tflops, or none, or use the NP or ED policy")


def _spread(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def _by_node(cluster: Cluster) -> dict[str, list[Device]]:
    out: dict[str, list[Device]] = {}
    for d in cluster.devices():
        out.setdefault(d.node, []).append(d)
    return out


def node_partition(cluster: Cluster, vw_size: int | None = None) -> Workers:
    """NP (§8.1): each node's devices make workers of `vw_size` (default: the smallest node's count)."""
    nodes = _by_node(cluster)
    size = vw_size or min(len(v) for v in nodes.values())
    workers: list[Worker] = []
    for devices in nodes.values():
        workers += [tuple(devices[i:i + size]) for i in range(0, len(devices) - size + 1, size)]
    if not workers:
        raise AllocationError(f"NP: no node has {size} devices for a virtual worker")
    return tuple(workers)


def _equal_shares(node_devices: Mapping[str, list[Device]], num_workers: int, policy: str) -> Workers:
    """Each of `num_workers` workers gets the same number of devices from every node."""
    for node, devices in node_devices.items():
        if len(devices) % num_workers:
            raise AllocationError(f"{policy}: node '{node}' has {len(devices)} devices, which do not split "
                                  f"equally over {num_workers} virtual workers")
    return tuple(tuple(d for devices in node_devices.values()
                       for d in devices[w * len(devices) // num_workers:(w + 1) * len(devices) // num_workers])
                 for w in range(num_workers))


def equal_distribution(cluster: Cluster, vw_size: int | None = None) -> Workers:
    """ED (§8.1): every worker gets the same share of every node's devices."""
    nodes = _by_node(cluster)
    total = sum(len(v) for v in nodes.values())
    num_workers = total // vw_size if vw_size else min(len(v) for v in nodes.values())
    if vw_size and total % vw_size:
        raise AllocationError(f"ED: {total} devices do not make virtual workers of {vw_size}")
    return _equal_shares(nodes, num_workers, "ED")


def hybrid_distribution(cluster: Cluster, vw_size: int | None = None, group_size: int = 2,
                        first_in_order: bool = True) -> Workers:
    """HD: the most alike workers (§8.1), of the first grouping in the order of the recursion that
    puts the first node left in a group with each combination of the others (itertools'
    order), then groups the rest.

    A grouping's score depends only on its workers' compute and memory, that is on how many
    groups of each kind it makes (a node's kind: its device type and device count; a group's
    kind: its nodes' kinds; a group's workers are equal), and the scores' means on the cluster
    alone. The groupings are walked as a tree in that order; of groups that take the same kinds
    of node only the first is tried (it takes each kind's first nodes; the others make the same
    groupings with nodes swapped, later), so the nodes left of each kind are its last ones. A subtree is cut off when
    its groups, with the range any group gives each kind of node left, spread at least as much
    as the best grouping found, or when its state (nodes left per kind, extremes made) improved
    on nothing before. Where that walk visits more than HD_STATES states, the least score is
    instead an integer program over the counts of each kind of group (:func:`_least_spread`,
    HiGHS), and the grouping is built group by group, each the first with which the nodes left
    can still be grouped at that score (the same bound first, then the last solution, then the
    program). Scores within 1e-9 (relative) count as ties.

    The walk's work grows with its states (at most the product over node kinds of their counts
    + 1, times the extremes), the program's with H / group size steps of at most one small
    integer program per kind of group: neither with the number of groupings. With
    `first_in_order` False (``auto``'s candidates, which are all planned and compared by their
    prediction), a grouping alike enough will do: the walk's best after HD_STATES / 8 states
    (not proven the most alike), or, if it found none by then, the program's first solution.

    Returns:
        The virtual workers.

    Raises:
        AllocationError: the nodes do not form groups of the size asked, or no grouping gives
            equal workers.
    """
    _one_measure(cluster)
    nodes = _by_node(cluster)
    names = list(nodes)
    size = vw_size or min(len(v) for v in nodes.values())  # as NP and ED (k = 4 in the paper)
    if len(names) % group_size:
        raise AllocationError(f"HD: {len(names)} nodes do not form groups of {group_size}")
    hd = _Grouping(nodes, size, group_size)
    failed = AllocationError(f"HD: no grouping of the nodes {names} into groups of {group_size} gives equal "
                             f"virtual workers of {size} devices")
    if len(hd.reach) < len(hd.kinds):  # some node is in no group that gives equal workers
        raise failed
    groups = hd.walk(settle=not first_in_order) or hd.build(first_in_order)
    if groups is None:
        raise failed
    return tuple(w for g in groups for w in _equal_shares(
        {names[i]: nodes[names[i]] for i in g}, sum(len(nodes[names[i]]) for i in g) // size, "HD"))


HD_STATES = 2000


class _Grouping:
    """The search of :func:`hybrid_distribution` over one cluster's nodes."""

    def __init__(self, nodes: dict[str, list[Device]], vw_size: int, group_size: int) -> None:
        self.names, self.vw_size, self.size = list(nodes), vw_size, group_size
        kind_of = [(nodes[n][0].type.name, len(nodes[n])) for n in self.names]
        self.kinds = list(dict.fromkeys(kind_of))
        self.members = [[i for i, k in enumerate(kind_of) if k == kind] for kind in self.kinds]
        self.types = {d.type.name: d.type for v in nodes.values() for d in v}
        devices = [d for v in nodes.values() for d in v]
        count = max(1, len(devices) // vw_size)
        self.means = (sum(_compute(d.type) for d in devices) / count, sum(d.type.memory for d in devices) / count)
        self.nodes = nodes
        self.group_kinds: dict[GroupKind, tuple[float, float]] = {}
        # node kind -> least and greatest (compute, memory) of a worker of any group with it
        self.reach: dict[int, Extremes] = {}
        sizes = sorted({c for _, c in self.kinds})  # whether a group gives equal workers depends on its counts
        nodes_of_size = [sum(len(m) for k, m in zip(self.kinds, self.members) if k[1] == c) for c in sizes]
        if not any(self._equal([sizes[i] for i in g]) for g in _kind_groups(range(len(sizes)), group_size,
                                                                             nodes_of_size)):
            return
        for g in _kind_groups(range(len(self.kinds)), group_size, [len(m) for m in self.members]):
            values = self._values(g)
            if values is None:
                continue
            self.group_kinds[g] = values
            for k in set(g):
                lo_c, hi_c, lo_m, hi_m = self.reach.get(k, (values[0], values[0], values[1], values[1]))
                self.reach[k] = (min(lo_c, values[0]), max(hi_c, values[0]), min(lo_m, values[1]),
                                 max(hi_m, values[1]))

    def _equal(self, counts: Sequence[int]) -> bool:
        """Whether nodes of these device counts give equal workers of vw_size."""
        total = sum(counts)
        return total % self.vw_size == 0 and all(c % (total // self.vw_size) == 0 for c in counts)

    def _values(self, group: GroupKind) -> tuple[float, float] | None:
        """(compute, memory) of each worker of a group of nodes of these kinds (its workers are
        equal), or None when they do not give equal workers of vw_size.

        Returns:
            The pair, or None.
        """
        if not self._equal([self.kinds[k][1] for k in group]):
            return None
        share = sum(self.kinds[k][1] for k in group) // self.vw_size
        return (sum(self.kinds[k][1] // share * _compute(self.types[self.kinds[k][0]]) for k in group),
                sum(self.kinds[k][1] // share * self.types[self.kinds[k][0]].memory for k in group))

    def _children(self, offsets: tuple[int, ...], extremes: Extremes | None) -> list[Child]:
        """(nodes, extremes after, offsets after, kind, bound) of every group for the first node
        left, in the walk's order, the first of those with the same kinds of node only; bound:
        the least score of a grouping that starts so (the range of the nodes left counted).

        Returns:
            The tuples.
        """
        first = min((k for k in range(len(self.kinds)) if offsets[k] < len(self.members[k])),
                    key=lambda k: self.members[k][offsets[k]])
        after = list(offsets)
        after[first] += 1
        out: list[tuple[list[int], list[int], Extremes, tuple[int, ...], GroupKind, float]] = []
        for others in _kind_groups(range(len(self.kinds)), self.size - 1,
                                   [len(self.members[k]) - after[k] for k in range(len(self.kinds))]):
            kind = tuple(sorted((first,) + others))
            if kind not in self.group_kinds:
                continue
            taken, chosen = list(after), [self.members[first][offsets[first]]]
            for k in others:
                chosen.append(self.members[k][taken[k]])
                taken[k] += 1
            c, m = self.group_kinds[kind]
            now: Extremes = (c, c, m, m) if extremes is None else (min(extremes[0], c), max(extremes[1], c),
                                                          min(extremes[2], m), max(extremes[3], m))
            bound = now
            for k in range(len(self.kinds)):
                if taken[k] < len(self.members[k]):  # some group takes a node of kind k
                    lo_c, hi_c, lo_m, hi_m = self.reach[k]
                    bound = (min(bound[0], hi_c), max(bound[1], lo_c), min(bound[2], hi_m), max(bound[3], lo_m))
            chosen[1:] = sorted(chosen[1:])
            out.append((chosen[1:], chosen, now, tuple(taken), kind, _spread_of(bound, self.means)))
        return [child[1:] for child in sorted(out)]

    def _score(self, groups: Sequence[Sequence[int]]) -> float:
        workers = [w for g in groups for w in _equal_shares(
            {self.names[i]: self.nodes[self.names[i]] for i in g},
            sum(len(self.nodes[self.names[i]]) for i in g) // self.vw_size, "HD")]
        return _spread([sum(_compute(d.type) for d in w) for w in workers]) + _spread(
            [sum(d.type.memory for d in w) for w in workers])

    def walk(self, settle: bool = False) -> list[list[int]] | None:
        """The best grouping by the walk, or when it needs more than HD_STATES states, None (or, to
        `settle`, the best it found by then, if any).

        Returns:
            The grouping, or None.
        """
        best: list[float | None] = [None]  # the least score found
        best_groups: list[list[list[int]]] = []  # its grouping
        dead: set[tuple[tuple[int, ...], Extremes | None]] = set()
        path: list[list[int]] = []

        def visit(offsets: tuple[int, ...], extremes: Extremes | None) -> bool:
            if all(o == len(m) for o, m in zip(offsets, self.members)):
                score = self._score(path)
                if best[0] is None or score < best[0] - 1e-12:
                    best[0] = score
                    best_groups[:] = [list(path)]
                    return True
                return False
            if (offsets, extremes) in dead:  # the best only falls: what improved on nothing then cannot now
                return False
            if len(dead) >= (HD_STATES // 8 if settle else HD_STATES):
                raise _TooMany()
            improved = False
            for chosen, now, taken, _, bound in self._children(offsets, extremes):
                if best[0] is not None and bound * (1 - 1e-9) >= best[0] - 1e-12:
                    continue
                path.append(chosen)
                improved |= visit(taken, now)
                path.pop()
            if not improved:
                dead.add((offsets, extremes))
            return improved

        try:
            visit(tuple(0 for _ in self.kinds), None)
        except _TooMany:
            return best_groups[0] if settle and best_groups and best_groups[0] else None
        return best_groups[0] if best_groups else []

    def build(self, first_in_order: bool = True) -> list[list[int]] | None:
        """The best grouping by the integer program, or None if there is none: the first in the
        walk's order, or (not `first_in_order`) the program's first solution's.

        Returns:
            The grouping, or None.
        """
        left = [len(m) for m in self.members]
        least = _least_spread(self.group_kinds, left, None, self.means)
        if least is None:
            return None
        target, witness = least
        offsets: tuple[int, ...] = tuple(0 for _ in self.kinds)
        extremes: Extremes | None = None
        groups: list[list[int]] = []
        while any(o < len(m) for o, m in zip(offsets, self.members)):
            for chosen, now, taken, kind, bound in self._children(offsets, extremes):
                if bound > target * (1 + 1e-9) + 1e-12:
                    continue
                if witness.get(kind, 0) > 0:  # the last solution's other groups complete it
                    witness = {**witness, kind: witness[kind] - 1}
                elif not first_in_order:
                    continue
                else:
                    rest = [len(m) - t for m, t in zip(self.members, taken)]
                    found = _least_spread(self.group_kinds, rest, now, self.means)
                    if found is None or found[0] > target * (1 + 1e-9) + 1e-12:
                        continue
                    witness = found[1]
                groups.append(chosen)
                offsets, extremes = taken, now
                break
            else:
                return None
        return groups


class _TooMany(Exception):
    """The walk of HD's groupings passed HD_STATES states."""


def _spread_of(extremes: Extremes | None, means: tuple[float, float]) -> float:
    return 0.0 if extremes is None else sum((hi - lo) / mean for lo, hi, mean in
                                            ((extremes[0], extremes[1], means[0]), (extremes[2], extremes[3], means[1])))


def _least_spread(group_kinds: Mapping[GroupKind, tuple[float, float]], left: Sequence[int],
                  extremes: Extremes | None, means: tuple[float, float]
                  ) -> tuple[float, dict[GroupKind, int]] | None:
    """The least score (spread of compute plus spread of memory, :func:`_spread` with the
    cluster's means) of groupings of the nodes `left` (a count per node kind) into groups of
    the kinds of `group_kinds` ({kind: (compute, memory) of its workers}), beside workers whose
    extremes are `extremes` (lo compute, hi compute, lo memory, hi memory; None: none yet), and
    how many groups of each kind one such grouping makes; None if the nodes cannot be grouped.

    Returns:
        The score and the counts of groups, or None.
    """
    if not any(left):
        return _spread_of(extremes, means), {}
    kinds = [g for g in group_kinds if all(g.count(k) <= n for k, n in enumerate(left))]
    if not kinds:
        return None
    nk = len(kinds)
    values = np.array([[group_kinds[g][0] / means[0], group_kinds[g][1] / means[1]] for g in kinds])
    # variables: x (groups of each kind), u (kind used), then lo_c, hi_c, lo_m, hi_m (in units of the means)
    nvar = 2 * nk + 4
    program = Program(nvar)
    add = program.add

    for k, n in enumerate(left):
        add([(i, g.count(k)) for i, g in enumerate(kinds) if k in g], n, n)
    top = values.max(axis=0) + 1.0
    for i, g in enumerate(kinds):
        most = min(n // g.count(k) for k, n in enumerate(left) if k in g)
        add([(i, 1.0), (nk + i, -most)], -np.inf, 0)  # x <= most * u
        add([(nk + i, 1.0), (i, -1.0)], -np.inf, 0)  # u <= x
        for d in range(2):  # lo <= value where used, hi >= value where used
            add([(2 * nk + 2 * d, 1.0), (nk + i, top[d] - values[i, d])], -np.inf, top[d])
            add([(2 * nk + 2 * d + 1, 1.0), (nk + i, -values[i, d])], 0, np.inf)
    low = np.zeros(nvar)
    high = np.concatenate([np.full(nk, np.inf), np.ones(nk), np.full(4, np.inf)])
    if extremes is not None:
        scaled = (extremes[0] / means[0], extremes[1] / means[0], extremes[2] / means[1], extremes[3] / means[1])
        high[2 * nk], low[2 * nk + 1], high[2 * nk + 2], low[2 * nk + 3] = scaled
    cost = np.zeros(nvar)
    cost[2 * nk:] = [-1.0, 1.0, -1.0, 1.0]
    integrality = np.concatenate([np.ones(2 * nk), np.zeros(4)])
    x = program.solve(cost, integrality, low, high)
    if x is None:
        return None
    counts = {g: int(round(x[i])) for i, g in enumerate(kinds) if round(x[i]) > 0}
    used: list[tuple[float, float]] = [group_kinds[g] for g in counts]
    if extremes is not None:
        used += [(extremes[0], extremes[2]), (extremes[1], extremes[3])]
    found = (min(c for c, _ in used), max(c for c, _ in used), min(m for _, m in used), max(m for _, m in used))
    return _spread_of(found, means), counts


def _kind_groups(kinds: Iterable[int], size: int, available: Sequence[int]) -> list[GroupKind]:
    """Every multiset of `size` of `kinds` (at most `available[k]` of kind k), as tuples."""
    listed = list(kinds)
    out: list[GroupKind] = []

    def choose(i: int, left: int, picked: list[int]) -> None:
        if left == 0:
            out.append(tuple(picked))
        elif i < len(listed):
            for take in range(min(left, available[listed[i]]), -1, -1):
                choose(i + 1, left - take, picked + [listed[i]] * take)

    choose(0, size, [])
    return out


def allocate(cluster: Cluster, policy: str, vw_size: int | None = None, group_size: int = 2,
             first_in_order: bool = True) -> Workers:
    """Virtual workers (tuples of cluster devices) by `policy` (np, ed or hd; for HD's
    `first_in_order`, see :func:`hybrid_distribution`).

    Returns:
        The virtual workers.

    Raises:
        AllocationError: the policy is unknown, or cannot be applied to the cluster as asked.
    """
    chosen = policy.lower()
    if chosen == "np":
        return node_partition(cluster, vw_size)
    if chosen == "ed":
        return equal_distribution(cluster, vw_size)
    if chosen == "hd":
        return hybrid_distribution(cluster, vw_size, group_size, first_in_order)
    raise AllocationError(f"unknown allocation policy {policy!r}; allowed: {', '.join(POLICIES)} or auto")


def describe(workers: Iterable[Worker]) -> str:
    """'VVQQ VVQQ RRGG RRGG': each worker's device types."""
    return " ".join("".join(d.type.name for d in w) for w in workers)


def candidate_allocations(cluster: Cluster, max_size: int | None = None) -> list[tuple[str, Workers]]:
    """Every allocation the policies can make on `cluster` with workers of at most `max_size`
    devices (HD: any of its most alike groupings), labelled: part of the `auto` search space.

    Returns:
        The (label, workers) pairs.
    """
    nodes = _by_node(cluster)
    total = sum(len(v) for v in nodes.values())
    sizes = [s for s in range(1, min(total, max_size or total) + 1) if total % s == 0]
    seen: set[tuple[tuple[str, ...], ...]] = set()
    out: list[tuple[str, Workers]] = []
    for policy in POLICIES:
        groups = [g for g in range(2, len(nodes)) if len(nodes) % g == 0] if policy == "hd" else [2]
        for size in [None] + sizes:
            for g in groups:
                try:
                    workers = allocate(cluster, policy, size, g, first_in_order=False)
                except AllocationError:
                    continue
                key = tuple(sorted(tuple(sorted(d.name for d in w)) for w in workers))
                if key not in seen and all(len(w) == len(workers[0]) for w in workers) and (
                        max_size is None or len(workers[0]) <= max_size):
                    seen.add(key)
                    label = policy.upper() + "(" + ", ".join(
                        ([f"groups of {g}"] if policy == "hd" else []) + [f"workers of {len(workers[0])}"]) + ")"
                    out.append((label, workers))
    return out


def compositions(cluster: Cluster, max_size: int) -> list[Composition]:
    """Worker compositions (sorted tuples of (device type, count)) of one or two device types,
    each count a power of two or a node's device count, at most a node of that type holds, and
    at most `max_size` devices and a node's worth (the largest node's count; larger workers are the
    policies'): what `auto` mixes beside the policies' allocations.

    Returns:
        The compositions.
    """
    nodes = _by_node(cluster)
    most: dict[str, int] = {}
    for devices in nodes.values():
        t = devices[0].type.name
        most[t] = max(most.get(t, 0), len(devices))
    largest = min(max_size, max(most.values()))
    counts = {t: sorted({2 ** i for i in range(m.bit_length()) if 2 ** i <= m} | {len(v) for v in nodes.values()
                                                                                  if v[0].type.name == t})
              for t, m in most.items()}
    types = sorted(most)
    out: list[Composition] = [((t, c),) for t in types for c in counts[t] if c <= largest]
    for i, a in enumerate(types):
        for b in types[i + 1:]:
            out += [((a, ca), (b, cb)) for ca in counts[a] for cb in counts[b] if ca + cb <= largest]
    return out


def mixed_allocations(cluster: Cluster, rates: Mapping[Composition, float], limit: int = 3
                      ) -> list[tuple[str, Workers]]:
    """Allocations of virtual workers of several compositions (sizes and mixes of device types).

    `rates`: {composition: predicted minibatches/s of one worker of it}. Under a bounded
    staleness every worker goes at the slowest one's pace (§5), so W workers whose slowest goes
    at r are worth W·r: for each rate r, the most workers of compositions at least as fast that
    the cluster's devices hold (an integer program over how many workers of each composition;
    devices may stay idle), best W·r first, at most `limit` of them. Each worker's devices of a
    type come from one node where one has them free (the first such), else node by node.

    Returns:
        The allocations.
    """
    nodes = _by_node(cluster)
    have: dict[str, int] = {}
    for devices in nodes.values():
        have[devices[0].type.name] = have.get(devices[0].type.name, 0) + len(devices)
    usable = {c: r for c, r in rates.items() if r > 0 and all(n <= have.get(t, 0) for t, n in c)}
    found: list[tuple[float, dict[Composition, int]]] = []
    seen: set[tuple[tuple[Composition, int], ...]] = set()
    for r in sorted(set(usable.values()), reverse=True):
        chosen = [c for c in usable if usable[c] >= r]
        most_workers = sum(have.values()) // min(sum(n for _, n in c) for c in chosen)
        if len(found) >= limit and most_workers * r <= found[-1][0]:
            break
        counts = _most_workers(chosen, have)
        key = tuple(sorted(counts.items()))
        if not counts or key in seen:
            continue
        seen.add(key)
        found.append((sum(counts.values()) * r, counts))
        found.sort(key=lambda f: -f[0])
        del found[limit:]
    out: list[tuple[str, Workers]] = []
    for _, counts in found:
        label = "MIX(" + ", ".join(f"{k}x{''.join(t * n for t, n in c)}" for c, k in sorted(counts.items())) + ")"
        out.append((label, pack_workers(cluster, counts)))
    return out


def _most_workers(chosen: Sequence[Composition], have: Mapping[str, int]) -> dict[Composition, int]:
    """{composition: count} of the most workers of the `chosen` compositions the devices hold."""
    types = sorted(have)
    program = Program(len(chosen))
    for t in types:
        program.add([(i, dict(c).get(t, 0)) for i, c in enumerate(chosen)], 0, have[t])
    x = program.solve(-np.ones(len(chosen)), np.ones(len(chosen)), np.zeros(len(chosen)),
                      np.full(len(chosen), np.inf))
    if x is None:
        return {}
    return {c: int(round(v)) for c, v in zip(chosen, x) if round(v) > 0}


def pack_workers(cluster: Cluster, counts: Mapping[Composition, int]) -> Workers:
    """Workers of each composition in `counts` ({composition: how many}), the larger first, their
    devices of each type from the first node that has that many free, else node by node.

    Returns:
        The workers.
    """
    nodes = _by_node(cluster)
    free = {n: list(v) for n, v in nodes.items()}
    workers: list[Worker] = []
    for comp, k in sorted(counts.items(), key=lambda ck: (-sum(n for _, n in ck[0]), ck[0])):
        for _ in range(k):
            devices: list[Device] = []
            for t, n in comp:
                of_type = [name for name, v in free.items() if nodes[name][0].type.name == t]
                home = next((name for name in of_type if len(free[name]) >= n), None)
                for name in ([home] if home else of_type):
                    take = free[name][:n - len([d for d in devices if d.type.name == t])]
                    devices += take
                    del free[name][:len(take)]
            workers.append(tuple(devices))
    return tuple(workers)
