"""The measured speed of CPU-quota devices, and a profile that plans them on it (HetPipe §7: the
model is profiled on each type of device).

A CPU-quota device type (``"host_cpu": true, "cpu_quota": Q``, :mod:`hetpipe_tf.planning.cluster`)
is Q cores of this host: its speed is measured, not assumed. :func:`measure_quota_speeds` times
the model's passes (a forward and a backward pass of the whole model on one minibatch, as
TensorFlow runs Keras's model, nothing applied) in this process, first unconstrained, then with
this process held in a group of quota Q (:mod:`hetpipe_tf.distributed.cgroups`, the period of a
node's group): the same passes with the same intra-op threads. So this process's threads should be
those the devices' tasks run with (a worker task's: one intra-op thread), and nothing else should
run in it while it is held (a connected chief's heartbeats would be held with it: measure before
connecting).

Definitions (:class:`QuotaSpeed`):

* ``free_seconds``: wall seconds per pass unconstrained, the least over :data:`FREE_RUNS` short
  runs before each type's runs in its group (other work on the machine only ever adds time, as
  the profile's host times are taken); one figure for every type, so that their speeds differ by
  their groups' runs only; ``free_cores``: the cores the passes kept busy in that run (this
  process's CPU seconds per wall second);
* ``group_seconds``: wall seconds per pass in the group, the least of :data:`GROUP_RUNS` runs'
  means, each run at least :data:`GROUP_PERIODS` periods of the quota long (a run within one
  period could fit in its grant and not be throttled at all; one of N periods takes at most
  N + 1 periods' grants, a speed at most 1/N above the quota's);
* ``speed = free_seconds / group_seconds``: how much slower the device runs the passes than the
  host, which the planner divides the host's times by;
* ``share = cpu_quota / free_cores``: the speed the quota allows when the passes need the same CPU
  seconds in the group as outside; with one intra-op thread ``free_cores`` is about 1, and the
  speed is the CPU time a busy thread receives per wall second.

:func:`quota_profile` adds to a profile measured on this host (:mod:`hetpipe_tf.runtime.profiler`)
the times of every quota type, the host's divided by its speed; the cost model plans quota types
on those only. :func:`with_measured_speeds` is what a run calls: the quota types' speeds and those
of the accelerators measured on this machine (:mod:`hetpipe_tf.runtime.discovery`).
"""
import dataclasses
import os
from collections.abc import Callable

import keras

from hetpipe_tf.distributed.cgroups import CGROUP_ROOT, CpuGroups
from hetpipe_tf.planning.cluster import Cluster
from hetpipe_tf.planning.profile import Profile
from hetpipe_tf.runtime.discovery import with_device_speeds
from hetpipe_tf.runtime.profiler import Batch, model_passes, timed_calls

#: The least number of the quota's periods a run in the group spans.
GROUP_PERIODS = 25
#: Runs in each group, of which the least mean is taken (the machine's other work only ever adds time).
GROUP_RUNS = 3
#: Unconstrained runs, of which the least is taken.
FREE_RUNS = 10


@dataclasses.dataclass(frozen=True)
class QuotaSpeed:
    """One quota type's measured speed (see the module docstring for the definitions)."""
    device_type: str
    cpu_quota: float
    free_seconds: float
    free_cores: float
    group_seconds: float

    @property
    def speed(self) -> float:
        """The type's speed relative to this host running a pass alone: free time over group time."""
        return self.free_seconds / self.group_seconds

    @property
    def share(self) -> float:
        """The quota's share of the cores a pass takes unconstrained."""
        return self.cpu_quota / self.free_cores

    def __str__(self) -> str:
        return (f"{self.device_type}: speed {self.speed:.3f} (a pass {self.group_seconds * 1e3:.1f} ms in a group of "
                f"{self.cpu_quota:g} cores, {self.free_seconds * 1e3:.2f} ms outside on {self.free_cores:.2f} cores), "
                f"quota share {self.share:.3f}")


