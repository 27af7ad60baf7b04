"""Planning a cluster: virtual workers, partitions, Nm and predicted throughput (HetPipe §4, §7, §8.1).

Pure Python, over a :class:`hetpipe_tf.planning.profile.Profile`:

1. **allocation**: the devices are grouped into virtual workers by a policy (NP,
   ED, HD; :mod:`hetpipe_tf.planning.allocation`), or by ``auto`` (a search the paper
   does not do): every allocation the policies can make (every worker size and HD group
   size) and mixes of workers of different sizes and device types
   (:func:`hetpipe_tf.planning.allocation.mixed_allocations`), the best predicted
   throughput kept and the policies' own beside it (``Plan.alternatives``);
2. **partition**: each worker's model cut minimises its slowest stage under every
   stage's memory, over every distinct order of its devices
   (:mod:`hetpipe_tf.planning.partitioner`);
3. **Nm** (§4): Max_m of a worker is the largest Nm its memory admits; Nm is the
   minimum over workers; among 1..Nm the planner takes the smallest Nm whose
   predicted throughput is within 2 % of the best;
4. **prediction**: the workers' schedules run in the simulator with the cost
   model's times, under WSP with staleness bound D when there are several workers.
   Parameters are placed on one parameter server per node: ``default`` spreads the
   layers round-robin over them, ``local`` (ED only) keeps a stage's layers on the
   server of its own node, so pushes and pulls stay inside the node (§8.1). Transfers between
   nodes share each node's one inter-node link with the other workers that cross it at once
   (:func:`hetpipe_tf.planning.cost_model.link_flows`);
5. **minibatch sizes** (beyond the paper, optional): every worker trains the profile's batch
   size, or, with ``minibatch_sizes="proportional"``, a share of the global batch (the batch
   size times the number of workers) proportional to its predicted images/s alone, within its
   stages' memory at its cut and Nm (:mod:`hetpipe_tf.planning.uneven`); the prediction is
   then made again with every worker's stages costed at its own size.

**What it costs** (n segments, at most MAX_SEGMENTS; k devices per worker; W workers of S
distinct shapes (device types and which share a node); C of them simulated; Nm <= M = 16):

* work that is the same for many workers is done once: Max_m and the best partition per
  shape (and link sharing, and Nm), a worker's push and pull times per prediction, and in
  the simulator one worker for every set of workers with equal stage costs and push times
  (C <= W; for the policies on nodes of one type and count, C grows with the nodes that hold
  parameter servers, not with W);
* a partition is a branch and bound over the worker's distinct device orders (at most
  MAX_ORDERS, else the orders of its nodes) with an O(k n^2) dynamic program along each
  prefix, cut off by memory, by a bound and by nodes the links cannot tell apart; the MILP (if
  asked for) runs once, on the best order;
* a prediction simulates C workers for max(6 Nm, 32) minibatches: O(C k Nm) events, each
  O(log(C k)); a policy's plan is at most M predictions, O(S) partitions per Nm and the
  grouping (HD: its states, at most prod over node kinds of (count + 1), or one small integer
  program per group);
* ``auto`` plans the three policies' own allocations, then the others in the order of a bound
  on their throughput that needs no cut (the model's time spread over each worker's devices at
  their best speed) until it falls below the best found; an allocation is then cut off without
  simulating if no Nm's bound beats the best (:func:`pace_bounds`: the window predict measures,
  and under WSP the chain from a push to the merge that minibatch p + Nm waits for), and of
  its Nm only those whose bound beats the best and 0.98 of its own best are simulated. Its
  work is the policies' plus, per allocation tried, its bounds (its partitions and push
  times), and a plan for those not cut off. ``time_budget_s`` stops it with the best found.

Measured times are in benchmarks/README.md (planner_scale).
"""
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.pipeline.hetpipe import HETPIPE
from hetpipe_tf.pipeline.emulation import format_bytes
from hetpipe_tf.pipeline.instructions import (Backward, Forward, Instruction, Recompute, RecvActivation,
                                             RecvGradient)
from hetpipe_tf.pipeline.schedule import NO_SYNC, PipelineSchedule, SyncScheme
from hetpipe_tf.pipeline.simulator import SimulationResult, simulate_workers
from hetpipe_tf.planning.allocation import (POLICIES, AllocationError, allocate, candidate_allocations, compositions,
                                            describe, mixed_allocations, pack_workers)
from hetpipe_tf.planning.cost_model import CostModel, LinkModel, link_flows
from hetpipe_tf.planning.partitioner import InfeasiblePartitionError, best_partition, fits_some_order
from hetpipe_tf.planning.partitioner import Partition, least_slowest_stage, partition_of
from hetpipe_tf.planning.cluster import Cluster, Device
from hetpipe_tf.planning.profile import AnalyticAssumptions, Profile, coarsen, colocated, measured_cluster
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.planning.uneven import (UnevenMinibatchError, at_batch_size, check_sizes, memory_cap,
                                        proportional_sizes)
from hetpipe_tf.sync.wsp import WSP, ParameterServerModel

MAX_SEGMENTS = 48


class PlanError(HetPipeUsageError, ValueError):
    """A plan that cannot be made: the model does not fit, or the options conflict."""


@dataclass(frozen=True)
class WorkerPlan:
    """One virtual worker of a :class:`Plan`.

    Attributes:
        devices: its devices, in stage order.
        partition: its stages' layer ranges with their predicted times and memory.
        max_num_in_flight: Max_m, the largest Nm its devices' memory holds.
    """
    devices: tuple[Device, ...]
    partition: Partition
    max_num_in_flight: int

    @property
    def device_types(self) -> list[str]:
        """The type of each of the worker's devices, in stage order."""
        return [d.type.name for d in self.devices]


