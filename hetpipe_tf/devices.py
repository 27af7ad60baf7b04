"""Devices of a virtual worker: what the user asks for and the TensorFlow devices that serve it.

A device is one of:

* ``SPEED[@MEMORY]`` or ``emu:SPEED[@MEMORY]``: an emulated device on the host
  CPU, ``SPEED`` times as fast as the host running one task alone, holding at
  most ``MEMORY`` bytes (accounted by :mod:`hetpipe_tf.emulation`);
* ``cpu``: the host CPU as it is;
* ``gpu:I`` or ``gpu:I@MEMORY``: physical GPU ``I`` as it is, or a logical GPU
  on it with that memory limit (several such items on one GPU emulate several
  small cards; TensorFlow enforces the limit).

Memory takes ``K``, ``M``, ``G`` (powers of 1024), e.g. ``0.5@256M``.
"""
import re
import warnings
from dataclasses import dataclass

from hetpipe_tf.emulation import format_bytes

_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}
_GRAMMAR = ("SPEED[@MEMORY] or emu:SPEED[@MEMORY] (emulated on the host CPU), cpu, "
            "gpu:INDEX[@MEMORY]; e.g. '1@512M,0.5@256M' or 'gpu:0@2G,gpu:0@2G'")


class DeviceSpecError(ValueError):
    """A device description that cannot be parsed or served."""


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "emulated", "cpu" or "gpu"
    index: int = 0  # physical GPU index for "gpu"
    speed: float = 1.0
    memory: int | None = None  # bytes

    @property
    def emulated(self):
        return self.kind == "emulated"

    def __str__(self):
        mem = f", memory {format_bytes(self.memory)}" if self.memory else ""
        if self.emulated:
            return f"emulated device (speed {self.speed:g}{mem})"
        if self.kind == "gpu":
            return f"GPU {self.index}" + (f" (logical, limit {format_bytes(self.memory)})" if self.memory else "")
        return "host CPU"


def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise DeviceSpecError(f"cannot read memory size {text!r}: use a number with K, M or G, e.g. 512M")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise DeviceSpecError(f"memory size must be > 0, got {text!r}")
    return value


def parse_device(text):
    item = text.strip()
    mem = None
    if "@" in item:
        item, _, mem_text = item.partition("@")
        mem = parse_bytes(mem_text)
    low = item.strip().lower()
    if low == "cpu":
        if mem is not None:
            raise DeviceSpecError(f"device {text!r}: the host CPU takes no memory limit; "
                                  f"use an emulated device (SPEED@MEMORY) for that")
        return DeviceSpec("cpu")
    if low.startswith("gpu"):
        m = re.fullmatch(r"gpu(?::(\d+))?", low)
        if not m:
            raise DeviceSpecError(f"cannot read device {text!r}; allowed: {_GRAMMAR}")
        return DeviceSpec("gpu", index=int(m.group(1) or 0), memory=mem)
    if low.startswith("emu:"):
        low = low[4:]
    try:
        speed = float(low)
    except ValueError:
        raise DeviceSpecError(f"cannot read device {text!r}; allowed: {_GRAMMAR}") from None
    if not speed > 0:
        raise DeviceSpecError(f"device {text!r}: speed must be > 0, got {speed}")
    return DeviceSpec("emulated", speed=speed, memory=mem)


def parse_devices(text):
    """A tuple of DeviceSpec from a comma-separated list (see the module docstring)."""
    if isinstance(text, (list, tuple)):
        return tuple(d if isinstance(d, DeviceSpec) else parse_device(d) for d in text)
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise DeviceSpecError(f"no devices given; allowed: {_GRAMMAR}")
    return tuple(parse_device(t) for t in items)


def configure_tensorflow_devices(specs):
    """TensorFlow device names serving `specs`, creating logical devices where needed.

    Emulated devices get one logical CPU device each (placement labels; they share
    the host's cores). GPUs with a memory limit become logical GPUs. Logical devices
    can only be made before TensorFlow initialises its runtime; if it already has,
    emulated devices share the logical CPUs that exist.
    """
    import tensorflow as tf

    specs = tuple(specs)
    emulated = [s for s in specs if s.emulated]
    gpus = tf.config.list_physical_devices("GPU")
    limits = {}  # physical GPU -> memory limits of the logical GPUs asked on it
    for s in specs:
        if s.kind == "gpu":
            if s.index >= len(gpus):
                raise DeviceSpecError(f"device gpu:{s.index} was asked for, but TensorFlow sees "
                                      f"{len(gpus)} GPU(s)" + (" (is tensorflow-cpu installed?)" if not gpus else ""))
            limits.setdefault(s.index, []).append(s.memory)
    for i, mems in limits.items():
        if any(mems) and not all(mems):
            raise DeviceSpecError(f"the items on gpu:{i} must all give a memory limit or none, got "
                                  f"{[format_bytes(m) if m else None for m in mems]}")
    try:
        if emulated:
            cpu = tf.config.list_physical_devices("CPU")[0]
            if len(tf.config.get_logical_device_configuration(cpu) or []) < len(emulated):
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * max(len(emulated), 2))
        for i, mems in limits.items():
            if all(mems):
                tf.config.set_logical_device_configuration(
                    gpus[i], [tf.config.LogicalDeviceConfiguration(memory_limit=m // 1024 ** 2)
                              for m in mems])
    except RuntimeError:
        pass  # the runtime is already initialised: use the logical devices it has
    logical_cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(logical_cpus) < len(emulated):
        warnings.warn(f"TensorFlow started before the devices were configured, so {len(emulated)} emulated "
                      f"devices share {len(logical_cpus)} logical CPU device(s); emulation is unaffected "
                      f"(call configure_tensorflow_devices first to give each its own device name)")
    logical_gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    # TensorFlow numbers logical GPUs in the order of their physical GPUs.
    per_gpu = [len(limits[i]) if all(limits.get(i, [None])) else 1 for i in range(len(gpus))]
    names, next_cpu, used = [], 0, {}
    for spec in specs:
        if spec.kind == "gpu":
            slot = used.get(spec.index, 0) if spec.memory else 0
            used[spec.index] = slot + 1
            names.append(logical_gpus[min(sum(per_gpu[:spec.index]) + slot, len(logical_gpus) - 1)])
        elif spec.emulated:
            names.append(logical_cpus[next_cpu % len(logical_cpus)])
            next_cpu += 1
        else:
            names.append(logical_cpus[0])
    return tuple(names)
