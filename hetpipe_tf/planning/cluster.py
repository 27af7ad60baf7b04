"""Cluster descriptions: nodes of devices, device types, links (HetPipe §3, §8.1).

Pure Python. A cluster has H nodes, each holding a number of devices of one type
(§3: "each node comprises a homogeneous set of GPUs"), the device types' compute
speed and memory, and the bandwidth of links inside a node and between nodes.
The JSON format::

    {"name": "paper",
     "device_types": {"V": {"label": "TITAN V", "peak_tflops": 14.9, "memory": "12G",
                            "memory_bandwidth_GBps": 653}, ...},
     "nodes": [{"name": "node-V", "device_type": "V", "count": 4}, ...],
     "links": {"intra_node_GBps": 15.75, "inter_node_GBps": 7.0}}

``links`` may also give ``inter_node_latency_ms`` (one way, default 0) and ``"emulate":
true``: on one machine, each node's tasks then run in a network namespace of their own,
joined by links with that bandwidth and latency (:mod:`hetpipe_tf.distributed.netlinks`;
root needed).

A device type with ``emulated_speed`` is emulated on this host (see
:mod:`hetpipe_tf.pipeline.emulation`): its speed is relative to the host running a task
alone. One with ``"host_cpu": true`` is this host's CPU as it is (real compute, no
pacing; its tasks share the host's cores); with ``"cpu_quota": Q`` as well, each of its
devices is Q cores of it (real compute at a fraction of a core): a node of n such devices
runs its tasks in a CPU-quota group of n x Q cores (:mod:`hetpipe_tf.distributed.cgroups`),
and its speed is measured in such a group, not assumed
(:mod:`hetpipe_tf.distributed.node_speed`). Other types are real accelerators: described by
their peak FP32 TFLOP/s and memory bandwidth (``peak_tflops``, ``memory_bandwidth_GBps``: an
analytic profile of hardware that is not here), or by ``device_name``, the name TensorFlow's
device details give them (``tf.config.experimental.get_device_details``), without a peak: their
speed is then measured on the model's own passes on a device of that name of the machine that
plans (:mod:`hetpipe_tf.runtime.discovery`), and planning refuses them where there is none.
A node of such a type may name GPUs of this machine, one index per device
(``"gpus": [0, 1]``): launch="processes" then runs it on them
(:mod:`hetpipe_tf.distributed.gpus`, which also says which GPUs a node that names none takes).

The name ``discover`` is no description but this machine's devices, listed and grouped into types
by :func:`hetpipe_tf.runtime.discovery.discover_cluster` (TensorFlow lists them; this module does
not import it).

Presets: ``paper`` (Table 1's four nodes of four GPUs each), ``local`` (this
machine's emulated devices), ``local_cpu`` (this machine's CPU as four devices) and
``paper_quota`` (the paper's four node types as CPU-quota nodes of two devices each).
"""
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.planning.devices import DeviceSpec, DeviceSpecError, parse_bytes


class ClusterError(HetPipeUsageError, ValueError):
    """A cluster description that is malformed or inconsistent."""


def _bytes(text: str | int | float, where: str) -> int:
    try:
        return parse_bytes(text)
    except DeviceSpecError as e:
        raise ClusterError(f"{where}: {e}") from None