@dataclass(frozen=True)
class Plan:
    """What the planner decided for a request (§7, §8.1): the virtual workers, each with its
    devices, its stages' layer ranges and predicted times and memory (``workers``, one
    :class:`WorkerPlan` each), Nm, the placement of the global weights, each worker's minibatch
    size, and the predicted throughput (``minibatches_per_s``, ``images_per_s``, per worker and per
    Nm tried). ``format()`` prints it as ``hetpipe plan`` does, ``to_dict()`` as JSON; ``notes``
    say what was measured and what assumed. It is made by :func:`plan`, never by hand.

    Attributes:
        cluster: the :class:`hetpipe_tf.planning.cluster.Cluster` planned for.
        profile: the model's :class:`hetpipe_tf.planning.profile.Profile` it used.
        policy: the allocation policy that grouped the devices ("np", "ed" or "hd").
        placement: where the global weights are ("default" or "local").
        staleness_bound: D of WSP (§5), in waves.
        num_in_flight: Nm, the minibatches in each virtual worker's pipeline.
        workers: one :class:`WorkerPlan` per virtual worker.
        minibatches_per_s: the predicted throughput of the whole cluster.
        per_worker: the predicted minibatches/s of each worker.
        by_num_in_flight: Nm -> the predicted minibatches/s, for every Nm tried.
        notes: what was measured and what assumed.
        analytic: the AnalyticAssumptions of an analytic profile (None for a measured one).
        schedule: the pipelining schedule planned for.
        sync: the synchronisation scheme between the virtual workers.
        minibatch_sizes: each worker's minibatch size when uneven; () when all train the
            profile's batch size.
        alternatives: policy "auto": the other allocations it tried, beside the one it chose.
    """
    cluster: Cluster
    profile: Profile
    policy: str
    placement: str
    staleness_bound: int
    num_in_flight: int
    workers: tuple[WorkerPlan, ...]
    minibatches_per_s: float
    per_worker: tuple[float, ...]  # predicted minibatches/s of each worker in the cluster
    by_num_in_flight: dict[int, float]  # Nm -> predicted minibatches/s
    notes: tuple[str, ...]
    analytic: AnalyticAssumptions | None = None  # the AnalyticAssumptions the plan used
    schedule: PipelineSchedule = HETPIPE  # the PipelineSchedule planned for
    sync: SyncScheme = NO_SYNC  # the SyncScheme between its virtual workers
    minibatch_sizes: tuple[int, ...] = ()  # each worker's minibatch size when uneven; () when all train batch_size
    alternatives: tuple["Alternative", ...] = ()  # auto: Alternative allocations it tried, beside the one it chose

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each worker's minibatch size (the profile's batch size unless uneven)."""
        return self.minibatch_sizes or (self.profile.batch_size,) * len(self.workers)

    @property
    def allocation(self) -> str:
        """Each worker's device types in node order, as Table 3 writes them (VVQQ)."""
        order = [n.name for n in self.cluster.nodes]
        return describe([tuple(sorted(w.devices, key=lambda d: (order.index(d.node), d.index))) for w in self.workers])

    @property
    def images_per_s(self) -> float:
        """The predicted images/s of the cluster: each worker's minibatches/s times its minibatch size."""
        return sum(rate * size for rate, size in zip(self.per_worker, self.sizes))

    def node_boundaries(self, worker: int = 0) -> tuple[int, ...]:
        """First layer call of each stage of `worker`, for VirtualWorker(boundaries=...)."""
        part = self.workers[worker].partition
        return tuple(self.profile.starts[b] for b in part.boundaries)

    def host_pass_seconds(self, worker: int = 0) -> tuple[tuple[float, float], ...]:
        """Per stage of `worker`, the (forward, backward) seconds its passes take on this host by
        the profile the plan was made with: what an emulated device's pace is scaled from
        (:mod:`hetpipe_tf.pipeline.emulation`) when every system of a comparison emulates the same
        devices from one profile.

        Returns:
            The pairs, one per stage.

        Raises:
            ValueError: the profile has no times measured on this host, or the plan's minibatches are
                uneven (the profile times one size).
        """
        if "host" not in self.profile.times:
            raise ValueError(f"the profile of {self.profile.model} has no times measured on this host (it has "
                             f"{sorted(self.profile.times) or 'none'}); measure one with "
                             f"hetpipe_tf.runtime.profiler.measure_profile")
        if self.minibatch_sizes:
            raise ValueError(f"worker minibatches of {list(self.minibatch_sizes)} (uneven): the profile times "
                             f"minibatches of {self.profile.batch_size} only")
        times = self.profile.times["host"]
        return tuple(times.pass_seconds(*st.segments) for st in self.workers[worker].partition.stages)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data, as ``hetpipe plan --json`` prints it."""
        names = self.profile.layer_names
        workers = []
        for i, w in enumerate(self.workers):
            stages = []
            for st in w.partition.stages:
                first = self.profile.starts[st.segments[0]]
                end = (self.profile.starts[st.segments[1]] if st.segments[1] < self.profile.num_segments
                       else len(names))
                stages.append({
                    "device": st.device.name, "device_type": st.device.type.name,
                    "layers": [first, end - 1], "layer_names": [names[first], names[end - 1]] if names else [],
                    "time_ms": {"total": st.time * 1e3, "forward": st.forward * 1e3, "backward": st.backward * 1e3,
                                "receive": (st.recv_activation + st.recv_gradient) * 1e3, "apply": st.apply * 1e3,
                                "exchange": st.exchange * 1e3},
                    "replicas": [layer for layer, _, _ in self.profile.replicated(*st.segments)],
                    "memory_bytes": {**st.memory, "total": st.memory_total}, "capacity_bytes": st.capacity})
            workers.append({"index": i, "devices": [d.name for d in w.devices], "device_types": w.device_types,
                            "max_num_in_flight": w.max_num_in_flight, "minibatch_size": self.sizes[i],
                            "predicted_minibatches_per_s": self.per_worker[i], "stages": stages})
        return {"cluster": self.cluster.name, "model": self.profile.model, "batch_size": self.profile.batch_size,
                "uneven_minibatches": bool(self.minibatch_sizes),
                "policy": self.policy, "placement": self.placement, "staleness_bound": self.staleness_bound,
                "num_in_flight": self.num_in_flight, "allocation": self.allocation,
                "predicted_images_per_s": self.images_per_s,
                "predicted_minibatches_per_s": self.minibatches_per_s,
                "predicted_by_num_in_flight": {str(k): v for k, v in self.by_num_in_flight.items()},
                "virtual_workers": workers, "notes": list(self.notes),
                "alternatives": [{"policy": a.policy, "allocation": a.allocation,
                                  "predicted_images_per_s": a.images_per_s, "num_in_flight": a.num_in_flight,
                                  **({"error": a.error} if a.error else {})} for a in self.alternatives]}

    def format(self) -> str:
        """The plan as the table ``hetpipe plan`` prints."""
        d = self.to_dict()
        batch = (f"minibatches {'+'.join(map(str, self.sizes))} (uneven)" if self.minibatch_sizes
                 else f"batch {d['batch_size']}")
        lines = [f"{self.cluster.describe()}",
                 f"model {d['model']}, {batch}; policy {self.policy.upper()} "
                 f"({d['allocation']}), placement {self.placement}, D={self.staleness_bound}",
                 f"Nm = {self.num_in_flight}; predicted {self.images_per_s:.1f} images/s "
                 f"({self.minibatches_per_s:.3f} minibatches/s)", ""]
        for w in d["virtual_workers"]:
            lines.append(f"virtual worker {w['index']}: {''.join(w['device_types'])}  Max_m={w['max_num_in_flight']}"
                         f"  minibatch {w['minibatch_size']}"
                         f"  predicted {w['predicted_minibatches_per_s'] * w['minibatch_size']:.1f} images/s")
            lines.append(f"  {'stage':<5} {'device':<12} {'layers':<34} {'time ms':>9} {'memory':>11} {'capacity':>10}")
            for q, st in enumerate(w["stages"]):
                layers = f"{st['layers'][0]}..{st['layers'][1]} ({st['layer_names'][0]}..{st['layer_names'][1]})"
                lines.append(f"  {q:<5} {st['device']:<12} {layers[:34]:<34} {st['time_ms']['total']:>9.2f} "
                             f"{format_bytes(st['memory_bytes']['total']):>11} {format_bytes(st['capacity_bytes']):>10}")
        if self.alternatives:
            lines += ["", "beside it (auto):"] + [
                f"  {a.policy:<32} {a.allocation[:48]:<48} " + (f"cannot: {a.error[:60]}" if a.error else
                                                                f"Nm = {a.num_in_flight:<3} {a.images_per_s:.1f} images/s")
                for a in self.alternatives]
        lines += [""] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _max_num_in_flight(model: CostModel, devices: Sequence[Device], limit: int) -> int:
    """Max_m: the largest Nm <= limit that some order of these devices fits (0 if none).

    Memory grows with Nm, so the feasible Nm are 1..Max_m: a binary search.

    Returns:
        Max_m.
    """
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_some_order(model, devices, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _shape(devices: Iterable[Device]) -> tuple[tuple[str, int], ...]:
    """What a worker's costs depend on: its device types, and which devices share a node."""
    nodes: dict[str, int] = {}
    return tuple((d.type.name, nodes.setdefault(d.node, len(nodes))) for d in sorted(devices, key=lambda d: d.name))


