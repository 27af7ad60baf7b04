"""What the planner knows about a model: per-segment costs on each device type (HetPipe §7).

Pure Python. A *segment* is the unit of partitioning: the layer calls between two
cuts that are allowed (a shared layer's calls stay in one segment), so a stage is
a contiguous run of segments. For a batch size, a :class:`Profile` holds

* per device type, each segment's forward and backward compute time plus the
  fixed cost of one forward or backward task (:class:`SegmentTimes`), either
  measured (:mod:`hetpipe_tf.runtime.profiler`) or analytic, from FLOPs and bytes and the
  device's peak FLOP/s and memory bandwidth (a roofline; labelled as such);
* per segment, the bytes of its trainable weights and non-trainable state, the
  activations one minibatch keeps alive in it until its backward pass, and the
  bytes that cross into it from the previous segment (activations forward,
  gradients backward; a skip tensor counts at every cut it spans);
* the time to apply an update, ``apply_base + apply_per_byte * weight bytes``, and
  ``apply_shared_per_byte`` when a stashed version still shares the weights' buffer
  (Nm > 1: the update then writes a fresh buffer);
* ``instruction_seconds``: what one non-compute instruction (receive, send, stash,
  release) costs the executor, and ``pacing_overshoot_seconds``: how late, on
  average, the host goes on after its emulated device ended a task (waking from
  its wait for the device needs the interpreter back).

Memory is counted from tensor shapes (weights, optimizer slots, activations);
frameworks add workspace on top, which the cost model reserves per device.
"""
import json
from collections.abc import Collection, Mapping, Sequence
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from hetpipe_tf.planning.cluster import Cluster, DeviceType
from hetpipe_tf.planning.model_graph import ModelGraph

#: A layer called in several segments (tied weights): (its name, those segments, its weight bytes).
SharedWeights = tuple[str, tuple[int, ...], int]

@dataclass(frozen=True)
class AnalyticAssumptions:
    """What an analytic profile assumes: the fractions of peak FLOP/s and memory bandwidth a
    training kernel reaches, a cost per kernel, and a cost per task. They are printed with
    every analytic figure; benchmarks/planner_accuracy.py calibrates them on measured cells."""
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.7
    kernel_seconds: float = 10e-6
    task_seconds: float = 200e-6


@dataclass(frozen=True)
class SegmentTimes:
    """Per-segment compute seconds on one device type, and the fixed cost of a forward
    task and of a backward task (a function call, the tape)."""
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    forward_overhead: float
    backward_overhead: float
    source: str

    def pass_seconds(self, lo: int, hi: int) -> tuple[float, float]:
        """(forward, backward) seconds of one task running segments [lo, hi): its fixed cost plus
        its segments' compute (§7: a stage's time is the sum of its layers').

        Returns:
            The (forward, backward) seconds.
        """
        return (self.forward_overhead + sum(self.forward[lo:hi]),
                self.backward_overhead + sum(self.backward[lo:hi]))

    def scaled(self, speed: float, source: str) -> "SegmentTimes":
        """These times on a device `speed` times as fast (every segment's and task's time divided by
        it), said to come from `source`: how a type measured on the whole model's passes against the
        device of these times is planned (CPU-quota types, accelerators measured on this machine).

        Returns:
            The scaled times.
        """
        return SegmentTimes(forward=tuple(t / speed for t in self.forward),
                            backward=tuple(t / speed for t in self.backward),
                            forward_overhead=self.forward_overhead / speed,
                            backward_overhead=self.backward_overhead / speed, source=source)


