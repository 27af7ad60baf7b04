"""This machine's devices as a cluster, each type's speed measured on the model (HetPipe §7: the
model is profiled on each type of device).

``cluster="discover"`` (``HetPipeStrategy``, ``hetpipe plan --cluster=discover``,
``hetpipe-train --cluster=discover``) plans for the devices of the machine it runs on:

* **Listing**: :func:`physical_devices`, the one function that asks TensorFlow what there is
  (``tf.config.list_physical_devices`` and each GPU's ``tf.config.experimental.get_device_details``:
  its ``device_name`` and ``compute_capability``; a GPU's memory is what TensorFlow's allocator
  may use of it, the host CPU's the host's RAM).
* **Types**: GPUs of one device name and compute capability are one device type (``G0``, ``G1``,
  ...; its memory the least of its GPUs'), each a node of its own; a machine without a GPU is its
  host CPU, one device of a ``host_cpu`` type (``CPU``). GPU types carry no peak TFLOP/s: their
  ``device_name`` marks them measured (:attr:`hetpipe_tf.planning.cluster.DeviceType.measured`).
  The links are host memory's (CPU) or PCIe 3.0 x16's (GPUs), as the presets describe them.
* **Speeds**: :func:`measure_device_speeds` times the model's forward and backward passes on a
  minibatch (:func:`hetpipe_tf.runtime.profiler.model_passes`, as CPU-quota types are timed) on
  one device of each type, and on the host CPU; a type's speed is the host CPU's time over its
  own. :func:`with_device_speeds` gives every measured type the profile's host times (measured
  per segment on the host CPU by :mod:`hetpipe_tf.runtime.profiler`) divided by its speed; the
  host CPU's own times are those.

Discovery is one machine's: under ``launch="tf_config"`` the tasks run on other machines, whose
devices this process cannot list, so ``discover`` is refused there (describe them in a cluster
file; one whose accelerator types give a ``device_name`` and no peak is measured the same way, on
the machine that plans, where it has such a device).
"""
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from hetpipe_tf.pipeline.emulation import format_bytes
from hetpipe_tf.planning.cluster import DISCOVER, PRESETS, Cluster, ClusterError, DeviceType, from_dict, load_cluster
from hetpipe_tf.planning.devices import DeviceSpec, DeviceSpecError
from hetpipe_tf.planning.profile import Profile
from hetpipe_tf.runtime.profiler import Batch, host_name, model_passes, timed_calls

#: The host CPU's TensorFlow device, where the reference passes run.
HOST_DEVICE = "/device:CPU:0"
#: Timed runs of each device's passes, of which the least mean is taken (other work only adds time).
RUNS = 3
#: PCIe 3.0 x16, GB/s: the links between and within the GPU nodes of one machine.
PCIE_GBPS = 15.75


@dataclasses.dataclass(frozen=True)
class PhysicalDevice:
    """One device of this machine as TensorFlow describes it."""
    kind: str  # "CPU" or "GPU"
    index: int  # among the devices of its kind
    name: str  # a GPU's device_name detail; the CPU's model name
    compute_capability: tuple[int, int] | None  # a GPU's
    memory: int  # bytes
    tf_device: str  # the TensorFlow device its passes run on


def host_memory() -> int:
    """Bytes of this host's RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.cache
def _gpu_memory() -> list[int]:
    """Bytes TensorFlow's allocator may use on each GPU, listed without taking it (memory growth)."""
    from hetpipe_tf.compat import device_lib  # late: TensorFlow's listing with each device's memory limit

    config = tf.compat.v1.ConfigProto()
    config.gpu_options.allow_growth = True
    return [int(d.memory_limit) for d in device_lib.list_local_devices(config) if d.device_type == "GPU"]


def physical_devices() -> list[PhysicalDevice]:
    """This machine's host CPU and GPUs, as TensorFlow lists and describes them (the one place that
    asks it: a test replaces this function to describe GPUs that are not here).

    Returns:
        The devices, the host CPU first.
    """
    devices = [PhysicalDevice("CPU", 0, host_name(), None, host_memory(), HOST_DEVICE)]
    gpus = tf.config.list_physical_devices("GPU")
    memory = _gpu_memory() if gpus else []
    for i, gpu in enumerate(gpus):
        details = tf.config.experimental.get_device_details(gpu)
        capability = details.get("compute_capability")
        devices.append(PhysicalDevice("GPU", i, details.get("device_name", f"GPU {i}"),
                                      tuple(capability) if capability else None, memory[i], f"/device:GPU:{i}"))
    return devices


def _label(device: PhysicalDevice) -> str:
    if device.kind == "CPU":
        return f"host CPU ({device.name})"
    capability = device.compute_capability
    return device.name + (f" (compute capability {capability[0]}.{capability[1]})" if capability else "")