class _Solved:
    """Max_m and best partitions by worker shape, shared by the allocations one plan() tries.

    Max_m depends on a worker's shape (its device types, and which devices share a node) and
    the synchronisation's weight copies; a best partition also on how many workers share each
    link between its nodes and Nm. In an allocation, every worker of a shape takes the
    partition solved for the first one, mapped onto its devices (identical workers, as in ED and
    HD, are solved once). A stage's time does not depend on Nm and its memory only grows with
    Nm, so a partition optimal for some Nm that still fits a larger Nm is optimal there too: it
    is reused, and the problem is solved again only when it no longer fits.
    """

    def __init__(self, method: str, max_num_in_flight: int) -> None:
        self.method, self.max_num_in_flight = method, max_num_in_flight
        self._max_m: dict[tuple[tuple[tuple[str, int], ...], str], int] = {}
        self._seen: dict[tuple[Any, int], Partition] = {}  # (worker shape and links, Nm) -> its best partition
        self._last: dict[Any, Partition] = {}  # worker shape and links -> the partition solved last

    def max_m(self, model: CostModel, devices: Sequence[Device]) -> int:
        key = (_shape(devices), model.sync.name)
        if key not in self._max_m:
            self._max_m[key] = _max_num_in_flight(model, devices, self.max_num_in_flight)
        return self._max_m[key]

    def partitions(self, model: CostModel, workers: Sequence[tuple[Device, ...]], nm: int) -> list[Partition]:
        """Every worker's partition at Nm, costed by `model`."""
        first: dict[tuple[tuple[str, int], ...], Partition] = {}
        out = []
        for w in workers:
            shape = _shape(w)
            if shape not in first:
                first[shape] = self._solve(model, w, nm)
            found = first[shape]
            order: Sequence[Device]
            if set(found.devices) != set(w):  # the same shape on other devices: map the order onto them
                by_role: dict[tuple[str, tuple[str, ...]], list[Device]] = {}
                for d in sorted(w, key=lambda d: d.name):
                    by_role.setdefault(_role(d, w), []).append(d)
                order = [by_role[_role(d, found.devices)].pop(0) for d in found.devices]
            else:
                order = found.devices
            out.append(partition_of(model, order, found.boundaries, nm))
        return out

    def _solve(self, model: CostModel, devices: Sequence[Device], nm: int) -> Partition:
        shape = _shape(devices)
        nodes: dict[str, int] = {}
        for d in sorted(devices, key=lambda d: d.name):
            nodes.setdefault(d.node, len(nodes))
        flows = dict(model.link_flows)
        shared = tuple(sorted(((nodes[a], nodes[b]), f) for (a, b), f in flows.items() if a in nodes and b in nodes))
        key = (shape, shared, model.sync.name)
        if (key, nm) not in self._seen:
            last = self._last.get(key)
            reused = partition_of(model, last.devices, last.boundaries, nm) if last is not None else None
            if (reused is not None and last is not None and last.num_in_flight < nm
                    and all(s.memory_total <= s.capacity for s in reused.stages)):
                self._seen[(key, nm)] = reused
            else:
                self._seen[(key, nm)] = best_partition(model, devices, nm, self.method)
            self._last[key] = self._seen[(key, nm)]
        return self._seen[(key, nm)]


def _role(device: Device, devices: Iterable[Device]) -> tuple[str, tuple[str, ...]]:
    """A device's type and the set of its worker's devices on the same node (by type)."""
    return (device.type.name, tuple(sorted(d.type.name for d in devices if d.node == device.node)))


