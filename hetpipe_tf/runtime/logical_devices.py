"""TensorFlow devices for device specs: logical CPUs for emulated devices, logical GPUs with
memory limits for small cards (see :mod:`hetpipe_tf.planning.devices` for the specs)."""
import warnings
from collections.abc import Sequence

from hetpipe_tf.pipeline.emulation import format_bytes
from hetpipe_tf.planning.devices import DeviceSpec, DeviceSpecError


def configure_tensorflow_devices(specs: Sequence[DeviceSpec]) -> tuple[str, ...]:
    """TensorFlow device names serving `specs`, creating logical devices where needed.

    Emulated devices get one logical CPU device each (placement labels; they share
    the host's cores). GPUs with a memory limit become logical GPUs. Logical devices
    can only be made before TensorFlow initialises its runtime; if it already has,
    emulated devices share the logical CPUs that exist.

    Args:
        specs: the DeviceSpecs, one per stage.

    Returns:
        The TensorFlow device name of each spec, in order.

    Raises:
        DeviceSpecError: a GPU is asked for that TensorFlow does not see, or the items on one GPU
            mix memory limits and none.
    """
    import tensorflow as tf  # late: defers TensorFlow

    specs = tuple(specs)
    emulated = [s for s in specs if s.emulated]
    gpus = tf.config.list_physical_devices("GPU")
    limits: dict[int, list[int | None]] = {}  # physical GPU -> memory limits of the logical GPUs asked on it
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
                              for m in mems if m is not None])  # all are, as checked
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
    names: list[str] = []
    next_cpu = 0
    used: dict[int, int] = {}
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
