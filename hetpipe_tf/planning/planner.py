"""Planning a cluster: virtual workers, partitions, Nm and predicted throughput (HetPipe §4, §7, §8.1).

Pure Python, over a :class:`hetpipe_tf.planning.profile.Profile`:

1. **allocation**: the devices are grouped into virtual workers by a policy (NP,
   ED, HD; :mod:`hetpipe_tf.planning.allocation`), or by ``auto``, which tries every
   allocation the policies can make and keeps the best predicted throughput (a
   search the paper does not do);
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
"""
from dataclasses import dataclass, replace

from hetpipe_tf.pipeline.hetpipe import HETPIPE
from hetpipe_tf.pipeline.instructions import Backward, Forward, Recompute, RecvActivation, RecvGradient
from hetpipe_tf.pipeline.schedule import NO_SYNC, get_schedule, get_sync
from hetpipe_tf.pipeline.simulator import simulate_workers
from hetpipe_tf.planning.allocation import AllocationError, allocate, candidate_allocations, describe
from hetpipe_tf.planning.cost_model import CostModel, LinkModel, link_flows
from hetpipe_tf.planning.partitioner import InfeasiblePartitionError, best_partition, fits_some_order
from hetpipe_tf.planning.partitioner import Partition
from hetpipe_tf.planning.profile import coarsen
from hetpipe_tf.planning.uneven import (UnevenMinibatchError, at_batch_size, check_sizes, memory_cap,
                                        proportional_sizes)
from hetpipe_tf.sync.wsp import PLACEMENTS, WSP_SCHEME, ParameterServerModel

MAX_SEGMENTS = 48


class PlanError(ValueError):
    """A plan that cannot be made: the model does not fit, or the options conflict."""


@dataclass(frozen=True)
class WorkerPlan:
    """One virtual worker: its devices in stage order, its partition and Max_m."""
    devices: tuple
    partition: object  # Partition
    max_num_in_flight: int

    @property
    def device_types(self):
        return [d.type.name for d in self.devices]