def _push_times(model: CostModel, workers: Sequence[Partition], placement: str) -> list[tuple[float, ...]]:
    """Per worker, per stage: seconds to send its layers' update to their parameter servers (or
    pull them), one server per node (§8.1): ``default`` placement puts segment s on node
    s mod H, ``local`` on the stage's own node.

    The workers push a wave at about the same time, so the devices of other nodes that push
    the same segment to a server share that server's inter-node link (§8.1: one per node).

    Returns:
        The seconds, per worker and stage.
    """
    cluster, links, p = model.cluster, model.links, model.profile
    nodes = [n.name for n in cluster.nodes]
    host: dict[str, Device] = {}
    for d in cluster.devices():
        host.setdefault(d.node, d)
    # Per segment: how many stages hold it on each node.
    holders: list[dict[str, int]] = [{} for _ in range(p.num_segments)]
    for w in workers:
        for st in w.stages:
            for seg in range(*st.segments):
                holders[seg][st.device.node] = holders[seg].get(st.device.node, 0) + 1
    held = [sum(h.values()) for h in holders]
    pushed = p.server_bytes
    out = []
    for w in workers:
        times = []
        for st in w.stages:
            total = 0.0
            for seg in range(*st.segments):
                if not pushed[seg]:
                    continue
                server = st.device.node if placement == "local" else nodes[seg % len(nodes)]
                flows = held[seg] - holders[seg].get(server, 0)
                total += links.seconds(pushed[seg], st.device, host[server], cluster, flows=flows)
            times.append(total)
        out.append(tuple(times))
    return out


def _simulate(model: CostModel, workers: Sequence[Partition], num_in_flight: int, staleness_bound: int, placement: str,
              n: int, push: Sequence[tuple[float, ...]] | None = None,
              stages: Collection[int] | None = None) -> tuple[SimulationResult, list[int]]:
    """The workers' schedules in the simulator: (result, same_as), where same_as[w] is the
    worker whose agents in the result stand for worker w.

    Workers whose stages cost the same and whose pushes and pulls take as long run as one
    (:func:`hetpipe_tf.pipeline.simulator.simulate_workers`' ``same_as``): they meet the others
    only at the parameter servers, which get their requests at the same times, so one of them
    runs for all (exact).

    Returns:
        The pair.
    """
    push = push or _push_times(model, workers, placement)
    same_as: list[int] = []
    first: dict[Any, int] = {}
    for w, part in enumerate(workers):
        key = (tuple((st.forward, st.backward, st.apply, st.recv_activation, st.recv_gradient, st.exchange)
                     for st in part.stages),
               push[w])
        same_as.append(first.setdefault(key, w))
    programs = {}
    for k in sorted({len(w.stages) for w in workers}):
        programs[k] = model.schedule.programs(k, n, num_in_flight, sync=model.sync)
    schedules = [programs[len(w.stages)] for w in workers]
    per_instruction = model.profile.instruction_seconds

    def duration(agent: tuple[int, int], ins: Instruction) -> float:  # by the instruction's type only
        st = workers[agent[0]].stages[agent[1]]
        kind = type(ins)
        if kind is Forward or kind is Recompute:  # a forward pass again (GPipe, NaivePipe)
            return st.forward
        if kind is Backward:
            return st.backward
        if ins.applies():  # after the gradients of its tied layers' other replicas arrived
            return st.apply + st.exchange
        if kind in model.sync.apply_like or kind in model.schedule.apply_like:
            return st.apply
        link = st.recv_activation if kind is RecvActivation else st.recv_gradient if kind is RecvGradient else 0.0
        return link + per_instruction

    # A push or a pull moves the stage's weights to or from the servers.
    def transfer(agent: tuple[int, int], ins: Instruction) -> float:
        return push[agent[0]][agent[1]]

    servers = model.sync.simulation_model(staleness_bound, push_time=transfer, pull_time=transfer)
    # WSP's servers (and its family's) answer a pull once every worker pushed: how many workers ask
    # does not matter, so they hear from the workers that run only; other schemes' from all.
    counted = not isinstance(servers, ParameterServerModel)
    return simulate_workers(schedules, duration, parameter_servers=servers, same_as=same_as,
                            servers_hear_every_worker=counted, by_type=True, stages_recorded=stages), same_as


def predict(model: CostModel, workers: Sequence[Partition], num_in_flight: int, staleness_bound: int = 0,
            placement: str = "default", steps: int | None = None,
            push: Sequence[tuple[float, ...]] | None = None) -> tuple[float, tuple[float, ...]]:
    """Predicted minibatches/s of the cluster and of each worker, by simulation.

    `workers` are Partitions; with several, they synchronise by `model.sync` (WSP, §5), and
    in the long run every worker goes at the pace of the slowest (a finite staleness bound
    only lets the others run ahead by D waves), which is what each worker is given; under a
    scheme that bounds nothing (ASP) each goes at its own (:func:`long_run_pace`). `push`: the
    workers' push times (:func:`_push_times`) when already known.

    Returns:
        The cluster's and each worker's minibatches/s.
    """
    n = steps or _steps(num_in_flight)
    result, same_as = _simulate(model, workers, num_in_flight, staleness_bound, placement, n, push, stages={0})
    alone = {w: result.steady_throughput((w, 0)) for w in set(same_as)}
    per = long_run_pace(model.sync, [alone[same_as[w]] for w in range(len(workers))])
    return sum(per), per


def _steps(num_in_flight: int) -> int:
    """Minibatches per worker a prediction simulates."""
    return max(6 * num_in_flight, 32)