def discover_cluster(devices: Sequence[PhysicalDevice] | None = None) -> Cluster:
    """This machine's devices (`devices`: :func:`physical_devices`') as a cluster (see the module
    docstring): a node per GPU type, or the host CPU alone where there is no GPU.

    Returns:
        The cluster of this machine's devices.
    """
    devices = list(physical_devices() if devices is None else devices)
    gpus = [d for d in devices if d.kind == "GPU"]
    kinds: dict[tuple[str, tuple[int, int] | None], list[PhysicalDevice]] = {}
    for d in gpus:
        kinds.setdefault((d.name, d.compute_capability), []).append(d)
    types, nodes = {}, []
    for i, of_kind in enumerate(kinds.values()):
        types[f"G{i}"] = {"label": _label(of_kind[0]), "device_name": of_kind[0].name,
                          "memory": min(d.memory for d in of_kind)}
        nodes.append({"name": f"host-G{i}", "device_type": f"G{i}", "count": len(of_kind),
                      "gpus": [d.index for d in of_kind]})  # TensorFlow's numbering, as launch maps it
    if not gpus:
        cpu = next(d for d in devices if d.kind == "CPU")
        types["CPU"] = {"label": _label(cpu), "host_cpu": True, "memory": cpu.memory}
        nodes.append({"name": "host-CPU", "device_type": "CPU", "count": 1})
    links = {"intra_node_GBps": PCIE_GBPS, "inter_node_GBps": PCIE_GBPS} if gpus else PRESETS["local_cpu"]["links"]
    return dataclasses.replace(from_dict({"name": DISCOVER, "device_types": types, "nodes": nodes, "links": links},
                                         where="discovered devices"), discovered=True)


def describe_discovered(cluster: Cluster) -> str:
    """What discovery found, in one line per device type."""
    lines = [f"{n.count}x {cluster.device_types[n.device_type].label} as type {n.device_type} on node {n.name}, "
             f"{format_bytes(cluster.device_types[n.device_type].memory)} "
             f"{'of host RAM' if cluster.device_types[n.device_type].host_cpu else 'of device memory'}"
             for n in cluster.nodes]
    if all(t.host_cpu for t in cluster.device_types.values()):
        lines.append("no GPU: TensorFlow lists none, so the host CPU is the one device")
    return "discovered on this machine: " + "; ".join(lines)


def cluster_for(name_or_path: str | dict[str, Any] | Cluster, launch: str | None = None) -> Cluster:
    """The cluster `name_or_path` names (:func:`hetpipe_tf.planning.cluster.load_cluster`), or for
    ``"discover"`` this machine's (:func:`discover_cluster`, said in one line). `launch`: where the
    tasks run; ``"tf_config"`` (other machines) cannot take ``discover``.

    Returns:
        The cluster.

    Raises:
        ClusterError: discover under launch='tf_config', or what loading the description raises.
    """
    if not (isinstance(name_or_path, str) and name_or_path == DISCOVER):
        return load_cluster(name_or_path)
    if launch == "tf_config":
        raise ClusterError(f"cluster {DISCOVER!r} is the devices of the machine that plans; under launch="
                           f"'tf_config' the tasks run on other machines, whose devices it cannot list: describe "
                           f"them in a cluster file (an accelerator type may give its device_name instead of "
                           f"peak_tflops to be measured where the plan is made)")
    cluster = discover_cluster()
    print(f"hetpipe: {describe_discovered(cluster)}", file=sys.stderr, flush=True)  # beside a --json output
    return cluster


def local_device(device_type: DeviceType, devices: Sequence[PhysicalDevice]) -> PhysicalDevice:
    """The device of this machine the speed of `device_type` is measured on: the host CPU for a host
    type, else the first GPU whose device_name is the type's; a ClusterError where there is none.

    Returns:
        The device.

    Raises:
        ClusterError: this machine has no device of the type.
    """
    if device_type.on_host:
        return next(d for d in devices if d.kind == "CPU")
    found = [d for d in devices if d.kind == "GPU" and d.name == device_type.device_name]
    if not found:
        have = sorted({d.name for d in devices if d.kind == "GPU"})
        raise ClusterError(f"device type '{device_type.name}' gives no peak_tflops, so its speed is measured on a "
                           f"device named {device_type.device_name!r} of this machine, which has "
                           f"{'GPUs ' + ', '.join(map(repr, have)) if have else 'no GPU'}: plan on a machine with "
                           f"the device, give the type peak_tflops and memory_bandwidth_GBps, or give a profile "
                           f"with its times (profile=, --profile)")
    return found[0]


@dataclasses.dataclass(frozen=True)
class DeviceSpeed:
    """One device type's speed on the model's passes: seconds per pass on one of its devices and on
    the host CPU, and their ratio (1 for the host CPU itself, the reference)."""
    device_type: str
    device: str  # the TensorFlow device timed
    pass_seconds: float
    host_seconds: float
    host_cpu: bool = False  # the type is the host CPU's: planned on the profile's host times as they are

    @property
    def speed(self) -> float:
        """How much faster than the host CPU the type runs the passes."""
        return self.host_seconds / self.pass_seconds

    def __str__(self) -> str:
        return (f"{self.device_type}: speed {self.speed:.3f} against the host CPU (a pass {self.pass_seconds * 1e3:.2f} "
                f"ms on {self.device}, {self.host_seconds * 1e3:.2f} ms on {HOST_DEVICE})")