@dataclass(frozen=True)
class DeviceType:
    """One device type of a cluster description (see the module docstring).

    Args:
        name: the name nodes give as their ``device_type``.
        label: what it is called in plans and logs.
        memory: the bytes one device holds.
        peak_tflops: a real accelerator's peak FP32 TFLOP/s.
        memory_bandwidth: a real accelerator's memory bandwidth, in bytes/s.
        emulated_speed: an emulated device's speed, relative to this host running a task alone.
        host_cpu: this host's CPU as it is.
        cpu_quota: host CPU devices at a quota: the cores of one device.
    """
    name: str
    label: str
    memory: int  # bytes
    peak_tflops: float | None = None  # real accelerators
    memory_bandwidth: float | None = None  # bytes/s, real accelerators
    emulated_speed: float | None = None  # emulated devices, relative to the host
    host_cpu: bool = False  # this host's CPU as it is
    cpu_quota: float | None = None  # host CPU devices at a quota: cores per device
    device_name: str | None = None  # TensorFlow's device_name of a real accelerator measured here
    #: A measured type's speed relative to this host's CPU on the model's passes, once measured
    #: (:func:`hetpipe_tf.planning.profile.measured_cluster`); not part of the type's identity.
    measured_speed: float | None = field(default=None, compare=False)

    @property
    def measured(self) -> bool:
        """Whether the type's speed is measured on a device of the planning machine: a real
        accelerator without a peak_tflops."""
        return not self.on_host and self.peak_tflops is None

    @property
    def emulated(self) -> bool:
        """Whether the type is emulated on this host."""
        return self.emulated_speed is not None

    @property
    def host_speed(self) -> float | None:
        """Speed relative to this host running a task alone, for the devices this host serves
        (emulated ones and the host CPU); None for accelerators. A quota device's is its quota,
        nominal: what the allocation policies compare devices by; the cost model plans it on its
        speed measured in a group of that quota instead."""
        if self.emulated:
            return self.emulated_speed
        if self.host_cpu:
            return 1.0 if self.cpu_quota is None else self.cpu_quota
        return None

    @property
    def on_host(self) -> bool:
        """Whether this host serves the device (logical CPUs of its tasks) rather than an accelerator."""
        return self.host_speed is not None


@dataclass(frozen=True)
class Node:
    """One node of a cluster description: `count` devices of the type named `device_type`.

    Args:
        name: the node's name.
        device_type: the name of its devices' type.
        count: how many devices it holds.
        gpus: for a node of a real accelerator type, the indices of this machine's GPUs it is
            (``"gpus": [0, 1]``; see :mod:`hetpipe_tf.distributed.gpus` for how they map to a
            task's devices, and which a node that names none takes), or None.
    """
    name: str
    device_type: str
    count: int
    gpus: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Device:
    """One device of the cluster: its node, its index in the node, its type."""
    node: str
    index: int
    type: DeviceType

    @property
    def name(self) -> str:
        """``node:index``, the device's name in plans."""
        return f"{self.node}:{self.index}"


@dataclass(frozen=True)
class Cluster:
    """A cluster description (see the module docstring): its device types, its nodes (each holding
    `count` devices of one type) and the links between and within nodes. Made by
    :func:`load_cluster` from a preset's name, a JSON file or a dict, checked field by field.

    Args:
        name: the cluster's name.
        device_types: the device types by name (a DeviceType each: speed or peak FLOP/s, memory).
        nodes: the nodes, in order (a Node each: its name, device type and count of devices).
        intra_node_bandwidth: bytes/s of a link between two devices of one node.
        inter_node_bandwidth: bytes/s of a link between two nodes.
        inter_node_latency: seconds, one way, of a link between two nodes.
        emulate_links: emulate the inter-node links on this machine
            (:mod:`hetpipe_tf.distributed.netlinks`).
    """
    name: str
    device_types: dict[str, DeviceType]
    nodes: tuple[Node, ...]
    intra_node_bandwidth: float  # bytes/s
    inter_node_bandwidth: float  # bytes/s
    inter_node_latency: float = 0.0  # seconds, one way
    emulate_links: bool = False  # emulate the inter-node links (hetpipe_tf.distributed.netlinks)
    discovered: bool = False  # this machine's devices (hetpipe_tf.runtime.discovery), each type measured

    @property
    def emulated(self) -> bool:
        """Whether any device type of the cluster is emulated."""
        return any(t.emulated for t in self.device_types.values())

    @property
    def measured(self) -> bool:
        """Whether some device type's speed is to be measured on this machine (see DeviceType.measured)."""
        return any(t.measured for t in self.device_types.values())

    @property
    def on_host(self) -> bool:
        """Whether this host serves some of the devices (emulated ones or its CPU)."""
        return any(t.on_host for t in self.device_types.values())

    def devices(self) -> tuple[Device, ...]:
        """Every device, node by node."""
        return tuple(Device(n.name, i, self.device_types[n.device_type])
                     for n in self.nodes for i in range(n.count))

    def devices_in_spec_order(self, specs: Sequence[DeviceSpec], real: "RealTypes | None" = None) -> list[Device]:
        """For a cluster made by from_device_specs (with the same `real`): its device of each spec, in
        spec order.

        Returns:
            The devices, one per spec, in the specs' order.
        """
        pools: dict[str, list[Device]] = {}
        for d in self.devices():
            pools.setdefault(d.type.name, []).append(d)
        return [pools[t].pop(0) for t in _spec_types(specs, real)[0]]

    def bandwidth(self, a: Device, b: Device) -> float:
        """Bytes/s between devices `a` and `b` (Device objects)."""
        return self.intra_node_bandwidth if a.node == b.node else self.inter_node_bandwidth

    def node_quotas(self) -> tuple[float | None, ...]:
        """Per node, the cores of its CPU-quota group (its devices' quota times their count), or
        None for a node without a quota.

        Returns:
            The cores per node.
        """
        quotas: list[float | None] = []
        for n in self.nodes:
            quota = self.device_types[n.device_type].cpu_quota
            quotas.append(None if quota is None else quota * n.count)
        return tuple(quotas)

    def describe(self) -> str:
        """One line: every node's devices."""
        parts = [f"{n.count}x {self.device_types[n.device_type].label} ({n.device_type}) on {n.name}"
                 for n in self.nodes]
        return f"cluster '{self.name}': " + ", ".join(parts)