@dataclass(frozen=True)
class Profile:
    """A model's segments at a batch size (§7): their bytes, FLOPs and traffic, and their times
    on each device type measured or predicted (see the module docstring).

    Args:
        model: the model's name.
        batch_size: the minibatch size the figures are for.
        starts: the first layer call of each segment.
        weight_bytes: each segment's trainable weights, in bytes.
        state_bytes: each segment's non-trainable state, in bytes.
        activation_bytes: the activations one minibatch keeps alive in each segment until its
            backward pass, in bytes.
        cut_bytes: the bytes into segment i from segment i - 1 (0 for the first).
        forward_flops: each segment's forward FLOPs.
        backward_flops: each segment's backward FLOPs.
        traffic_bytes: the bytes each segment's forward pass reads and writes.
        kernels: the layer calls of each segment.
        layer_names: the name of every layer call, in order.
        times: device type (or ``"host"``) -> its :class:`SegmentTimes`.
        apply_base: seconds of an update, independent of its size.
        apply_per_byte: seconds of an update per byte of weights.
        apply_shared_per_byte: the same when a stashed version still shares the weights' buffer.
        instruction_seconds: what one non-compute instruction costs the executor.
        pacing_overshoot_seconds: how late, on average, the host goes on after its emulated
            device ended a task.
        shared_weights: each layer called in several segments (tied weights): its name, those
            segments and its weight bytes.
    """
    model: str
    batch_size: int
    starts: tuple[int, ...]  # first layer call of each segment
    weight_bytes: tuple[int, ...]
    state_bytes: tuple[int, ...]
    activation_bytes: tuple[float, ...]
    cut_bytes: tuple[float, ...]  # into segment i from segment i - 1 (0 for the first)
    forward_flops: tuple[float, ...]
    backward_flops: tuple[float, ...]
    traffic_bytes: tuple[float, ...]  # bytes a segment's forward pass reads and writes
    kernels: tuple[int, ...]  # layer calls per segment
    layer_names: tuple[str, ...] = ()  # of every layer call, in order
    times: dict[str, SegmentTimes] = field(default_factory=dict)  # device type (or "host") -> SegmentTimes
    apply_base: float = 0.0
    apply_per_byte: float = 0.0
    apply_shared_per_byte: float = 0.0
    instruction_seconds: float = 0.0
    pacing_overshoot_seconds: float = 0.0
    #: Each layer called in several segments (tied weights): (its name, those segments, its weight
    #: bytes). Every one of them counts the weights in `weight_bytes`: a stage that holds several
    #: of them holds one copy (:meth:`stage_weight_bytes`), stages apart hold a replica each.
    shared_weights: tuple[SharedWeights, ...] = ()

    @property
    def num_segments(self) -> int:
        """The number of segments."""
        return len(self.starts)

    def stage_weight_bytes(self, lo: int, hi: int) -> int:
        """Trainable weight bytes of a stage of segments [lo, hi): a layer called in several of
        them counts once.

        Returns:
            The bytes.
        """
        over = sum(nbytes * (n - 1) for n, nbytes in self._shared_counts(lo, hi) if n > 1)
        return sum(self.weight_bytes[lo:hi]) - over

    def replicated(self, lo: int, hi: int) -> list[SharedWeights]:
        """The :attr:`shared_weights` entries a stage of segments [lo, hi) holds a replica of (the
        layer is called both inside and outside it): their gradients of every minibatch are
        exchanged with the other replicas' stages and summed before any applies (Megatron's
        embedding group).

        Returns:
            Those entries.
        """
        return [entry for (n, _), entry in zip(self._shared_counts(lo, hi), self.shared_weights)
                if 0 < n < len(entry[1])]

    def replicated_bytes(self, lo: int, hi: int) -> int:
        """Weight bytes of the layers a stage of segments [lo, hi) holds a replica of."""
        return sum(nbytes for _, _, nbytes in self.replicated(lo, hi))

    @property
    def server_bytes(self) -> tuple[int, ...]:
        """Per segment: the weight bytes the parameter servers hold of it (what a wave pushes and
        pulls): a layer called in several segments at its first call's only, as the first stage
        holding a replica pushes it for all."""
        later = [0] * self.num_segments
        for _, segments, nbytes in self.shared_weights:
            for i in segments[1:]:
                later[i] += nbytes
        return tuple(w - extra for w, extra in zip(self.weight_bytes, later))

    @property
    def total_weight_bytes(self) -> int:
        """The model's trainable weight bytes, each layer once."""
        return self.stage_weight_bytes(0, self.num_segments)

    def _shared_counts(self, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(sum(lo <= i < hi for i in segments), nbytes) for _, segments, nbytes in self.shared_weights]

    def with_times(self, key: str, times: SegmentTimes) -> "Profile":
        """The profile with `times` under device type `key` (replacing any there)."""
        merged = dict(self.times)
        merged[key] = times
        return Profile(**{**self._fields(), "times": merged})

    def with_host_speeds(self, speeds: Mapping[str, tuple[float, str]], what: str) -> "Profile":
        """The profile with the times of every type of `speeds` (name -> (speed, where it was
        measured)): the host's times (key ``"host"``) divided by the type's speed.

        Returns:
            The new profile.

        Raises:
            ValueError: the profile has no times measured on this host (`what` names what the
                caller adds, in the message's remedy).
        """
        host = self.times.get("host")
        if host is None:
            raise ValueError(f"the profile of {self.model} has no times measured on this host (it has "
                             f"{sorted(self.times) or 'none'}); measure one with "
                             f"hetpipe_tf.runtime.profiler.measure_profile, then add {what}")
        profile = self
        for name, (speed, measured) in speeds.items():
            profile = profile.with_times(name, host.scaled(speed, f"{host.source}, divided by the speed {speed:.3f} "
                                                                  f"{measured}"))
        return profile

    def with_costs(self, **costs: float) -> "Profile":
        """The profile with some of apply_base, apply_per_byte, apply_shared_per_byte,
        instruction_seconds replaced.

        Returns:
            The new profile.
        """
        return Profile(**{**self._fields(), **costs})

    def _fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def to_json(self) -> str:
        """The profile as JSON (:meth:`from_json` reads it back; ``--profile`` takes it)."""
        d = asdict(self)
        d["times"] = {k: asdict(v) for k, v in self.times.items()}
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> "Profile":
        """The profile that :meth:`to_json` wrote as `text`."""
        d = json.loads(text)
        times = {k: SegmentTimes(**{f: _tupled(x) for f, x in v.items()}) for k, v in d.pop("times").items()}
        d["shared_weights"] = tuple((layer, tuple(segments), nbytes) for layer, segments, nbytes in
                                    d.get("shared_weights", ()))
        return Profile(**{k: _tupled(v) for k, v in d.items()}, times=times)


