"""Predicted time and memory of a stage (HetPipe §4 and §7).

Pure Python. For a stage made of segments [lo, hi) of a :class:`Profile`, placed on
a cluster device at position q of a virtual worker of k stages with Nm minibatches
in flight:

* **time per minibatch** = forward and backward task overheads + the segments'
  compute on that device type (emulated devices: the host's times scaled by
  dilation / speed, as the emulation pads them) + receiving the activations that
  cross into the stage (forward) + receiving the gradients of the tensors it sends
  (backward) + applying the update (which writes a fresh buffer when Nm > 1, since
  a stashed version shares the old one) + the executor's cost of the stage's
  non-compute instructions (their number per minibatch comes from the schedule). Communication over a link follows §7: inside a
  node, bytes / (bandwidth x a scaling-down constant); between nodes, a linear fit
  ``intercept + slope x bytes`` (:class:`LinkModel`). Each node has one inter-node link
  (§8.1: the nodes are connected by one 56 Gb/s InfiniBand network), so the virtual workers
  that send between the same two nodes at once share it: with ``link_flows`` (from
  :func:`link_flows`) each of them gets its share of the bandwidth. Inside a node every
  device has a PCIe link of its own (§8.1), which is not shared;
* **memory** = live weights and non-trainable state, the stashed weight versions,
  optimizer slots, the synchronisation scheme's copies, and the activations of the
  minibatches in flight at that stage, plus a reserve for the framework's own memory on
  real devices. The schedule and the synchronisation scheme state their numbers (the
  seams of :mod:`hetpipe_tf.pipeline.schedule`): HetPipe holds Nm versions and the
  activations of min(Nm, k - q) minibatches at position q, so the first stage holds the
  most and the last one holds one (§4; the schedule enforces this window); WSP keeps one
  more copy (the weights at the last push).
"""
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from hetpipe_tf.pipeline.hetpipe import HETPIPE
from hetpipe_tf.pipeline.instructions import ApplyUpdate, Backward, Forward
from hetpipe_tf.pipeline.schedule import NO_SYNC, PipelineSchedule, SyncScheme
from hetpipe_tf.planning.cluster import Cluster, Device, DeviceType
from hetpipe_tf.planning.profile import AnalyticAssumptions, Profile, SegmentTimes, analytic_times

REAL_DEVICE_RESERVE = 500 * 1024 ** 2  # CUDA context and workspace on a real GPU
# (id of a profile, device type, assumptions) -> (the profile, its analytic times)
_ANALYTIC: dict[tuple[int, DeviceType, AnalyticAssumptions], tuple[Profile, SegmentTimes]] = {}