def _flag(spec: Mapping[str, Any], key: str, where: str) -> bool:
    """spec[key] as a bool (default False), or a ClusterError naming `where` + key."""
    value = spec.get(key, False)
    if not isinstance(value, bool):
        raise ClusterError(f"{where}{key} is true or false, got {value!r}")
    return value


def _node_gpus(spec: dict[str, Any], device_type: DeviceType, at: str) -> tuple[int, ...] | None:
    """The GPU indices node `spec` names (its ``gpus``), checked: distinct integers >= 0, one per
    device, on a node of a real accelerator type.

    Returns:
        The indices, or None when the node names none.

    Raises:
        ClusterError: the indices are not that, or the node's type is not a real accelerator.
    """
    gpus = spec.get("gpus")
    if gpus is None:
        return None
    if device_type.on_host:
        kind = "emulated" if device_type.emulated else "the host CPU"
        raise ClusterError(f"{at}: gpus {gpus!r} names GPUs, but its device type '{device_type.name}' is {kind}, "
                           f"served by this host's CPU; GPU indices are for a node of a real accelerator type "
                           f"(peak_tflops): remove gpus or change the type")
    if (not isinstance(gpus, list) or not gpus
            or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus)):
        raise ClusterError(f"{at}: gpus is a list of GPU indices of this machine (integers >= 0), got {gpus!r}")
    if len(set(gpus)) != len(gpus):
        raise ClusterError(f"{at}: gpus {gpus} names a GPU more than once")
    if len(gpus) != spec["count"]:
        more = "more" if len(gpus) > spec["count"] else "fewer"
        raise ClusterError(f"{at}: gpus {gpus} names {len(gpus)} GPUs, {more} than its count of {spec['count']} "
                           f"devices; give one index per device")
    return tuple(gpus)


def _check_gpus_once(nodes: list[Node], where: str) -> None:
    """A ClusterError when a GPU index is named by two nodes."""
    owner: dict[int, str] = {}
    for node in nodes:
        for g in node.gpus or ():
            if g in owner:
                raise ClusterError(f"{where}: GPU {g} is in two nodes, '{owner[g]}' and '{node.name}'; a GPU "
                                   f"belongs to one node")
            owner[g] = node.name