@dataclass(frozen=True)
class Plan:
    cluster: object
    profile: object
    policy: str
    placement: str
    staleness_bound: int
    num_in_flight: int
    workers: tuple  # WorkerPlan
    minibatches_per_s: float
    per_worker: tuple  # predicted minibatches/s of each worker in the cluster
    by_num_in_flight: dict  # Nm -> predicted minibatches/s
    notes: tuple
    analytic: object = None  # the AnalyticAssumptions the plan used
    schedule: object = HETPIPE  # the PipelineSchedule planned for
    sync: object = NO_SYNC  # the SyncScheme between its virtual workers
    minibatch_sizes: tuple = ()  # each worker's minibatch size when uneven; () when all train batch_size

    @property
    def sizes(self):
        """Each worker's minibatch size (the profile's batch size unless uneven)."""
        return self.minibatch_sizes or (self.profile.batch_size,) * len(self.workers)

    @property
    def allocation(self):
        """Each worker's device types in node order, as Table 3 writes them (VVQQ)."""
        order = [n.name for n in self.cluster.nodes]
        return describe([sorted(w.devices, key=lambda d: (order.index(d.node), d.index)) for w in self.workers])

    @property
    def images_per_s(self):
        return sum(rate * size for rate, size in zip(self.per_worker, self.sizes))

    def node_boundaries(self, worker=0):
        """First layer call of each stage of `worker`, for VirtualWorker(boundaries=...)."""
        part = self.workers[worker].partition
        return tuple(self.profile.starts[b] for b in part.boundaries)

    def host_pass_seconds(self, worker=0):
        """Per stage of `worker`, the (forward, backward) seconds its passes take on this host by
        the profile the plan was made with: what an emulated device's pace is scaled from
        (:mod:`hetpipe_tf.pipeline.emulation`) when every system of a comparison emulates the same
        devices from one profile."""
        if "host" not in self.profile.times:
            raise ValueError(f"the profile of {self.profile.model} has no times measured on this host (it has "
                             f"{sorted(self.profile.times) or 'none'}); measure one with "
                             f"hetpipe_tf.runtime.profiler.measure_profile")
        if self.minibatch_sizes:
            raise ValueError(f"worker minibatches of {list(self.minibatch_sizes)} (uneven): the profile times "
                             f"minibatches of {self.profile.batch_size} only")
        times = self.profile.times["host"]
        return tuple(times.pass_seconds(*st.segments) for st in self.workers[worker].partition.stages)

    def to_dict(self):
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
                                "receive": (st.recv_activation + st.recv_gradient) * 1e3, "apply": st.apply * 1e3},
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
                "virtual_workers": workers, "notes": list(self.notes)}

    def format(self):
        from hetpipe_tf.pipeline.emulation import format_bytes
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
        lines += [""] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _max_num_in_flight(model, devices, limit):
    """Max_m: the largest Nm <= limit that some order of these devices fits (0 if none).

    Memory grows with Nm, so the feasible Nm are 1..Max_m: a binary search.
    """
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_some_order(model, devices, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _shape(devices):
    """What a worker's costs depend on: its device types, and which devices share a node."""
    nodes = {}
    return tuple((d.type.name, nodes.setdefault(d.node, len(nodes))) for d in sorted(devices, key=lambda d: d.name))


class _PartitionCache:
    """Best partitions by worker shape and Nm: identical workers (as in ED, HD) are solved once.

    A stage's time does not depend on Nm and its memory only grows with Nm, so a
    partition optimal for some Nm that still fits a larger Nm is optimal there too:
    it is reused, and the problem is solved again only when it no longer fits.
    """

    def __init__(self, model, method):
        self.model, self.method, self._seen, self._last = model, method, {}, {}

    def __call__(self, devices, nm):
        shape = _shape(devices)
        key = (shape, nm)
        if key not in self._seen:
            from hetpipe_tf.planning.partitioner import _result
            last = self._last.get(shape)
            reused = last and _result(self.model, last.devices, last.boundaries, nm)
            if reused and last.num_in_flight < nm and all(s.memory_total <= s.capacity for s in reused.stages):
                self._seen[key] = reused
            else:
                self._seen[key] = best_partition(self.model, devices, nm, self.method)
            self._last[shape] = self._seen[key]
        found = self._seen[key]
        if set(found.devices) == set(devices):
            return found
        # The same shape on other devices: map the solved order onto these devices.
        by_role = {}
        for d in sorted(devices, key=lambda d: d.name):
            by_role.setdefault(_role(d, devices), []).append(d)
        order = [by_role[_role(d, found.devices)].pop(0) for d in found.devices]
        from hetpipe_tf.planning.partitioner import _result
        return _result(self.model, order, found.boundaries, nm)


def _role(device, devices):
    """A device's type and the set of its worker's devices on the same node (by type)."""
    return (device.type.name, tuple(sorted(d.type.name for d in devices if d.node == device.node)))


def _push_times(model, workers, placement):
    """Per worker, per stage: seconds to send its layers' update to their parameter servers (or
    pull them), one server per node (§8.1): ``default`` placement puts segment s on node
    s mod H, ``local`` on the stage's own node.

    The workers push a wave at about the same time, so the devices of other nodes that push
    the same segment to a server share that server's inter-node link (§8.1: one per node)."""
    cluster, links, p = model.cluster, model.links, model.profile
    nodes = [n.name for n in cluster.nodes]
    host = {}
    for d in cluster.devices():
        host.setdefault(d.node, d)
    holders = [[] for _ in range(p.num_segments)]  # the node of every stage that holds each segment
    for w in workers:
        for st in w.stages:
            for seg in range(*st.segments):
                holders[seg].append(st.device.node)
    out = []
    for w in workers:
        times = []
        for st in w.stages:
            total = 0.0
            for seg in range(*st.segments):
                if not p.weight_bytes[seg]:
                    continue
                server = st.device.node if placement == "local" else nodes[seg % len(nodes)]
                flows = sum(1 for node in holders[seg] if node != server)
                total += links.seconds(p.weight_bytes[seg], st.device, host[server], cluster, flows=flows)
            times.append(total)
        out.append(tuple(times))
    return out


def _simulate(model, workers, num_in_flight, staleness_bound, placement, n):
    """The workers' schedules in the simulator: (result, same_as), where same_as[w] is the
    worker whose agents in the result stand for worker w.

    Workers whose stages cost the same and whose pushes and pulls take as long run as one
    (:func:`hetpipe_tf.pipeline.simulator.simulate_workers`' ``same_as``): they meet the others
    only at the parameter servers, which get their requests at the same times, so one of them
    runs for all (exact)."""
    push = _push_times(model, workers, placement)
    same_as, first = [], {}
    for w, part in enumerate(workers):
        key = (tuple((st.forward, st.backward, st.apply, st.recv_activation, st.recv_gradient) for st in part.stages),
               push[w])
        same_as.append(first.setdefault(key, w))
    programs = {}
    for k in sorted({len(w.stages) for w in workers}):
        programs[k] = model.schedule.programs(k, n, num_in_flight, sync=model.sync)
    schedules = [programs[len(w.stages)] for w in workers]
    per_instruction = model.profile.instruction_seconds
    known = {}

    def duration(agent, ins):
        kind = type(ins)
        if (agent, kind) not in known:
            st = workers[agent[0]].stages[agent[1]]
            if kind is Forward or kind is Recompute:  # a forward pass again (GPipe, NaivePipe)
                seconds = st.forward
            elif kind is Backward:
                seconds = st.backward
            elif ins.applies() or kind in model.sync.apply_like or kind in model.schedule.apply_like:
                seconds = st.apply
            else:
                link = (st.recv_activation if kind is RecvActivation else st.recv_gradient if kind is RecvGradient
                        else 0.0)
                seconds = link + per_instruction
            known[(agent, kind)] = seconds
        return known[(agent, kind)]

    def transfer(agent, ins):  # a push or a pull moves the stage's weights to or from the servers
        return push[agent[0]][agent[1]]

    servers = model.sync.simulation_model(staleness_bound, push_time=transfer, pull_time=transfer)
    # WSP's servers (and its family's) answer a pull once every worker pushed: how many workers ask
    # does not matter, so they hear from the workers that run only; other schemes' from all.
    counted = not isinstance(servers, ParameterServerModel)
    return simulate_workers(schedules, duration, parameter_servers=servers, same_as=same_as,
                            servers_hear_every_worker=counted), same_as


def predict(model, workers, num_in_flight, staleness_bound=0, placement="default", steps=None):
    """Predicted minibatches/s of the cluster and of each worker, by simulation.

    `workers` are Partitions; with several, they synchronise by `model.sync` (WSP, §5), and
    in the long run every worker goes at the pace of the slowest (a finite staleness bound
    only lets the others run ahead by D waves), which is what each worker is given; under a
    scheme that bounds nothing (ASP) each goes at its own (:func:`long_run_pace`).
    """
    n = steps or max(6 * num_in_flight, 32)
    result, same_as = _simulate(model, workers, num_in_flight, staleness_bound, placement, n)
    alone = {w: result.steady_throughput((w, 0)) for w in set(same_as)}
    per = long_run_pace(model.sync, [alone[same_as[w]] for w in range(len(workers))])
    return sum(per), per


def long_run_pace(sync, alone):
    """Each worker's minibatches/s in the long run, of its simulated ones `alone`: the slowest's
    under a scheme that bounds staleness (:attr:`hetpipe_tf.pipeline.schedule.SyncScheme.bounded`),
    its own under one that does not."""
    return tuple(alone) if not sync.bounded else (min(alone),) * len(alone)


def _at_sizes(model, parts, sizes):
    """`parts` with every worker's stages costed at its own minibatch size (the same cuts and Nm)."""
    out = []
    for p, b in zip(parts, sizes):
        at = replace(model, profile=at_batch_size(model.profile, b))
        out.append(Partition(devices=p.devices, boundaries=p.boundaries, num_in_flight=p.num_in_flight,
                             stages=tuple(at.stages(p.boundaries, p.devices, p.num_in_flight))))
    return tuple(out)


def uneven_sizes(model, parts, minibatch_sizes):
    """Each worker's minibatch size (:mod:`hetpipe_tf.planning.uneven`): "proportional" splits a
    global batch of the profile's batch size times the number of workers by each worker's
    predicted images/s alone (simulated without the other workers) within its memory cap; a
    tuple is checked against the caps. Raises PlanError naming the worker that does not fit."""
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


def _plan_workers(model, workers, policy, placement, staleness_bound, num_in_flight, max_nm, method, notes,
                  minibatch_sizes=None):
    if placement not in PLACEMENTS:
        raise PlanError(f"unknown parameter placement {placement!r}; allowed: {', '.join(PLACEMENTS)}")
    if placement == "local" and len({tuple(d.type.name for d in w) for w in workers}) > 1:
        raise PlanError("local placement keeps a stage's layers on its node's parameter server, which needs "
                        "every virtual worker to hold the same device types (ED)")
    solve = _PartitionCache(model, method)
    max_m = []
    for w in workers:
        m = _max_num_in_flight(model, w, max_nm)
        if m == 0:
            try:
                best_partition(model, w, 1, method)
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
        candidates = range(1, limit + 1)
    results = {}
    for nm in candidates:
        parts = [solve(w, nm) for w in workers]
        total, per = predict(model, parts, nm, staleness_bound, placement)
        results[nm] = (total, per, parts)
        # No worker beats 1 / its slowest stage, a bound that only falls as Nm grows (a cut that
        # fits a larger Nm fits a smaller one): once it is reached, larger Nm cannot do better.
        if total >= 0.999 * len(parts) * min(1.0 / p.bottleneck for p in parts):
            break
    best = max(v[0] for v in results.values())
    chosen = min(nm for nm, v in results.items() if v[0] >= 0.98 * best)
    total, per, parts = results[chosen]
    sizes = ()
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


def plan(profile, cluster, policy="hd", vw_size=None, num_in_flight=None, staleness_bound=0, placement="default",
         dilation=1.0, optimizer_slots=1, links=None, method="milp", max_num_in_flight=16, workers=None,
         analytic=None, schedule=HETPIPE, sync=WSP_SCHEME, minibatch_sizes=None):
    """Plans training `profile`'s model on `cluster`; see the module docstring.

    Args:
      profile: a Profile (measured for emulated devices, analytic parts are added as needed).
      cluster: a Cluster.
      policy: "np", "ed", "hd" or "auto".
      vw_size: devices per virtual worker (default: the smallest node's device count).
      num_in_flight: force Nm (checked against every worker's Max_m).
      staleness_bound: D of WSP.
      placement: "default" or "local".
      dilation, optimizer_slots, links: passed to the CostModel.
      method: "milp" (default) or "dp".
      workers: explicit virtual workers (tuples of cluster devices) instead of a policy.
      analytic: AnalyticAssumptions for device types that are not measured.
      schedule: the pipelining schedule, a registered name or object (its memory facts and
        programs are what is charged and simulated).
      sync: the synchronisation scheme between virtual workers when there are several.
      minibatch_sizes: None (every worker trains the profile's batch size), "proportional" (a
        global batch of the batch size times the number of workers, split by predicted throughput
        within memory) or one size per worker (checked against memory): see step 5 above.
    """
    schedule, sync = get_schedule(schedule), get_sync(sync)
    notes = []
    if profile.num_segments > MAX_SEGMENTS:
        notes.append(f"{profile.num_segments} segments coarsened to {MAX_SEGMENTS} for the search "
                     f"(stages are cut only between merged segments)")
        profile = coarsen(profile, MAX_SEGMENTS)
    links = links or LinkModel()
    model = CostModel(profile, cluster, links=links, dilation=dilation, optimizer_slots=optimizer_slots,
                      analytic=analytic)
    for name, t in profile.times.items():
        notes.append(f"times for {name}: {t.source}")
    for dtype in {d.type for d in cluster.devices()}:
        if not dtype.on_host and dtype.name not in profile.times:
            notes.append(model.times(dtype)[0].source)
    if cluster.emulated:
        notes.append(f"EMULATED devices: host times scaled by dilation {dilation:g} / speed")
    notes.append(f"links: {links.source}")
    if workers is not None:
        candidates = [("given", tuple(tuple(w) for w in workers))]
    elif policy.lower() == "auto":
        candidates = candidate_allocations(cluster)
    else:
        try:
            candidates = [(policy.lower(), allocate(cluster, policy, vw_size))]
        except AllocationError as e:
            raise PlanError(str(e)) from e
    best, errors = None, []
    for label, group in candidates:
        several = len(group) > 1
        cm = CostModel(profile, cluster, links=links, dilation=dilation, optimizer_slots=optimizer_slots,
                       schedule=schedule, sync=sync if several else NO_SYNC, analytic=analytic,
                       link_flows=link_flows(group))
        try:
            p = _plan_workers(cm, group, label.lower() if policy.lower() != "auto" else f"auto: {label}",
                              placement if several else "default", staleness_bound, num_in_flight,
                              max_num_in_flight, method, notes, minibatch_sizes)
        except PlanError as e:
            errors.append(f"{label} {describe(group)}: {e}")
            continue
        if best is None or p.minibatches_per_s > best.minibatches_per_s:
            best = p
    if best is None:
        raise PlanError("no plan fits:\n" + "\n".join(errors))
    return best


def simulate_plan(p, steps=400):
    """A plan's schedules in the simulator, longer than the planner runs them: a report dict
    with images/s, and per worker its devices' busy fractions and its average wait for pulled
    weights and idle time of its first stage during those waits (§8.4)."""
    model = CostModel(p.profile, p.cluster, schedule=p.schedule, sync=p.sync, analytic=p.analytic,
                      link_flows=link_flows([w.devices for w in p.workers]))
    parts = [w.partition for w in p.workers]
    result, same_as = _simulate(model, parts, p.num_in_flight, p.staleness_bound, p.placement, steps)
    alone = [result.steady_throughput((same_as[w], 0)) for w in range(len(parts))]
    busy = dict(zip(result.agents, result.busy_fraction()))
    workers = []
    for w, part in enumerate(parts):
        waits = result.wait_and_idle(same_as[w])
        workers.append({
            "index": w, "device_types": [d.type.name for d in part.devices],
            "minibatches_per_s": alone[w],
            "busy_fraction": [busy[(same_as[w], s)] for s in range(len(part.stages))],
            "average_wait_s": sum(x for x, _ in waits) / len(waits) if waits else 0.0,
            "average_idle_s": sum(y for _, y in waits) / len(waits) if waits else 0.0})
    return {"images_per_s": sum(r * b for r, b in zip(long_run_pace(p.sync, alone), p.sizes)),
            "staleness_bound": p.staleness_bound,
            "steps_per_worker": steps, "virtual_workers": workers}