def pace_bounds(model: CostModel, workers: Sequence[Partition], num_in_flight: int, staleness_bound: int = 0,
                placement: str = "default",
                push: Sequence[tuple[float, ...]] | None = None) -> list[float] | None:
    """Upper bounds on each worker's pace as :func:`predict` gives it (minibatches/s), without
    simulating, for HetPipe's schedule (None for another).

    predict measures the completions of stage 0 between minibatch f = n // 4 and the last, n, a
    window of L = n - f minibatches. A minibatch's forward pass waits for the update Nm before it
    (§4), so every stage q runs whole minibatches f + Nm .. n inside the window: at least
    (L - Nm) x its time. Under WSP (§5, and its family) the forward pass of minibatch p + Nm, for
    p a multiple of Nm after a push, waits for the merge of the weights pulled after update p, so
    stage q's updates p and p + Nm are at least a chain apart: the push and pull instructions, the
    pull's transfer (and the push's when D = 0), the merge and the update (its apply time each),
    and p + Nm's forward and backward passes on q and every later stage; the window holds as many
    such chains as multiples p of Nm with f + Nm <= p <= n - Nm, less the last update's tail
    (2 instructions and an apply). Each worker's pace is at most L / the longest of these.

    Returns:
        The bounds, one per worker, or None.
    """
    if model.schedule is not HETPIPE:
        return None
    n = _steps(num_in_flight)
    window = n - max(1, n // 4)
    start = max(1, n // 4)
    waves = isinstance(model.sync, WSP)
    if waves:
        gate = model.sync.checked_bound(staleness_bound)
        chains = max(0, (n - num_in_flight) // num_in_flight - -(-(start + num_in_flight) // num_in_flight) + 1)
        pushed = push or _push_times(model, workers, placement)
    pi = model.profile.instruction_seconds
    out = []
    for w, part in enumerate(workers):
        least, later = 0.0, 0.0
        for q in reversed(range(len(part.stages))):
            st = part.stages[q]
            least = max(least, (window - num_in_flight) * st.time)
            if waves:
                chain = (2 * pi + pushed[w][q] + (pushed[w][q] if gate == 0 else pi) + 2 * st.apply + st.forward
                         + st.backward + later)
                least = max(least, chains * chain - 2 * pi - st.apply)
            later += st.forward + st.backward
        out.append(window / least if least > 0 else float("inf"))
    return out


def long_run_pace(sync: SyncScheme, alone: Sequence[float]) -> tuple[float, ...]:
    """Each worker's minibatches/s in the long run, of its simulated ones `alone`: the slowest's
    under a scheme that bounds staleness (:attr:`hetpipe_tf.pipeline.schedule.SyncScheme.bounded`),
    its own under one that does not.

    Returns:
        The paces, one per worker.
    """
    return tuple(alone) if not sync.bounded else (min(alone),) * len(alone)


def _at_sizes(model: CostModel, parts: Sequence[Partition], sizes: Sequence[int]) -> tuple[Partition, ...]:
    """`parts` with every worker's stages costed at its own minibatch size (the same cuts and Nm)."""
    out = []
    for p, b in zip(parts, sizes):
        at = replace(model, profile=at_batch_size(model.profile, b))
        out.append(Partition(devices=p.devices, boundaries=p.boundaries, num_in_flight=p.num_in_flight,
                             stages=tuple(at.stages(p.boundaries, p.devices, p.num_in_flight))))
    return tuple(out)


def uneven_sizes(model: CostModel, parts: Sequence[Partition],
                 minibatch_sizes: str | Sequence[int]) -> tuple[int, ...]:
    """Each worker's minibatch size (:mod:`hetpipe_tf.planning.uneven`): "proportional" splits a
    global batch of the profile's batch size times the number of workers by each worker's
    predicted images/s alone (simulated without the other workers) within its memory cap; a
    tuple is checked against the caps. Raises PlanError naming the worker that does not fit.

    Returns:
        The sizes, one per worker.

    Raises:
        PlanError: a worker cannot hold its share.
        UnevenMinibatchError: the sizes are not valid.
    """
    batch = model.profile.batch_size
    caps = [memory_cap(p, batch) for p in parts]
    names = [f"virtual worker {i} ({describe([p.devices])})" for i, p in enumerate(parts)]
    try:
        if isinstance(minibatch_sizes, str):
            if minibatch_sizes != "proportional":
                raise UnevenMinibatchError(f"unknown minibatch_sizes {minibatch_sizes!r}; allowed: None (every "
                                           f"worker the batch size), 'proportional', or one size per worker")
            alone = replace(model, sync=NO_SYNC)
            rates = [predict(alone, [p], p.num_in_flight)[0] * batch for p in parts]
            return proportional_sizes(rates, batch * len(parts), caps)
        sizes = tuple(minibatch_sizes)
        check_sizes(sizes, caps, names)
        return sizes
    except UnevenMinibatchError as e:
        raise PlanError(str(e)) from e


def _plan_workers(model: CostModel, workers: Sequence[tuple[Device, ...]], policy: str, placement: str,
                  staleness_bound: int, num_in_flight: int | None, solved: _Solved, notes: list[str],
                  minibatch_sizes: str | Sequence[int] | None = None, floor: float | None = None) -> "Plan | None":
    """The plan of one allocation: Max_m, Nm, partitions and prediction (steps 2-5 above). The Nm
    whose bound (:func:`pace_bounds`) is below 0.98 of the best found are not simulated: they
    could be neither the best nor chosen, so the plan is the one of simulating every Nm, its
    by_num_in_flight without them. With `floor` (auto): None if no Nm can predict more than `floor`
    minibatches/s, and the Nm whose bound cannot beat it are not simulated either.

    Returns:
        The plan's parts, or None.

    Raises:
        PlanError: the model does not fit, or the options conflict.
    """
    if placement == "local" and len({tuple(d.type.name for d in w) for w in workers}) > 1:
        raise PlanError("local placement keeps a stage's layers on its node's parameter server, which needs "
                        "every virtual worker to hold the same device types (ED)")
    max_m = []
    for w in workers:
        m = solved.max_m(model, w)
        if m == 0:
            try:
                best_partition(model, w, 1, solved.method)
            except InfeasiblePartitionError as e:
                raise PlanError(f"virtual worker {describe([w])} cannot train {model.profile.model}: {e}") from e
        max_m.append(m)
    limit = min(max_m)
    if num_in_flight is not None:
        if num_in_flight > limit:
            raise PlanError(f"Nm={num_in_flight} does not fit: the workers admit at most "
                            f"{dict(zip(describe(workers).split(), max_m))} (Max_m), so Nm <= {limit}")
        candidates = [num_in_flight]
    else:
        candidates = list(range(1, limit + 1))
    results: dict[int, tuple[float, tuple[float, ...], Sequence[Partition]]] = {}
    costed: dict[int, list[Partition]] = {}
    pushes: dict[int, list[tuple[float, ...]]] = {}

    def parts_at(nm: int) -> list[Partition]:
        if nm not in costed:
            costed[nm] = solved.partitions(model, workers, nm)
        return costed[nm]

    def push_at(nm: int) -> list[tuple[float, ...]]:
        if nm not in pushes:
            pushes[nm] = _push_times(model, parts_at(nm), placement)
        return pushes[nm]

    def tried(nm: int) -> float:
        if nm not in results:
            results[nm] = predict(model, parts_at(nm), nm, staleness_bound, placement, push=push_at(nm)) + (
                parts_at(nm),)
        return results[nm][0]

    def reached(nm: int) -> float:
        # No worker beats 1 / its slowest stage, a bound that only falls as Nm grows (a cut that
        # fits a larger Nm fits a smaller one): once it is reached, larger Nm cannot do better.
        return 0.999 * len(workers) * min(1.0 / p.bottleneck for p in parts_at(nm))

    bound = {}  # pace_bounds of each Nm: an Nm below 0.98 of the best is neither best nor chosen
    for nm in candidates:
        paces = pace_bounds(model, parts_at(nm), nm, staleness_bound, placement, push_at(nm))
        bound[nm] = sum(long_run_pace(model.sync, paces)) if paces and not minibatch_sizes else float("inf")
    if floor is not None and max(bound.values()) <= floor:
        return None
    last = candidates[-1]
    for nm in candidates:  # the loop of every Nm in turn stops once one reaches its bound: run it where it might
        if bound[nm] >= reached(nm) and tried(nm) >= reached(nm):
            last = nm
            break
    considered = [nm for nm in candidates if nm <= last]
    for nm in sorted(considered, key=lambda nm: -bound[nm]):
        if bound[nm] >= max([floor or 0.0] + [0.98 * v[0] for v in results.values()]):
            tried(nm)
    best = max([v[0] for v in results.values()], default=0.0)
    if floor is not None and best <= floor:
        return None
    for nm in considered:  # those left out that may still be within 2 % of the best
        if bound[nm] >= 0.98 * best:
            tried(nm)
    best = max(v[0] for v in results.values())
    chosen = min(nm for nm, v in results.items() if v[0] >= 0.98 * best)
    total, per, parts = results[chosen]
    sizes: tuple[int, ...] = ()
    if minibatch_sizes is not None:
        sizes = uneven_sizes(model, parts, minibatch_sizes)
        parts = _at_sizes(model, parts, sizes)
        total, per = predict(model, parts, chosen, staleness_bound, placement)
        notes = list(notes) + [f"uneven minibatches {list(sizes)} (global batch {sum(sizes)}): stage times "
                               f"scaled from batch {model.profile.batch_size}, task overheads kept"]
    plans = tuple(WorkerPlan(devices=p.devices, partition=p, max_num_in_flight=m) for p, m in zip(parts, max_m))
    return Plan(cluster=model.cluster, profile=model.profile, policy=policy, placement=placement,
                staleness_bound=staleness_bound, num_in_flight=chosen, workers=plans, minibatches_per_s=total,
                per_worker=per, by_num_in_flight={nm: v[0] for nm, v in results.items()}, notes=tuple(notes),
                analytic=model.analytic, schedule=model.schedule, sync=model.sync, minibatch_sizes=sizes)


@dataclass(frozen=True)
class _Settings:
    """What one plan() call plans with, beside the allocation."""
    profile: Profile
    cluster: Cluster
    links: LinkModel
    dilation: float
    optimizer_slots: int
    analytic: AnalyticAssumptions | None
    schedule: PipelineSchedule
    sync: SyncScheme
    placement: str
    staleness_bound: int
    num_in_flight: int | None
    minibatch_sizes: str | tuple[int, ...] | None

    def model(self, workers: Sequence[tuple[Device, ...]], several: bool | None = None) -> CostModel:
        """The CostModel of an allocation: its workers share links, and synchronise if several
        (`several`: whether to count them as several, whatever their number).

        Returns:
            The CostModel.
        """
        several = len(workers) > 1 if several is None else several
        return CostModel(self.profile, self.cluster, links=self.links, dilation=self.dilation,
                         optimizer_slots=self.optimizer_slots, schedule=self.schedule,
                         sync=self.sync if several else NO_SYNC, analytic=self.analytic,
                         link_flows=link_flows(workers))

    def plan(self, workers: Sequence[tuple[Device, ...]], label: str, solved: _Solved, notes: list[str],
             floor: float | None = None) -> "Plan | None":
        """The plan of one allocation, or PlanError (None below `floor`: see _plan_workers)."""
        placement = self.placement if len(workers) > 1 else "default"
        return _plan_workers(self.model(workers), workers, label, placement, self.staleness_bound,
                             self.num_in_flight, solved, notes, self.minibatch_sizes, floor)


def plan(profile: Profile, cluster: Cluster, request: PlanRequest = PlanRequest(), links: LinkModel | None = None,
         optimizer_slots: int = 1, analytic: AnalyticAssumptions | None = None) -> "Plan":
    """Plans training `profile`'s model on `cluster` as `request` asks; see the module docstring.

    Args:
      profile: a Profile (measured for emulated devices, analytic parts are added as needed).
      cluster: a Cluster.
      request: what the run asks for (:class:`hetpipe_tf.planning.request.PlanRequest`: the policy,
        worker size, Nm or None, D, placement or None, schedule, sync, minibatch sizes, dilation);
        the Plan holds what was decided for every field left to the planner.
      links: the LinkModel of the cluster's transfers (default: the cluster description's links).
      optimizer_slots: the optimizer's slots per weight (their memory is charged to every stage).
      analytic: AnalyticAssumptions for device types that are not measured.

    A model with a layer called in several places (tied weights: an input embedding used again
    for the logits) is planned twice: with cuts that may separate its calls (each stage that
    calls it holds a replica, exchanging their gradients every minibatch) and with its calls on
    one stage (:func:`hetpipe_tf.planning.profile.colocated`); the faster plan is returned, and
    a note says which it is and what the other predicted.

    Returns:
      The Plan.

    Raises:
      PlanError: no plan can be made: the policy cannot be applied to the cluster, the model does
        not fit the devices, or the options conflict.
    """
    costs = _Costs(links or LinkModel(), optimizer_slots, analytic)
    if not profile.shared_weights:
        return _plan(profile, cluster, request, costs)
    options: list[tuple[str, Plan | PlanError]] = []
    for label, p in (("with replicas allowed", profile), ("with each kept on one stage", colocated(profile))):
        try:
            options.append((label, _plan(p, cluster, request, costs)))
        except PlanError as e:
            options.append((label, e))
    planned = [(label, o) for label, o in options if isinstance(o, Plan)]
    if not planned:
        error = options[0][1]
        assert isinstance(error, PlanError)  # no option planned: each is its error
        raise error
    layers = [layer for layer, _, _ in profile.shared_weights]
    chosen = max((o for _, o in planned), key=lambda o: o.minibatches_per_s)
    other = next(f"the plan {label} " + (f"does not fit ({str(o).splitlines()[-1].strip()})" if not isinstance(o, Plan)
                                         else f"predicted {o.minibatches_per_s:.4g}")
                 for label, o in options if o is not chosen)
    note = (f"tied layers (each stage that calls one holds a replica): {_tied_placement(chosen, layers)}, predicted "
            f"{chosen.minibatches_per_s:.4g} minibatches/s; {other}")
    return replace(chosen, notes=chosen.notes + (note,))


def _tied_placement(plan: Plan, layers: Iterable[str]) -> str:
    """Where `plan` puts each of `layers` (called in several places): replicated on which stages
    of each worker, or on one stage.

    Returns:
        The placement by layer.
    """
    segments_of = {layer: segments for layer, segments, _ in plan.profile.shared_weights}
    parts = []
    for layer in layers:
        places = []
        for w, worker in enumerate(plan.workers):
            stages = sorted({q for q, st in enumerate(worker.partition.stages) for i in segments_of.get(layer, ())
                             if st.segments[0] <= i < st.segments[1]})
            if len(stages) > 1:
                places.append(f"worker {w}'s stages {', '.join(map(str, stages))}")
        parts.append(f"{layer} " + (f"replicated on {'; '.join(places)}" if places else "on one stage"))
    return ", ".join(parts)


@dataclass(frozen=True)
class _Costs:
    """What the cost model takes beside the request: the links, the optimizer's slots per weight
    and the assumptions for device types that are not measured."""
    links: LinkModel
    optimizer_slots: int
    analytic: AnalyticAssumptions | None


def _plan(profile: Profile, cluster: Cluster, request: PlanRequest, costs: _Costs) -> "Plan":
    """:func:`plan` of one profile."""
    cluster = measured_cluster(cluster, profile)  # HD compares measured accelerators by their speed
    notes = []
    if profile.num_segments > MAX_SEGMENTS:
        notes.append(f"{profile.num_segments} segments coarsened to {MAX_SEGMENTS} for the search "
                     f"(stages are cut only between merged segments)")
        profile = coarsen(profile, MAX_SEGMENTS)
    dilation = request.planned_dilation
    model = CostModel(profile, cluster, links=costs.links, dilation=dilation, optimizer_slots=costs.optimizer_slots,
                      analytic=costs.analytic)
    for name, t in profile.times.items():
        notes.append(f"times for {name}: {t.source}")
    for dtype in {d.type for d in cluster.devices()}:
        if not dtype.on_host and dtype.name not in profile.times:
            notes.append(model.times(dtype)[0].source)
    if cluster.emulated:
        notes.append(f"EMULATED devices: host times scaled by dilation {dilation:g} / speed")
    notes.append(f"links: {costs.links.source}")
    settings = _Settings(profile, cluster, costs.links, dilation, costs.optimizer_slots, costs.analytic,
                         cast(PipelineSchedule, request.schedule), cast(SyncScheme, request.sync),  # checked by it
                         request.placement_of_policy, request.staleness_bound,
                         request.num_in_flight, request.minibatch_sizes)
    solved = _Solved(request.method, request.max_num_in_flight)
    if request.workers is None and request.policy == "auto":
        return _auto(settings, solved, notes, request.time_budget_s)
    if request.workers is not None:
        label, group = "given", request.workers
    else:
        try:
            label, group = request.policy, allocate(cluster, request.policy, request.vw_size)
        except AllocationError as e:
            raise PlanError(str(e)) from e
    try:
        chosen = settings.plan(group, label, solved, notes)
    except PlanError as e:
        raise PlanError(f"no plan fits:\n{label} {describe(group)}: {e}") from e
    assert chosen is not None  # None only below a floor, and none was given
    return chosen


@dataclass(frozen=True)
class Alternative:
    """An allocation `auto` tried beside the one it chose: its policy, its workers' device types,
    and its prediction, or why it has none."""
    policy: str
    allocation: str
    minibatches_per_s: float = 0.0
    images_per_s: float = 0.0
    num_in_flight: int = 0
    error: str = ""


def _quick_bound(settings: _Settings, workers: Sequence[tuple[Device, ...]]) -> float:
    """An upper bound on the minibatches/s any Nm predicts for `workers`, without cutting: each
    worker's pace at most max over Nm of L / ((L - Nm) x its least slowest stage) (pace_bounds'
    first bound), its least slowest stage the model's time spread over its devices at their best
    speed (least_slowest_stage), combined as the synchronisation does; 0 if a worker has more
    devices than the model segments, inf for another schedule than HetPipe's.

    Returns:
        The bound.
    """
    if settings.schedule is not HETPIPE or settings.minibatch_sizes is not None:
        return float("inf")
    model = settings.model(workers)
    factor = 1.0
    for nm in range(1, 17):
        n = _steps(nm)
        window = n - max(1, n // 4)
        factor = max(factor, window / (window - nm))
    least = {}
    for w in workers:
        shape = _shape(w)
        if shape not in least:
            if len(w) > model.profile.num_segments:
                return 0.0
            least[shape] = min(least_slowest_stage(model, w, nm) for nm in (1, 2))
    return sum(long_run_pace(model.sync, [factor / least[_shape(w)] for w in workers]))


def _auto(settings: _Settings, solved: _Solved, notes: list[str], time_budget_s: float | None) -> Plan:
    """`auto`: the best predicted allocation of those the policies can make (every policy, worker
    size and HD group size) and of mixes of worker compositions (:func:`compositions`, one or two
    device types, :func:`mixed_allocations`), with the others' predictions beside it.

    The three policies' own allocations are planned first, as ``--policy`` plans them; the others
    in the order of their quick bound (:func:`_quick_bound`), until it falls to the best found,
    each cut off where no Nm's bound (:func:`pace_bounds`) beats the best, and cut by the dynamic
    program (the MILP's optimum, found faster: its cut may differ from the MILP's where two cuts
    are as slow).

    Returns:
        The best Plan, its alternatives beside it.

    Raises:
        PlanError: no allocation can be planned.
    """
    started = time.monotonic()
    cluster, profile = settings.cluster, settings.profile
    search = solved if solved.method == "dp" else _Solved("dp", solved.max_num_in_flight)
    tried, errors, best = [], [], None
    skipped = {"bound": 0, "budget": 0}

    def over_budget() -> bool:
        return time_budget_s is not None and time.monotonic() - started > time_budget_s

    def attempt(label: str, group: Sequence[tuple[Device, ...]], by: _Solved, floor: float | None = None) -> None:
        nonlocal best
        try:
            p = settings.plan(group, f"auto: {label}", by, notes, floor)
        except PlanError as e:
            errors.append(f"{label} {describe(group)}: {e}")
            tried.append((Alternative(label, describe(group), error=str(e)), group))
            return
        if p is None:  # no Nm's bound beats the best found
            skipped["bound"] += 1
            return
        tried.append((Alternative(label, p.allocation, p.minibatches_per_s, p.images_per_s, p.num_in_flight), group))
        if best is None or p.minibatches_per_s > best.minibatches_per_s:
            best = p

    fixed = []
    for policy in POLICIES:  # as --policy gives them: always planned, and printed beside the choice
        try:
            fixed.append((policy.upper(), allocate(cluster, policy)))
        except AllocationError as e:
            tried.append((Alternative(policy.upper(), "", error=str(e)), ()))
    for label, group in fixed:
        attempt(label, group, solved)
    seen = {_key(g) for _, g in fixed}
    pool = [(label, g) for label, g in candidate_allocations(cluster, max_size=profile.num_segments)
            if _key(g) not in seen]
    rates = {}
    for comp in compositions(cluster, profile.num_segments):
        if over_budget():
            break
        rates[comp] = _composition_rate(settings, search, comp)
    pool += [(label, g) for label, g in mixed_allocations(cluster, rates) if _key(g) not in seen]
    ranked = sorted(((_quick_bound(settings, g), i, label, g) for i, (label, g) in enumerate(pool)),
                    key=lambda r: (-r[0], r[1]))
    for i, (quick, _, label, group) in enumerate(ranked):
        if over_budget():
            skipped["budget"] = len(ranked) - i
            break
        if best is not None and quick <= best.minibatches_per_s:
            skipped["bound"] += len(ranked) - i  # ranked by this bound: none after can do better
            break
        attempt(label, group, search, floor=best.minibatches_per_s if best else None)
    if best is None:
        raise PlanError("no plan fits:\n" + "\n".join(errors))
    mine = _key(tuple(w.devices for w in best.workers))
    others = sorted((a for a, g in tried if _key(g) != mine or a.error), key=lambda a: (a.error != "", -a.minibatches_per_s))
    policies = {label for label, _ in fixed} | {p.upper() for p in POLICIES}
    beside = tuple([a for a in others if a.policy in policies] +
                   [a for a in others if a.policy not in policies and not a.error][:3])
    summary = (f"auto: {len(pool) + len(fixed)} allocations ({len(fixed)} as the policies give them, "
               f"{sum(1 for label, _ in pool if not label.startswith('MIX'))} more of the policies, "
               f"{sum(1 for label, _ in pool if label.startswith('MIX'))} mixes of {len(rates)} worker compositions); "
               f"{len(tried)} planned, {skipped['bound']} cut off by their bound"
               + (f", {skipped['budget']} not tried within the time budget of {time_budget_s:g} s" if skipped["budget"]
                  else "") + f", in {time.monotonic() - started:.1f} s")
    return replace(best, notes=best.notes + (summary,), alternatives=beside)


def _key(workers: Iterable[Iterable[Device]]) -> tuple[tuple[str, ...], ...]:
    return tuple(sorted(tuple(sorted(d.name for d in w)) for w in workers))


def _composition_rate(settings: _Settings, solved: _Solved, composition: Any) -> float:
    """The predicted minibatches/s of one worker of `composition` among others (under the
    synchronisation, packed onto the cluster's first free devices), from its best partition:
    1 / its slowest stage, or Nm / the sum of its stages' times when its memory admits fewer
    minibatches in flight than stages (the pipeline is then never full). 0 if it cannot hold
    the model.

    Returns:
        The minibatches/s.
    """
    (worker,) = pack_workers(settings.cluster, {composition: 1})
    if len(worker) > settings.profile.num_segments:
        return 0.0
    model = settings.model([worker], several=True)
    m = solved.max_m(model, worker)
    if m == 0:
        return 0.0
    nm = min(m, len(worker))
    (part,) = solved.partitions(model, [worker], nm)
    return min(1.0 / part.bottleneck, nm / sum(st.time for st in part.stages))


def simulate_plan(p: Plan, steps: int = 400) -> dict[str, Any]:
    """A plan's schedules in the simulator, longer than the planner runs them: a report dict
    with images/s, and per worker its devices' busy fractions and its average wait for pulled
    weights and idle time of its first stage during those waits (§8.4).

    Returns:
        The report.
    """
    model = CostModel(p.profile, p.cluster, schedule=p.schedule, sync=p.sync, analytic=p.analytic,
                      link_flows=link_flows([w.devices for w in p.workers]))
    parts = [w.partition for w in p.workers]
    result, same_as = _simulate(model, parts, p.num_in_flight, p.staleness_bound, p.placement, steps, stages={0})
    paces = {w: result.steady_throughput((w, 0)) for w in set(same_as)}
    alone = [paces[same_as[w]] for w in range(len(parts))]
    busy = dict(zip(result.agents, result.busy_fraction()))
    waited = {w: result.wait_and_idle(w) for w in set(same_as)}
    workers = []
    for w, part in enumerate(parts):
        waits = waited[same_as[w]]
        workers.append({
            "index": w, "device_types": [d.type.name for d in part.devices],
            "minibatches_per_s": alone[w],
            "busy_fraction": [busy[(same_as[w], s)] for s in range(len(part.stages))],
            "average_wait_s": sum(x for x, _ in waits) / len(waits) if waits else 0.0,
            "average_idle_s": sum(y for _, y in waits) / len(waits) if waits else 0.0})
    return {"images_per_s": sum(r * b for r, b in zip(long_run_pace(p.sync, alone), p.sizes)),
            "staleness_bound": p.staleness_bound,
            "steps_per_worker": steps, "virtual_workers": workers}