def from_dict(spec: dict[str, Any], where: str = "cluster") -> Cluster:
    """A validated :class:`Cluster` from its JSON-like description."""
    if not isinstance(spec, dict):
        raise ClusterError(f"{where}: a cluster description is a JSON object, got {type(spec).__name__}")
    for key in ("device_types", "nodes", "links"):
        if key not in spec:
            raise ClusterError(f"{where}: missing '{key}' (a cluster has device_types, nodes and links)")
    types = {}
    for name, t in spec["device_types"].items():
        at = f"{where}: device type '{name}'"
        if not isinstance(t, dict) or "memory" not in t:
            raise ClusterError(f"{at} needs a memory size")
        speed = t.get("emulated_speed")
        host_cpu = _flag(t, "host_cpu", f"{at}: ")
        kinds = [k for k, given in (("emulated_speed", speed is not None), ("host_cpu", host_cpu),
                                    ("peak_tflops", t.get("peak_tflops") is not None)) if given]
        if len(kinds) > 1:
            raise ClusterError(f"{at}: a device type is one of emulated (emulated_speed), the host CPU "
                               f"(host_cpu) or a real accelerator (peak_tflops), got {' and '.join(kinds)}")
        device_name = t.get("device_name")
        if device_name is not None and (not isinstance(device_name, str) or not device_name or speed is not None
                                        or host_cpu):
            raise ClusterError(f"{at}: device_name is the name TensorFlow gives a real accelerator (a non-empty "
                               f"string, for a type that is neither emulated_speed nor host_cpu), got {device_name!r}")
        peak, bandwidth = t.get("peak_tflops"), t.get("memory_bandwidth_GBps")
        if speed is None and not host_cpu and device_name is None and (peak is None or bandwidth is None):
            raise ClusterError(f"{at}: give peak_tflops and memory_bandwidth_GBps (a real device, planned "
                               f"analytically), device_name (a real device measured on this machine: the "
                               f"device_name of its TensorFlow device details), emulated_speed (emulated on this "
                               f"host) or \"host_cpu\": true (this host's CPU)")
        quota = t.get("cpu_quota")
        if quota is not None and not host_cpu:
            raise ClusterError(f"{at}: cpu_quota is a share of this host's CPU, for a \"host_cpu\": true type only; "
                               f"add \"host_cpu\": true or remove cpu_quota")
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, (int, float)) or not quota > 0):
            raise ClusterError(f"{at}: cpu_quota is the cores of each device, a number > 0 (e.g. 0.4), got {quota!r}")
        for key in ("emulated_speed", "peak_tflops", "memory_bandwidth_GBps"):
            if t.get(key) is not None and not float(t[key]) > 0:
                raise ClusterError(f"{at}: {key} must be > 0, got {t[key]!r}")
        types[name] = DeviceType(
            name=name, label=t.get("label", name), memory=_bytes(t["memory"], at),
            peak_tflops=float(t["peak_tflops"]) if t.get("peak_tflops") is not None else None,
            memory_bandwidth=float(t["memory_bandwidth_GBps"]) * 1e9 if t.get("memory_bandwidth_GBps") else None,
            emulated_speed=float(speed) if speed is not None else None, host_cpu=host_cpu,
            cpu_quota=float(quota) if quota is not None else None, device_name=device_name)
    if not types:
        raise ClusterError(f"{where}: no device types")
    nodes, names = [], set()
    for i, n in enumerate(spec["nodes"]):
        at = f"{where}: node {i}"
        if not isinstance(n, dict) or "device_type" not in n or "count" not in n:
            raise ClusterError(f"{at} needs a device_type and a count")
        name = n.get("name", f"node{i}")
        if name in names:
            raise ClusterError(f"{at}: node name '{name}' is used twice")
        names.add(name)
        if n["device_type"] not in types:
            raise ClusterError(f"{at} ('{name}'): unknown device type '{n['device_type']}'; "
                               f"known: {sorted(types)}")
        if not isinstance(n["count"], int) or n["count"] <= 0:
            raise ClusterError(f"{at} ('{name}'): count must be a positive integer, got {n['count']!r}")
        nodes.append(Node(name, n["device_type"], n["count"],
                          _node_gpus(n, types[n["device_type"]], f"{at} ('{name}')")))
    if not nodes:
        raise ClusterError(f"{where}: no nodes")
    _check_gpus_once(nodes, where)
    links = spec["links"]
    bw = {}
    for key in ("intra_node_GBps", "inter_node_GBps"):
        value = links.get(key) if isinstance(links, dict) else None
        if value is None or not float(value) > 0:
            raise ClusterError(f"{where}: links.{key} must be a bandwidth > 0 in GB/s, got {value!r}")
        bw[key] = float(value) * 1e9
    latency = links.get("inter_node_latency_ms", 0.0)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
        raise ClusterError(f"{where}: links.inter_node_latency_ms must be a number >= 0, got {latency!r}")
    emulate = _flag(links, "emulate", f"{where}: links.")
    return Cluster(name=spec.get("name", "cluster"), device_types=types, nodes=tuple(nodes),
                   intra_node_bandwidth=bw["intra_node_GBps"], inter_node_bandwidth=bw["inter_node_GBps"],
                   inter_node_latency=latency / 1e3, emulate_links=emulate)