def _tupled(value: Any) -> Any:
    """A JSON list as a tuple (a profile's sequences are tuples); anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class AttentionBlock:
    """What an attention layer keeps for its backward pass beyond its inputs and outputs, which
    the layer graph does not show: with `heads` heads of `head_dim` over a sequence of L
    positions, its queries, keys and values, the softmax of its scores (heads x L x L: what grows
    with the square of the sequence) and its weighted values; for a transformer block
    (`feedforward` > 0, keras_hub's TransformerEncoder and TransformerDecoder) also its two
    normalisations' outputs, the residual between them and the feed-forward layer's two
    activations (before and after its nonlinearity, `feedforward` wide); with `dropout`, the
    masks (a byte each) and the dropped probabilities. Counted as Korthikanti et al. (2022) count
    a decoder's saved tensors, at the layer's precision. Its FLOPs beyond the projections (which
    the graph's estimate counts from the weights): the scores and the weighted sum, 4 L^2 x
    heads x head_dim per example."""
    heads: int
    head_dim: int
    feedforward: int = 0
    dropout: bool = False

    def saved_bytes(self, length: int, hidden: int, itemsize: int) -> int:
        """Bytes per example the block keeps until its backward pass, beside its output."""
        width = self.heads * self.head_dim
        scores = self.heads * length * length
        elements = 3 * length * width + scores + length * width  # q, k, v, softmax, weighted values
        masks = 0
        if self.dropout:
            elements += scores
            masks += scores
        if self.feedforward:
            elements += 3 * length * hidden + 2 * length * self.feedforward  # norms, residual, feed-forward
            if self.dropout:
                masks += 2 * length * hidden
        return elements * itemsize + masks

    def extra_flops(self, length: int) -> int:
        """FLOPs per example of the scores and the weighted sum (a forward pass)."""
        return 4 * length * length * self.heads * self.head_dim


def segment_starts(graph: ModelGraph) -> tuple[int, ...]:
    """First layer call of every segment: every layer call. A cut may separate the calls of a
    shared layer (tied weights): each stage that calls it then holds a replica, whose memory and
    gradient exchange the cost model charges, so the planner weighs replicas against keeping
    the calls on one stage.

    Returns:
        The first layer call of each segment.
    """
    return tuple(range(graph.num_nodes))


def static_profile(graph: ModelGraph, batch_size: int, attention: Mapping[int, AttentionBlock] | None = None,
                   lookups: Collection[int] = ()) -> Profile:
    """A :class:`Profile` with the static facts of `graph` at `batch_size` and no times yet.

    `attention`: {node index: :class:`AttentionBlock`} of its attention layers, whose saved
    tensors count as activations and whose scores as FLOPs (forward; twice in the backward pass);
    `lookups`: indices of table lookups (embeddings), whose FLOPs are their outputs' elements,
    not the graph's estimate from the weights (a gather multiplies nothing).

    Returns:
        The profile.
    """
    blocks = attention or {}
    starts = segment_starts(graph)
    ends = starts[1:] + (graph.num_nodes,)
    weights: list[int] = []
    state: list[int] = []
    kernels: list[int] = []
    act: list[float] = []
    cut: list[float] = []
    fwd: list[float] = []
    bwd: list[float] = []
    traffic: list[float] = []
    for i, (lo, hi) in enumerate(zip(starts, ends)):
        nodes = graph.nodes[lo:hi]
        seen: set[str] = set()
        w = s = 0
        for n in nodes:
            if n.layer not in seen:
                seen.add(n.layer)
                w += n.trainable_bytes
                s += n.non_trainable_bytes
        made = {t for n in nodes for t in n.outputs}
        loaded = {t.index for t in graph.tensors if t.producer is None and t.consumers and lo <= t.consumers[0] < hi}
        inside = [(blocks[n.index], graph.tensors[n.outputs[0]]) for n in nodes if n.index in blocks]
        saved = sum(block.saved_bytes(t.shape[0] or 1, _width(t.shape, t.name), t.itemsize) for block, t in inside)
        act.append(batch_size * (sum(graph.tensors[t].bytes_per_example for t in made | loaded) + saved))
        cut.append(0 if i == 0 else batch_size * sum(graph.tensors[t].bytes_per_example
                                                     for t in graph.crossing(lo)))
        weights.append(w)
        state.append(s)
        flops = [sum(graph.tensors[t].bytes_per_example // graph.tensors[t].itemsize for t in n.outputs)
                 if n.index in lookups else n.flops_per_example for n in nodes]
        scores = sum(block.extra_flops(t.shape[0] or 1) for block, t in inside)
        fwd.append(batch_size * (sum(flops) + scores))
        bwd.append(batch_size * (sum(f * (2 if n.trainable_bytes else 1) for f, n in zip(flops, nodes)) + 2 * scores))
        traffic.append(sum(batch_size * sum(graph.tensors[t].bytes_per_example for t in n.inputs + n.outputs)
                           + n.trainable_bytes for n in nodes) + batch_size * saved)
        kernels.append(len(nodes))
    segments_of: dict[str, tuple[list[int], int]] = {}  # layer -> the segments that call it, its trainable bytes
    for i, (lo, hi) in enumerate(zip(starts, ends)):
        for n in graph.nodes[lo:hi]:
            segments_of.setdefault(n.layer, ([], n.trainable_bytes))[0].append(i)
    shared = tuple((layer, tuple(sorted(set(segments))), nbytes) for layer, (segments, nbytes) in segments_of.items()
                   if len(set(segments)) > 1 and nbytes)
    return Profile(model=graph.name, batch_size=batch_size, starts=starts, weight_bytes=tuple(weights),
                   state_bytes=tuple(state), activation_bytes=tuple(act), cut_bytes=tuple(cut),
                   forward_flops=tuple(fwd), backward_flops=tuple(bwd), traffic_bytes=tuple(traffic),
                   kernels=tuple(kernels), layer_names=tuple(n.layer for n in graph.nodes), shared_weights=shared)


def _width(shape: Sequence[int | None], name: str) -> int:
    """The last dimension of an attention layer's output, which must be known."""
    if shape[-1] is None:
        raise ValueError(f"the attention layer output {name!r} has an unknown width (shape {tuple(shape)}): "
                         f"build the model with its hidden size given")
    return shape[-1]


def coarsen(profile: Profile, max_segments: int) -> Profile:
    """A profile of at most `max_segments` segments, made by merging the adjacent pair with
    the least compute (FLOPs) again and again; stages can then only be cut between merged
    segments. Per-segment times, bytes and FLOPs add up; a merged segment receives what its
    first part received.

    Returns:
        The coarser profile.
    """
    groups = [[i] for i in range(profile.num_segments)]
    cost = [f + b for f, b in zip(profile.forward_flops, profile.backward_flops)]
    while len(groups) > max_segments:
        pair = min(range(len(groups) - 1),
                   key=lambda g: sum(cost[i] for i in groups[g] + groups[g + 1]))
        groups[pair:pair + 2] = [groups[pair] + groups[pair + 1]]
    return _merged(profile, groups)


def colocated(profile: Profile) -> Profile:
    """The profile whose segments keep every shared layer's calls together (each span from its
    first call's segment to its last one's is one segment): the plans in which no layer is
    replicated, which :func:`hetpipe_tf.planning.planner.plan` weighs against replicas.

    Returns:
        The profile.
    """
    groups = [[i] for i in range(profile.num_segments)]
    for _, segments, _ in profile.shared_weights:
        first = next(g for g, members in enumerate(groups) if segments[0] in members)
        last = next(g for g, members in enumerate(groups) if segments[-1] in members)
        groups[first:last + 1] = [[i for members in groups[first:last + 1] for i in members]]
    return _merged(profile, groups)


def _merged(profile: Profile, groups: Sequence[list[int]]) -> Profile:
    """`profile` with the segments of each group (consecutive, in order) merged into one."""
    def summed(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(sum(values[i] for i in g) for g in groups)

    times = {k: SegmentTimes(summed(t.forward), summed(t.backward), t.forward_overhead, t.backward_overhead,
                             t.source) for k, t in profile.times.items()}
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    shared = tuple((layer, tuple(sorted({group_of[i] for i in segments})), nbytes)
                   for layer, segments, nbytes in profile.shared_weights)
    return Profile(**{**profile._fields(), "starts": tuple(profile.starts[g[0]] for g in groups),
                      "shared_weights": tuple(entry for entry in shared if len(entry[1]) > 1),
                      "weight_bytes": tuple(profile.stage_weight_bytes(g[0], g[-1] + 1) for g in groups),
                      "state_bytes": summed(profile.state_bytes),
                      "activation_bytes": summed(profile.activation_bytes),
                      "cut_bytes": tuple(profile.cut_bytes[g[0]] for g in groups),
                      "forward_flops": summed(profile.forward_flops),
                      "backward_flops": summed(profile.backward_flops),
                      "traffic_bytes": summed(profile.traffic_bytes), "kernels": summed(profile.kernels),
                      "times": times})


def analytic_times(profile: Profile, device_type: DeviceType, assume: AnalyticAssumptions = AnalyticAssumptions()
                   ) -> SegmentTimes:
    """Roofline times of every segment on a real device type described by its specs."""
    if device_type.peak_tflops is None or device_type.memory_bandwidth is None:
        measured = (f"its speed is measured on a device named {device_type.device_name!r} of the machine that "
                    f"plans (HetPipeStrategy, hetpipe plan and hetpipe-train measure it there), or comes with a "
                    f"profile that has times for '{device_type.name}'; "
                    if device_type.device_name else "")
        raise ValueError(f"device type '{device_type.name}' ({device_type.label}) has no times: {measured}analytic "
                         f"times need its peak_tflops and memory_bandwidth_GBps: give them in the cluster "
                         f"description, plan on a machine that has the device, or give a profile with its times")
    flops = device_type.peak_tflops * 1e12 * assume.compute_efficiency
    bandwidth = device_type.memory_bandwidth * assume.memory_efficiency

    def seconds(f: float, traffic: float, kernels: int) -> float:
        return max(f / flops, traffic / bandwidth) + kernels * assume.kernel_seconds

    forward = tuple(seconds(f, b, k) for f, b, k in zip(profile.forward_flops, profile.traffic_bytes,
                                                        profile.kernels))
    backward = tuple(seconds(f, 2 * b, 2 * k) for f, b, k in zip(profile.backward_flops, profile.traffic_bytes,
                                                                 profile.kernels))
    source = (f"analytic for {device_type.label}: roofline of {device_type.peak_tflops:.1f} TFLOP/s x "
              f"{assume.compute_efficiency:g} and {device_type.memory_bandwidth / 1e9:.0f} GB/s x "
              f"{assume.memory_efficiency:g}, {assume.kernel_seconds * 1e6:g} us per kernel")
    return SegmentTimes(forward, backward, assume.task_seconds, assume.task_seconds, source)


def measured_cluster(cluster: Cluster, profile: Profile) -> Cluster:
    """`cluster` with the speed of every measured device type (a real accelerator without a peak,
    :attr:`DeviceType.measured`) whose times `profile` has: its whole model's forward and backward
    time against the host's (``"host"``), which HD compares workers' compute by (§8.1) where no
    peak TFLOP/s is given.

    Returns:
        The cluster with measured speeds.
    """
    host = profile.times.get("host")
    if host is None:
        return cluster
    whole = sum(host.pass_seconds(0, profile.num_segments))
    types = {name: dataclasses.replace(t, measured_speed=whole / sum(profile.times[name].pass_seconds(
                 0, profile.num_segments))) if t.measured and name in profile.times else t
             for name, t in cluster.device_types.items()}
    return dataclasses.replace(cluster, device_types=types)