def measure_quota_speeds(model: keras.Model, sample: tuple[Batch, Batch], cluster: Cluster,
                         loss: str | keras.losses.Loss = "sparse_categorical_crossentropy",
                         cgroup_root: str = CGROUP_ROOT, free_seconds: float = 0.05) -> dict[str, QuotaSpeed]:
    """Every quota device type of `cluster`: its :class:`QuotaSpeed` on `model`'s passes on `sample`,
    a minibatch (x, y). `free_seconds`: the length of each unconstrained run; a run in a group
    spans :data:`GROUP_PERIODS` periods of its quota, or five unconstrained runs if longer. The
    model's non-trainable state is restored afterwards.

    Args:
        model: the Keras model whose passes are timed.
        sample: a minibatch (x, y).
        cluster: the cluster description whose CPU-quota device types are measured.
        loss: the loss the passes compute.
        cgroup_root: where the cgroup filesystem is mounted.
        free_seconds: the length of each unconstrained run.

    Returns:
        Each quota type's QuotaSpeed, by type name.

    Raises:
        ValueError: the cluster has no CPU-quota device types.
        CgroupError: the groups cannot be made here.
    """
    types = [t for t in cluster.device_types.values() if t.cpu_quota is not None]
    if not types:
        raise ValueError(f"cluster '{cluster.name}' has no CPU-quota device types (\"host_cpu\": true with a "
                         f"\"cpu_quota\"): there is no speed to measure; plan it on the profile as it is")
    groups = CpuGroups(cgroup_root)
    state = [v.numpy() for v in model.non_trainable_variables]
    run = model_passes(model, loss, *sample)
    run()  # traces the passes
    free, in_group = [], {}
    try:
        for t in types:
            free.extend(timed_calls(run, free_seconds) for _ in range(FREE_RUNS))
            group = groups.create(f"probe-{t.name}", t.cpu_quota)
            with group.holding(os.getpid()):
                length = max(GROUP_PERIODS * group.period_us * 1e-6, 5 * free_seconds)
                in_group[t] = min(timed_calls(run, length)[0] for _ in range(GROUP_RUNS))
            groups.remove(f"probe-{t.name}")
    finally:
        groups.remove_all()
        for v, value in zip(model.non_trainable_variables, state):
            v.assign(value)
    free_pass, free_cores = min(free, key=lambda timed: timed[0])
    return {t.name: QuotaSpeed(t.name, t.cpu_quota, free_pass, free_cores, seconds) for t, seconds in in_group.items()}


def quota_profile(profile: Profile, speeds: dict[str, QuotaSpeed]) -> Profile:
    """`profile` with the times of every type of `speeds`: the host's (measured on this host, key
    ``"host"``) divided by its measured speed.

    Args:
        profile: a profile with times measured on this host (key ``"host"``).
        speeds: the QuotaSpeeds of :func:`measure_quota_speeds`, by type name.

    Returns:
        The profile with a time per quota type.

    Raises:
        ValueError: the profile has no times measured on this host.
    """
    return profile.with_host_speeds({name: (s.speed, f"measured in a CPU-quota group of {s.cpu_quota:g} cores")
                                     for name, s in speeds.items()}, "the quota types' speeds")


def with_measured_speeds(profile: Profile, model: keras.Model, sample: Callable[[], tuple[Batch, Batch]],
                         cluster: Cluster, loss: str | keras.losses.Loss) -> Profile:
    """`profile` with every device type of `cluster` whose speed is measured timed, as the planner
    needs them, each said in one line: CPU-quota types on `model`'s passes on the minibatch
    `sample()` gives, in groups of their quotas (:func:`measure_quota_speeds`), and accelerators
    given without a peak (and a discovered cluster's types) on one device of theirs of this machine
    (:func:`hetpipe_tf.runtime.discovery.with_device_speeds`). As it is where there are none or the
    profile has their times already (one given, measured with them).

    Returns:
        The profile, timed for every measured type of `cluster`.
    """
    missing = [t for t in cluster.device_types.values() if t.cpu_quota is not None and t.name not in profile.times]
    if missing:
        speeds = measure_quota_speeds(model, sample(), cluster, loss=loss)
        for speed in speeds.values():
            print(f"hetpipe: {speed}", flush=True)
        profile = quota_profile(profile, speeds)
    return with_device_speeds(profile, model, sample, cluster, loss)