# Table 1 of the paper: FP32 peak = 2 x CUDA cores x boost clock; memory; memory bandwidth.
# Links (§8.1): PCIe 3.0 x16 inside a node (15.75 GB/s), 56 Gb/s InfiniBand between nodes.
PRESETS = {
    "paper": {
        "name": "paper",
        "device_types": {
            "V": {"label": "TITAN V", "peak_tflops": 2 * 5120 * 1.455e-3, "memory": "12G",
                  "memory_bandwidth_GBps": 653},
            "R": {"label": "TITAN RTX", "peak_tflops": 2 * 4608 * 1.770e-3, "memory": "24G",
                  "memory_bandwidth_GBps": 672},
            "G": {"label": "GeForce RTX 2060", "peak_tflops": 2 * 1920 * 1.680e-3, "memory": "6G",
                  "memory_bandwidth_GBps": 336},
            "Q": {"label": "Quadro P4000", "peak_tflops": 2 * 1792 * 1.480e-3, "memory": "8G",
                  "memory_bandwidth_GBps": 243},
        },
        "nodes": [{"name": "node-V", "device_type": "V", "count": 4},
                  {"name": "node-R", "device_type": "R", "count": 4},
                  {"name": "node-G", "device_type": "G", "count": 4},
                  {"name": "node-Q", "device_type": "Q", "count": 4}],
        "links": {"intra_node_GBps": 15.75, "inter_node_GBps": 56 / 8},
    },
    # This host's emulated devices: two "nodes" of two devices each, one type twice as fast.
    # Tensors between emulated devices stay in host memory (a fast link).
    "local": {
        "name": "local",
        "device_types": {
            "F": {"label": "emulated fast", "emulated_speed": 1.0, "memory": "64M"},
            "S": {"label": "emulated slow", "emulated_speed": 0.5, "memory": "32M"},
        },
        "nodes": [{"name": "host-F", "device_type": "F", "count": 2},
                  {"name": "host-S", "device_type": "S", "count": 2}],
        "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0},
    },
    # This host's CPU as it is, as two "nodes" of two devices (real compute, no pacing: the
    # tasks share the host's cores).
    "local_cpu": {
        "name": "local_cpu",
        "device_types": {"C": {"label": "host CPU", "host_cpu": True, "memory": "1G"}},
        "nodes": [{"name": "host-A", "device_type": "C", "count": 2},
                  {"name": "host-B", "device_type": "C", "count": 2}],
        "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0},
    },
    # The paper's cluster as CPU-quota nodes of this host: four node types of two devices each,
    # whose quotas (cores per device) stand as the speeds of V, R, G and Q do in the emulated
    # comparisons (1 : 0.67 : 0.4 : 0.33), scaled so that the nodes hold 1.44 of this 2-core
    # machine's cores and leave 0.56 to the chief and the parameter servers; memory in Table 1's
    # proportions.
    "paper_quota": {
        "name": "paper_quota",
        "device_types": {
            "V": {"label": "CPU quota as TITAN V", "host_cpu": True, "cpu_quota": 0.3, "memory": "1536M"},
            "R": {"label": "CPU quota as TITAN RTX", "host_cpu": True, "cpu_quota": 0.2, "memory": "3G"},
            "G": {"label": "CPU quota as GeForce RTX 2060", "host_cpu": True, "cpu_quota": 0.12, "memory": "768M"},
            "Q": {"label": "CPU quota as Quadro P4000", "host_cpu": True, "cpu_quota": 0.1, "memory": "1G"},
        },
        "nodes": [{"name": "node-V", "device_type": "V", "count": 2},
                  {"name": "node-R", "device_type": "R", "count": 2},
                  {"name": "node-G", "device_type": "G", "count": 2},
                  {"name": "node-Q", "device_type": "Q", "count": 2}],
        "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0},
    },
}


#: The cluster name that stands for this machine's devices (:mod:`hetpipe_tf.runtime.discovery`).
DISCOVER = "discover"


