"""Devices of a virtual worker: what the user asks for and the TensorFlow devices that serve it.

A device is one of:

* ``SPEED[@MEMORY]`` or ``emu:SPEED[@MEMORY]``: an emulated device on the host
  CPU, ``SPEED`` times as fast as the host running one task alone, holding at
  most ``MEMORY`` bytes (accounted by :mod:`hetpipe_tf.pipeline.emulation`);
* ``cpu``: the host CPU as it is;
* ``gpu:I`` or ``gpu:I@MEMORY``: physical GPU ``I`` as it is, or a logical GPU
  on it with that memory limit (several such items on one GPU emulate several
  small cards; TensorFlow enforces the limit).

Memory takes ``K``, ``M``, ``G`` (powers of 1024), e.g. ``0.5@256M``.
"""
import re
from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.pipeline.emulation import format_bytes

_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}
_GRAMMAR = ("SPEED[@MEMORY] or emu:SPEED[@MEMORY] (emulated on the host CPU), cpu, "
            "gpu:INDEX[@MEMORY]; e.g. '1@512M,0.5@256M' or 'gpu:0@2G,gpu:0@2G'")


class DeviceSpecError(HetPipeUsageError, ValueError):
    """A device description that cannot be parsed or served."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device a virtual worker's stage runs on: emulated (a speed, a memory), the host CPU or a GPU.

    Args:
        kind: ``"emulated"``, ``"cpu"`` or ``"gpu"``.
        index: the physical GPU's index, for ``"gpu"``.
        speed: an emulated device's speed relative to the host running one task alone.
        memory: the bytes the device holds at most (None: no limit), for ``"emulated"`` and
            ``"gpu"`` (a logical GPU with that memory limit).
    """
    kind: str  # "emulated", "cpu" or "gpu"
    index: int = 0  # physical GPU index for "gpu"
    speed: float = 1.0
    memory: int | None = None  # bytes

    @property
    def emulated(self) -> bool:
        """Whether the device is emulated on the host CPU."""
        return self.kind == "emulated"

    def __str__(self) -> str:
        mem = f", memory {format_bytes(self.memory)}" if self.memory else ""
        if self.emulated:
            return f"emulated device (speed {self.speed:g}{mem})"
        if self.kind == "gpu":
            return f"GPU {self.index}" + (f" (logical, limit {format_bytes(self.memory)})" if self.memory else "")
        return "host CPU"


def parse_bytes(text: str | int | float) -> int:
    """Bytes from '512M', '1.5G', '2GiB' or a number; a DeviceSpecError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise DeviceSpecError(f"cannot read memory size {text!r}: use a number with K, M or G, e.g. 512M")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise DeviceSpecError(f"memory size must be > 0, got {text!r}")
    return value


def parse_device(text: str) -> DeviceSpec:
    """The DeviceSpec of one item of a device list (see the module docstring)."""
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


def parse_devices(text: str | Sequence[str | DeviceSpec]) -> tuple[DeviceSpec, ...]:
    """The devices of a comma-separated list, in the grammar of the module docstring.

    Args:
        text: the list (``"1@512M,0.5@256M"``), or a sequence of its items or of DeviceSpecs.

    Returns:
        The DeviceSpecs, one per item, in order.

    Raises:
        DeviceSpecError: an item is not in the grammar, or its speed or memory is not valid.
    """
    if isinstance(text, (list, tuple)):
        return tuple(d if isinstance(d, DeviceSpec) else parse_device(d) for d in text)
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise DeviceSpecError(f"no devices given; allowed: {_GRAMMAR}")
    return tuple(parse_device(t) for t in items)