@dataclass(frozen=True)
class LinkModel:
    """Seconds to move bytes between two devices of a cluster (§7): ``intercept + bytes /
    (nominal bandwidth x scale)``, inside a node and between nodes (there plus the
    cluster's inter-node latency). §7 calibrates the
    intra-node scaling-down constant with a synthetic transfer benchmark and fits the
    inter-node line by regression: :meth:`calibrated` does both from measured samples."""
    intra_scale: float = 0.8  # the fraction of the nominal intra-node bandwidth achieved
    inter_intercept: float = 50e-6  # seconds
    inter_scale: float = 0.9  # fraction of the nominal inter-node bandwidth (slope = 1 / (bw x scale))
    intra_intercept: float = 0.0
    source: str = "assumed (not calibrated): 0.8 of PCIe, 50 us + bytes / (0.9 x InfiniBand)"

    def seconds(self, nbytes: float, src: Device, dst: Device, cluster: Cluster, flows: int = 1) -> float:
        """Seconds for `nbytes` from device `src` to `dst`; between nodes, `flows` transfers share
        the link at once and each moves at its share of the bandwidth."""
        if nbytes <= 0 or src == dst:
            return 0.0
        shared = 1 if src.node == dst.node else max(flows, 1)
        return self.intercept(src, dst, cluster) + nbytes * shared / self.bandwidth(src, dst, cluster)

    def bandwidth(self, src: Device, dst: Device, cluster: Cluster) -> float:
        """Bytes/s one transfer reaches from device `src` to device `dst` alone."""
        if src.node == dst.node:
            return cluster.intra_node_bandwidth * self.intra_scale
        return cluster.inter_node_bandwidth * self.inter_scale

    def intercept(self, src: Device, dst: Device, cluster: Cluster) -> float:
        """Seconds a transfer from `src` to `dst` takes besides its bytes."""
        if src.node == dst.node:
            return self.intra_intercept
        return self.inter_intercept + cluster.inter_node_latency

    def calibrated(self, cluster: Cluster, intra_samples: Sequence[tuple[float, float]] | None = None,
                   inter_samples: Sequence[tuple[float, float]] | None = None) -> "LinkModel":
        """This model with the intra-node and/or inter-node lines fitted to (bytes, seconds)
        samples, e.g. from :func:`hetpipe_tf.runtime.profiler.measure_transfers`."""
        fields: dict[str, float] = {}
        notes: list[str] = []
        if intra_samples:
            intercept, per_byte = fit_line(intra_samples)
            fields.update(intra_intercept=intercept, intra_scale=1.0 / (per_byte * cluster.intra_node_bandwidth))
            notes.append(f"intra-node {intercept * 1e6:.0f} us + bytes / {1 / per_byte / 1e9:.2f} GB/s "
                         f"({len(intra_samples)} transfers measured)")
        if inter_samples:
            intercept, per_byte = fit_line(inter_samples)
            fields.update(inter_intercept=intercept, inter_scale=1.0 / (per_byte * cluster.inter_node_bandwidth))
            notes.append(f"inter-node {intercept * 1e6:.0f} us + bytes / {1 / per_byte / 1e9:.2f} GB/s "
                         f"({len(inter_samples)} transfers measured)")
        kept = [] if inter_samples else [f"inter-node assumed: {self.inter_intercept * 1e6:.0f} us + bytes / "
                                         f"({self.inter_scale:g} x nominal)"]
        return LinkModel(**{**self.__dict__, **fields,
                            "source": "calibrated: " + "; ".join(notes + kept)})