def _passes_on(model: keras.Model, loss: str | keras.losses.Loss, sample: tuple[Batch, Batch],
               device: str, copy: bool) -> Callable[[], None]:
    """The model's passes on `sample` traced on `device`; with `copy`, on a copy of the model made
    there, whose weights live on the device (a subclassed model, which Keras cannot copy, runs as it is).

    Returns:
        The traced passes: a call that runs them.
    """
    with tf.device(device):
        placed = model
        if copy:
            try:
                placed = keras.models.clone_model(model)
                placed.set_weights(model.get_weights())
            except (TypeError, ValueError, NotImplementedError):
                placed = model
        run = model_passes(placed, loss, *[tf.nest.map_structure(tf.identity, part) for part in sample])
        run()  # traces the passes here
    return run


def _seconds(run: Callable[[], None], device: str, seconds: float) -> float:
    with tf.device(device):
        return min(timed_calls(run, seconds)[0] for _ in range(RUNS))


def measure_device_speeds(model: keras.Model, sample: tuple[Batch, Batch], types: Sequence[DeviceType],
                          loss: str | keras.losses.Loss = "sparse_categorical_crossentropy",
                          devices: Sequence[PhysicalDevice] | None = None,
                          seconds: float = 0.1) -> dict[str, DeviceSpeed]:
    """Each of `types`: its :class:`DeviceSpeed` on `model`'s passes on `sample` (x, y), timed on
    one of its devices of this machine (`devices`: :func:`physical_devices`'; a GPU's passes on a
    copy of the model made there) and on the host CPU, each the least of :data:`RUNS` runs of at
    least `seconds`. The model's non-trainable state is restored afterwards.

    Returns:
        Type name -> its DeviceSpeed.
    """
    devices = list(physical_devices() if devices is None else devices)
    on = {t.name: local_device(t, devices) for t in types}  # refused before anything is timed
    state = [v.numpy() for v in model.non_trainable_variables]
    try:
        host = _seconds(_passes_on(model, loss, sample, HOST_DEVICE, copy=False), HOST_DEVICE, seconds)
        timed = {d: host if d.kind == "CPU" else
                 _seconds(_passes_on(model, loss, sample, d.tf_device, copy=True), d.tf_device, seconds)
                 for d in set(on.values())}
    finally:
        for v, value in zip(model.non_trainable_variables, state):
            v.assign(value)
    return {name: DeviceSpeed(name, d.tf_device, timed[d], host, host_cpu=d.kind == "CPU") for name, d in on.items()}


def speeds_profile(profile: Profile, speeds: dict[str, DeviceSpeed]) -> Profile:
    """`profile` with the times of every type of `speeds` that is not the host's: its host times
    (key ``"host"``) divided by the type's speed.

    Returns:
        The profile with those times.

    Raises:
        ValueError: `profile` has no host times to divide.
    """
    return profile.with_host_speeds({name: (s.speed, f"measured on {s.device}") for name, s in speeds.items()
                                     if not s.host_cpu}, "the types' speeds")


def with_device_speeds(profile: Profile, model: keras.Model, sample: Callable[[], tuple[Batch, Batch]],
                       cluster: Cluster, loss: str | keras.losses.Loss) -> Profile:
    """`profile` with every measured device type of `cluster` timed (:func:`measure_device_speeds`
    on the minibatch `sample()` gives, then :func:`speeds_profile`), each said in one line; a
    discovered cluster's host CPU is timed too, to say its pass. As it is where nothing is to be
    measured (the profile has the types' times: one given, measured with them).

    Returns:
        The profile, timed for every measured type of `cluster`.
    """
    types = [t for t in cluster.device_types.values()
             if (t.measured and t.name not in profile.times) or (cluster.discovered and t.host_cpu)]
    if not types:
        return profile
    speeds = measure_device_speeds(model, sample(), types, loss=loss)
    for speed in speeds.values():
        print(f"hetpipe: {speed}", file=sys.stderr, flush=True)
    return speeds_profile(profile, speeds)


def spec_device_type(spec: DeviceSpec, devices: Sequence[PhysicalDevice] | None = None) -> dict[str, Any]:
    """A real device spec's type as a cluster file describes it (``from_device_specs``' `real`): the
    host CPU as it is (``cpu``), or a GPU of this machine measured by its device name (``gpu:I``,
    its memory the spec's limit or the GPU's).

    Returns:
        The device type's description, as a cluster file's device_types entry.

    Raises:
        DeviceSpecError: the spec names a GPU this machine does not have.
    """
    devices = list(physical_devices() if devices is None else devices)
    if spec.kind == "cpu":
        cpu = next(d for d in devices if d.kind == "CPU")
        return {"label": _label(cpu), "host_cpu": True, "memory": cpu.memory}
    gpus = [d for d in devices if d.kind == "GPU"]
    if spec.index >= len(gpus):
        raise DeviceSpecError(f"device gpu:{spec.index} was asked for, but TensorFlow sees {len(gpus)} GPU(s)")
    gpu = gpus[spec.index]
    return {"label": _label(gpu), "device_name": gpu.name, "memory": spec.memory or gpu.memory}
