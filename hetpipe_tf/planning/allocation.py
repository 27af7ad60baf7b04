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
the devices the host serves (emulated ones and the host CPU).
"""
import itertools

POLICIES = ("np", "ed", "hd")


class AllocationError(ValueError):
    """A policy that cannot be applied to a cluster as asked."""


def _compute(device_type):
    return device_type.host_speed if device_type.on_host else device_type.peak_tflops


def _spread(values):
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def _by_node(cluster):
    out = {}
    for d in cluster.devices():
        out.setdefault(d.node, []).append(d)
    return out


def node_partition(cluster, vw_size=None):
    nodes = _by_node(cluster)
    size = vw_size or min(len(v) for v in nodes.values())
    workers = []
    for devices in nodes.values():
        workers += [tuple(devices[i:i + size]) for i in range(0, len(devices) - size + 1, size)]
    if not workers:
        raise AllocationError(f"NP: no node has {size} devices for a virtual worker")
    return tuple(workers)


def _equal_shares(node_devices, num_workers, policy):
    """Each of `num_workers` workers gets the same number of devices from every node."""
    for node, devices in node_devices.items():
        if len(devices) % num_workers:
            raise AllocationError(f"{policy}: node '{node}' has {len(devices)} devices, which do not split "
                                  f"equally over {num_workers} virtual workers")
    return tuple(tuple(d for devices in node_devices.values()
                       for d in devices[w * len(devices) // num_workers:(w + 1) * len(devices) // num_workers])
                 for w in range(num_workers))


def equal_distribution(cluster, vw_size=None):
    nodes = _by_node(cluster)
    total = sum(len(v) for v in nodes.values())
    num_workers = total // vw_size if vw_size else min(len(v) for v in nodes.values())
    if vw_size and total % vw_size:
        raise AllocationError(f"ED: {total} devices do not make virtual workers of {vw_size}")
    return _equal_shares(nodes, num_workers, "ED")


def hybrid_distribution(cluster, vw_size=None, group_size=2):
    nodes = _by_node(cluster)
    names = list(nodes)
    vw_size = vw_size or min(len(v) for v in nodes.values())  # as NP and ED (k = 4 in the paper)
    if len(names) % group_size:
        raise AllocationError(f"HD: {len(names)} nodes do not form groups of {group_size}")
    best = None
    for grouping in _groupings(names, group_size):
        workers = []
        for group in grouping:
            members = {n: nodes[n] for n in group}
            total = sum(len(v) for v in members.values())
            size = vw_size
            if total % size:
                break
            try:
                workers += _equal_shares(members, total // size, "HD")
            except AllocationError:
                break
        else:
            compute = [sum(_compute(d.type) for d in w) for w in workers]
            memory = [sum(d.type.memory for d in w) for w in workers]
            score = _spread(compute) + _spread(memory)
            if best is None or score < best[0] - 1e-12:
                best = (score, tuple(workers))
    if best is None:
        raise AllocationError(f"HD: no grouping of the nodes {names} into groups of {group_size} gives equal "
                              f"virtual workers of {vw_size} devices")
    return best[1]


def _groupings(items, size):
    """Every way to split `items` into unordered groups of `size`."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [x for x in rest if x not in others]
        for tail in _groupings(remaining, size):
            yield ((first,) + others,) + tail


def allocate(cluster, policy, vw_size=None, group_size=2):
    """Virtual workers (tuples of cluster devices) by `policy` (np, ed or hd)."""
    policy = policy.lower()
    if policy == "np":
        return node_partition(cluster, vw_size)
    if policy == "ed":
        return equal_distribution(cluster, vw_size)
    if policy == "hd":
        return hybrid_distribution(cluster, vw_size, group_size)
    raise AllocationError(f"unknown allocation policy {policy!r}; allowed: {', '.join(POLICIES)} or auto")


def describe(workers):
    """'VVQQ VVQQ RRGG RRGG': each worker's device types."""
    return " ".join("".join(d.type.name for d in w) for w in workers)


def candidate_allocations(cluster):
    """Every allocation the policies can make on `cluster`, labelled: the `auto` search space."""
    nodes = _by_node(cluster)
    total = sum(len(v) for v in nodes.values())
    sizes = [s for s in range(1, total + 1) if total % s == 0]
    seen, out = set(), []
    for policy in POLICIES:
        groups = [g for g in range(2, len(nodes)) if len(nodes) % g == 0] if policy == "hd" else [2]
        for size in [None] + sizes:
            for g in groups:
                try:
                    workers = allocate(cluster, policy, size, g)
                except AllocationError:
                    continue
                key = tuple(sorted(tuple(sorted(d.name for d in w)) for w in workers))
                if key not in seen and all(len(w) == len(workers[0]) for w in workers):
                    seen.add(key)
                    label = policy.upper() + (f"(groups of {g})" if policy == "hd" else "")
                    out.append((label, workers))
    return out