def fit_line(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (intercept >= 0, seconds per byte > 0) of seconds against bytes."""
    n = len(samples)
    if n < 2 or len({b for b, _ in samples}) < 2:
        raise ValueError(f"a link fit needs transfers of at least two sizes, got {samples}")
    mean_b = sum(b for b, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in samples)
             / sum((b - mean_b) ** 2 for b, _ in samples))
    if slope <= 0:
        raise ValueError(f"transfer times do not grow with size: {samples}")
    return max(mean_t - slope * mean_b, 0.0), slope


def link_flows(workers: Iterable[Iterable[Device]]) -> tuple[tuple[tuple[str, str], int], ...]:
    """For every pair of nodes, how many of the virtual workers (tuples of cluster devices) have
    devices on both, so that their transfers between those nodes share the inter-node link at
    once (equal workers run in step): ``((node_a, node_b), flows)`` pairs, sorted, for
    :class:`CostModel`'s ``link_flows``."""
    counts: dict[tuple[str, str], int] = {}
    for w in workers:
        nodes = sorted({d.node for d in w})
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                counts[(a, b)] = counts.get((a, b), 0) + 1
    return tuple(sorted(counts.items()))


def non_compute_instructions(position: int, num_stages: int, schedule: PipelineSchedule = HETPIPE) -> int:
    """How many receives, sends, stashes and releases a minibatch has at a stage position,
    counted from the schedule itself."""
    prog = schedule.programs(num_stages, 3, 1).programs[position]
    return sum(1 for stream in prog.streams for ins in stream[1].instructions
               if not isinstance(ins, (Forward, Backward, ApplyUpdate)))


@dataclass(frozen=True)
class StageCost:
    """What a stage of segments [lo, hi) costs at a position of a device chain (§7): seconds per
    minibatch and bytes held."""
    device: Device
    segments: tuple[int, int]  # (lo, hi)
    position: int
    forward: float
    backward: float
    recv_activation: float
    recv_gradient: float
    apply: float
    executor: float = 0.0  # non-compute instructions
    memory: dict[str, float] = field(default_factory=dict)  # category -> bytes
    exchange: float = 0.0  # receiving the other replicas' gradients of the tied layers it holds, before its update

    @property
    def time(self) -> float:
        return (self.forward + self.backward + self.recv_activation + self.recv_gradient + self.apply
                + self.executor + self.exchange)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def capacity(self) -> int:
        return self.device.type.memory


def neighbour(devices: Sequence[Device], position: int) -> Device | None:
    """The device of the stage before `position` in the chain `devices`, the next one's for the
    first stage, None for a chain of one: where a stage's tied layers' other replicas are taken to
    be when the whole chain is not known."""
    if position > 0:
        return devices[position - 1]
    return devices[1] if len(devices) > 1 else None


@dataclass(frozen=True)
class CostModel:
    """Stage costs for one profile on one cluster."""
    profile: Profile
    cluster: Cluster
    links: LinkModel = LinkModel()
    dilation: float = 1.0  # emulated devices' time dilation
    optimizer_slots: int = 1  # optimizer variables per weight (SGD with momentum: 1, Adam: 2)
    schedule: PipelineSchedule = HETPIPE  # activations and weight versions a stage holds
    sync: SyncScheme = NO_SYNC  # the scheme between virtual workers: its weight copies per stage
    analytic: AnalyticAssumptions | None = None  # for device types that are not measured
    # ((node_a, node_b), workers sending between them at once), see link_flows
    link_flows: tuple[tuple[tuple[str, str], int], ...] = ()

    @cached_property
    def _flows(self) -> dict[tuple[str, str], int]:
        return dict(self.link_flows)

    def link_seconds(self, nbytes: float, src: Device, dst: Device) -> float:
        """Seconds for `nbytes` from device `src` to device `dst`, sharing an inter-node link with
        the other virtual workers that cross it (``link_flows``)."""
        pair = (src.node, dst.node) if src.node < dst.node else (dst.node, src.node)
        return self.links.seconds(nbytes, src, dst, self.cluster, flows=self._flows.get(pair, 1))

    def times(self, device_type: DeviceType) -> tuple[SegmentTimes, float]:
        """SegmentTimes of a device type, and the factor its compute is scaled by. A CPU-quota type's
        are its own, measured in a group of its quota (never the host's times scaled by the quota)."""
        if device_type.cpu_quota is not None:
            if device_type.name not in self.profile.times:
                raise ValueError(f"device type '{device_type.name}' runs at a CPU quota of {device_type.cpu_quota:g} "
                                 f"cores: its speed is measured, not assumed, and the profile has times for "
                                 f"{sorted(self.profile.times)} only; add them with "
                                 f"hetpipe_tf.distributed.node_speed.quota_profile")
            return self.profile.times[device_type.name], 1.0
        speed = device_type.host_speed  # set for every type on the host
        if speed is not None:  # a dilation slows emulated devices only
            return self.profile.times["host"], (self.dilation if device_type.emulated else 1.0) / speed
        if device_type.name in self.profile.times:
            return self.profile.times[device_type.name], 1.0
        assume = self.analytic or AnalyticAssumptions()
        key = (id(self.profile), device_type, assume)
        if key not in _ANALYTIC:  # the roofline of every segment, once per profile and device type
            if len(_ANALYTIC) > 64:
                _ANALYTIC.clear()
            _ANALYTIC[key] = (self.profile, analytic_times(self.profile, device_type, assume))
        return _ANALYTIC[key][1], 1.0

    def apply_seconds(self, device_type: DeviceType, weight_bytes: float, num_in_flight: int = 1) -> float:
        """Applying an update: measured on the host for the devices it serves; on an accelerator,
        reading and writing the weights, gradients and slots at its memory bandwidth."""
        p = self.profile
        if device_type.on_host or device_type.name in p.times:
            per_byte = p.apply_shared_per_byte if num_in_flight > 1 and p.apply_shared_per_byte else p.apply_per_byte
            return (p.apply_base + per_byte * weight_bytes) * self._quota_slowdown(device_type)
        if device_type.memory_bandwidth is None:
            raise ValueError(f"{device_type.label} is neither measured nor given a memory_bandwidth: the update "
                             f"time of a real device type needs one of them")
        moved = weight_bytes * (3 + 2 * self.optimizer_slots)
        efficiency = (self.analytic or AnalyticAssumptions()).memory_efficiency
        return moved / (device_type.memory_bandwidth * efficiency)

    def _quota_slowdown(self, device_type: DeviceType) -> float:
        """How much slower a CPU-quota type computes than the host, by its measured passes (1 for
        other types): an apply runs in its group too."""
        if device_type.cpu_quota is None:
            return 1.0
        own, host = self.times(device_type)[0], self.profile.times["host"]
        return (sum(own.forward) + sum(own.backward)) / (sum(host.forward) + sum(host.backward))

    def executor_seconds(self, position: int, num_stages: int) -> float:
        """The executor's cost of one minibatch's non-compute instructions at a stage position."""
        if not self.profile.instruction_seconds:
            return 0.0
        return self.profile.instruction_seconds * non_compute_instructions(position, num_stages, self.schedule)

    def weight_copies(self, num_in_flight: int) -> int:
        """Copies of a stage's weights: live, the schedule's stashed versions (HetPipe: Nm), and
        the synchronisation scheme's (WSP: the weights at the last push)."""
        return 1 + self.schedule.weight_versions(num_in_flight) + self.sync.weight_copies

    def exchange_seconds(self, lo: int, hi: int, device: Device, partners: Mapping[int | None, Device | None]
                         ) -> float:
        """Seconds a stage of segments [lo, hi) on `device` takes to receive the gradients of the
        tied layers it holds a replica of from the stages that hold the others: `partners` maps a
        segment to the device of the stage that holds it (a missing segment: on a neighbouring
        stage's device, `partners[None]`)."""
        seconds = 0.0
        for _, segments, nbytes in self.profile.replicated(lo, hi):
            others = {partners.get(i, partners.get(None)) for i in segments if not lo <= i < hi}
            seconds += sum(self.link_seconds(nbytes, other, device) for other in others if other is not None)
        return seconds

    def stage(self, lo: int, hi: int, devices: Sequence[Device], position: int, num_in_flight: int,
              partners: Mapping[int | None, Device | None] | None = None) -> StageCost:
        """The :class:`StageCost` of segments [lo, hi) at `position` of the device chain `devices`;
        `partners` as for :meth:`exchange_seconds` (default: every other replica on a neighbour's device)."""
        p = self.profile
        device = devices[position]
        k = len(devices)
        t, scale = self.times(device.type)
        late = p.pacing_overshoot_seconds if device.type.emulated else 0.0
        forward, backward = (scale * seconds + late for seconds in t.pass_seconds(lo, hi))
        weights = p.stage_weight_bytes(lo, hi)
        if partners is None:
            partners = {None: neighbour(devices, position)}
        cut_in = p.cut_bytes[lo] if lo > 0 else 0
        cut_out = p.cut_bytes[hi] if hi < p.num_segments else 0
        recv_act = self.link_seconds(cut_in, devices[position - 1], device) if position > 0 else 0.0
        recv_grad = self.link_seconds(cut_out, devices[position + 1], device) if position < k - 1 else 0.0
        apply = self.apply_seconds(device.type, weights, num_in_flight)
        held = self.schedule.activations_held(position, k, num_in_flight)
        memory = {
            "weights and versions": weights * self.weight_copies(num_in_flight),
            "optimizer slots": weights * self.optimizer_slots,
            "non-trainable state": sum(p.state_bytes[lo:hi]),
            "activations": held * (cut_in + sum(p.activation_bytes[lo:hi])),
            "framework reserve": 0 if device.type.on_host else REAL_DEVICE_RESERVE,
        }
        return StageCost(device=device, segments=(lo, hi), position=position, forward=forward,
                         backward=backward, recv_activation=recv_act, recv_gradient=recv_grad, apply=apply,
                         executor=self.executor_seconds(position, k), memory=memory,
                         exchange=self.exchange_seconds(lo, hi, device, partners))

    def stages(self, boundaries: Sequence[int], devices: Sequence[Device], num_in_flight: int) -> list[StageCost]:
        """StageCosts of a whole partition (segment boundaries, starting with 0)."""
        ends = tuple(boundaries[1:]) + (self.profile.num_segments,)
        partners: dict[int | None, Device | None] = {i: devices[q] for q, (lo, hi) in enumerate(zip(boundaries, ends))
                                                     for i in range(lo, hi)}
        return [self.stage(lo, hi, devices, q, num_in_flight, partners)
                for q, (lo, hi) in enumerate(zip(boundaries, ends))]