def load_cluster(name_or_path: str | dict[str, Any] | Cluster) -> Cluster:
    """A preset by name (``paper``, ``local``, ``local_cpu``, ``paper_quota``) or a JSON file's path."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    if isinstance(name_or_path, dict):
        return from_dict(name_or_path)
    if name_or_path in PRESETS:
        return from_dict(PRESETS[name_or_path], where=f"preset '{name_or_path}'")
    if name_or_path == DISCOVER:
        raise ClusterError(f"cluster {DISCOVER!r} is this machine's devices, which TensorFlow lists: resolve it "
                           f"with hetpipe_tf.runtime.discovery.cluster_for (HetPipeStrategy, hetpipe plan and "
                           f"hetpipe-train do)")
    if not os.path.exists(str(name_or_path)):
        raise ClusterError(f"no cluster preset or file named {name_or_path!r}; presets: {sorted(PRESETS)}")
    try:
        with open(name_or_path) as f:
            spec = json.load(f)
    except ValueError as e:
        raise ClusterError(f"{name_or_path}: not valid JSON ({e})") from e
    return from_dict(spec, where=str(name_or_path))


def with_device_types(name_or_path: str, types: str) -> Cluster:

    """The cluster (a preset's name or a file) with only the nodes of the device types named in
    `types` (e.g. ``"VR"``), as the paper's Table 4 runs on 1, 2, 3 or 4 of its node types.

    Returns:
        The smaller cluster.

    Raises:
        ClusterError: it has no nodes of those types.
    """
    cluster = load_cluster(name_or_path)
    nodes = tuple(n for n in cluster.nodes if n.device_type in types)
    if not nodes:
        raise ClusterError(f"cluster '{cluster.name}' has no nodes of the device types {types!r}")
    return Cluster(name=f"{cluster.name}-{types}", device_types={t: cluster.device_types[t] for t in
                                                                 {n.device_type for n in nodes}},
                   nodes=nodes, intra_node_bandwidth=cluster.intra_node_bandwidth,
                   inter_node_bandwidth=cluster.inter_node_bandwidth, inter_node_latency=cluster.inter_node_latency,
                   emulate_links=cluster.emulate_links, discovered=cluster.discovered)


#: A real device spec's type (``cpu``, ``gpu:I``) as a cluster file describes one: what the caller
#: that can ask TensorFlow knows of it (:func:`hetpipe_tf.runtime.discovery.spec_device_type`).
RealTypes = Callable[[DeviceSpec], dict[str, Any]]


def _spec_types(specs: Sequence[DeviceSpec], real: RealTypes | None) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The device type name of every spec (specs of one kind and memory share a type) and each
    type's description: an emulated spec's from its speed and memory, a real one's from `real`.

    Returns:
        (the type name of each spec, in order; each type's description by name).

    Raises:
        ClusterError: a spec is neither emulated nor a real device that can be described.
    """
    names: list[str] = []
    described: dict[str, dict[str, Any]] = {}
    keys: dict[tuple[Any, ...], str] = {}
    for spec in specs:
        if spec.emulated:
            key: tuple[Any, ...] = ("emulated", spec.speed, spec.memory)
            description = {"label": f"emulated speed {spec.speed:g}", "emulated_speed": spec.speed,
                           "memory": spec.memory or 64 * 1024 ** 3}
        elif real is None:
            raise ClusterError(f"{spec} is a real device: planning for it needs what TensorFlow says of it "
                               f"(hetpipe_tf.runtime.discovery.spec_device_type, as hetpipe-train --plan=auto "
                               f"passes), or describe it in a cluster file")
        else:
            description = real(spec)
            key = (spec.kind, description.get("device_name"), description["memory"])
        if key not in keys:
            prefix = {"emulated": "E", "cpu": "CPU", "gpu": "G"}[spec.kind]
            keys[key] = f"{prefix}{len(keys)}"
            described[keys[key]] = description
        names.append(keys[key])
    return names, described


def from_device_specs(specs: Sequence[DeviceSpec], name: str = "devices", real: RealTypes | None = None) -> Cluster:
    """A cluster of the devices given as DeviceSpecs (``--devices``): one node per device type
    (emulated specs of one speed and memory; the host CPU; GPUs of one kind and memory), joined by
    host-memory links. A real device's type is `real`'s description of it (a real accelerator
    measured on this machine, the host CPU as it is).

    Returns:
        The cluster.
    """
    names, described = _spec_types(specs, real)
    counts = {t: names.count(t) for t in described}
    return from_dict({
        "name": name, "device_types": described,
        "nodes": [{"name": f"{name}-{t}", "device_type": t, "count": n} for t, n in counts.items()],
        "links": PRESETS["local"]["links"]}, where=name)
