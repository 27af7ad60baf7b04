"""CPU-quota groups: a node of a cluster on this machine that runs at a fraction of a core.

A process in a cgroup whose CPU quota is q cores receives at most q CPU seconds per wall second,
with nothing padded: the one real heterogeneity of compute a single machine has. The kernel's
``cpu`` controller enforces it (cgroup v1 at ``ROOT/cpu``, where it is mounted; else v2 at
``ROOT`` or ``ROOT/unified``, whichever lists ``cpu`` among its controllers).

* :func:`find_cpu_controller` finds the controller and refuses, naming what is missing, where
  groups cannot be made (no cgroup filesystem, no ``cpu`` controller, not root, read-only).
* :class:`CpuGroups` makes the groups of one owner process (a cluster's chief), named
  ``hetpipe-OWNERPID-NAME``, and removes them: at the end (:meth:`CpuGroups.remove_all`), and
  after the owner is killed, by a reaper process (:meth:`CpuGroups.start_reaper`) that waits for
  the owner's end and then removes its groups. :func:`reap_orphans` removes the groups of owners
  no longer alive (what a reaper that was itself killed left).
* :class:`CpuGroup`: one group; a process enters it at its start (:meth:`CpuGroup.command`, the
  command wrapped in a shell that writes its own pid, then execs: nothing runs outside first),
  or is moved into it (:meth:`CpuGroup.add`, :meth:`CpuGroup.holding`); :func:`rank_command`
  starts each rank of a launcher that runs one command for all of them in a group of its own.
* :func:`enter_command` runs a command in a group given by its procs file: a quota node's worker
  task starts the processes a chief asks of it (a virtual worker's) in the group its own starter
  was in (:data:`HOST_GROUP_ENV`), outside every quota group.

What runs in a group is a device's compute: a node's worker task, which runs its stages' kernels.
The host's runtime that drives the devices (a virtual worker's own process: its executor, its
remote calls, its pushes and pulls; the chief; the parameter servers) runs outside every group, as
a GPU server runs its Python on its host CPU while its GPUs compute.

The period is :data:`PERIOD_US`, 10 ms: the kernel grants a group its quota per period and
throttles it for the rest, so with the default 100 ms a group of 0.2 cores would run 20 ms at full
speed and then stop for 80 ms, longer than a minibatch's tasks (milliseconds each on this
machine's models): the tasks would run in bursts, some at full speed, others stalled. At 10 ms a
stall is at most a few tasks long, and the quota (at least the kernel's 1 ms) allows groups of
0.1 core and more. A group's weight is :data:`WEIGHT` times the default, so that the quota is
what it receives on a busy machine too.
"""
import contextlib
import dataclasses
import os
import re
import select
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

from hetpipe_tf.errors import HetPipeRunError

#: Where the cgroup filesystems are mounted.
CGROUP_ROOT = "/sys/fs/cgroup"
#: The period of every group's quota, in microseconds (see the module docstring).
PERIOD_US = 10_000
#: The kernel's least quota per period, in microseconds.
MIN_QUOTA_US = 1_000
#: A group's scheduling weight, in multiples of the default: on a busy machine a group still
#: receives its quota (which caps it), as a device of its own does, rather than a share of what
#: the other processes leave.
WEIGHT = 10
#: The prefix of the groups' names: hetpipe-OWNERPID-NAME.
PREFIX = "hetpipe-"
#: The environment variable of a quota node's worker task that names the procs file of the group
#: the processes it starts run in (its starter's group: outside every quota group).
HOST_GROUP_ENV = "HETPIPE_HOST_CGROUP_PROCS"


class CgroupError(HetPipeRunError, RuntimeError):
    """CPU-quota groups cannot be made or used here."""


@dataclasses.dataclass(frozen=True)
class CpuController:
    """The mounted ``cpu`` controller: its directory and its cgroup version (1 or 2)."""
    path: str
    version: int

    def procs(self, group: str) -> str:
        """The file that lists (and takes) the processes of `group` (a path)."""
        return os.path.join(group, "cgroup.procs")


def _v2_has_cpu(path: str) -> bool:
    try:
        with open(os.path.join(path, "cgroup.controllers")) as f:
            return "cpu" in f.read().split()
    except OSError:
        return False


def find_cpu_controller(root: str = CGROUP_ROOT) -> CpuController:
    """The ``cpu`` controller under `root` (v1 first), checked writable: a group made there gets the
    controller's files. CgroupError names what is missing otherwise.

    Returns:
        The CpuController.

    Raises:
        CgroupError: there is no cgroup filesystem or ``cpu`` controller there, or it is not writable.
    """
    if not os.path.isdir(root):
        raise CgroupError(f"no cgroup filesystem at {root} (the directory does not exist): CPU-quota nodes need "
                          f"Linux cgroups with the cpu controller mounted there, or give the root where they are")
    if os.path.exists(os.path.join(root, "cpu", "cpu.cfs_quota_us")):
        controller = CpuController(os.path.join(root, "cpu"), 1)
    else:
        v2 = next((p for p in (root, os.path.join(root, "unified")) if _v2_has_cpu(p)), None)
        if v2 is None:
            raise CgroupError(f"no cpu controller under {root}: neither {root}/cpu/cpu.cfs_quota_us (cgroup v1) nor "
                              f"a cgroup.controllers listing cpu at {root} or {root}/unified (v2); mount the cpu "
                              f"controller (e.g. `mount -t cgroup -o cpu cgroup {root}/cpu`) to run CPU-quota nodes")
        controller = CpuController(v2, 2)
    _check_writable(controller)
    return controller


def _check_writable(controller: CpuController) -> None:
    probe = os.path.join(controller.path, f"{PREFIX}{os.getpid()}-probe")
    try:
        if controller.version == 2:
            _enable_cpu_v2(controller.path)
        os.makedirs(probe, exist_ok=True)
    except OSError as e:
        who = f"uid {os.getuid()}" + ("" if os.getuid() == 0 else ", not root: making cgroups needs root")
        raise CgroupError(f"cannot make a cgroup in {controller.path} ({e.strerror}; running as {who}); run as root "
                          f"on a machine whose cgroups are writable to use CPU-quota nodes") from None
    made = os.path.exists(os.path.join(probe, _quota_file(controller)))
    os.rmdir(probe)
    if not made:
        raise CgroupError(f"{controller.path} is not a cgroup cpu hierarchy: a directory made there has no "
                          f"{_quota_file(controller)}; give the root where the cgroup filesystems are mounted")


def _enable_cpu_v2(path: str) -> None:
    with open(os.path.join(path, "cgroup.subtree_control")) as f:
        if "cpu" in f.read().split():
            return
    with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
        f.write("+cpu")


def _quota_file(controller: CpuController) -> str:
    return "cpu.cfs_quota_us" if controller.version == 1 else "cpu.max"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@dataclasses.dataclass(frozen=True)
class CpuGroup:
    """One group: `cores` CPU seconds per wall second for its processes together, granted per
    `period_us`."""
    controller: CpuController
    path: str
    cores: float
    period_us: int

    @property
    def quota_us(self) -> int:
        """The group's CPU time per period, in microseconds (its cores times the period)."""
        return round(self.cores * self.period_us)

    def add(self, pid: int) -> None:
        """Moves process `pid` (every thread of it) into the group."""
        _write(self.procs_file, str(pid))

    def pids(self) -> tuple[int, ...]:
        """The processes in the group."""
        with open(self.procs_file) as f:
            return tuple(int(line) for line in f.read().split())

    def command(self, cmd: list[str]) -> list[str]:
        """`cmd` run in the group from its first instruction: a shell writes its own pid into the
        group, then execs `cmd` (the same pid).

        Returns:
            The command line to run.
        """
        return enter_command(self.procs_file, cmd)

    @property
    def procs_file(self) -> str:
        """The file a process writes its pid to, to enter the group."""
        return self.controller.procs(self.path)

    @contextlib.contextmanager
    def holding(self, pid: int) -> Iterator["CpuGroup"]:
        """Process `pid` in the group for the block, then back in the group it was in."""
        before = current_group(self.controller, pid)
        self.add(pid)
        try:
            yield self
        finally:
            _write(self.controller.procs(before), str(pid))


def enter_command(procs_file: str, cmd: list[str]) -> list[str]:
    """`cmd` run, from its first instruction, in the group whose procs file is `procs_file`: a
    shell writes its own pid there, then execs `cmd` (the same pid).

    Returns:
        The command line to run.
    """
    return ["sh", "-c", f'echo $$ > {shlex.quote(procs_file)} && exec "$@"', "sh", *cmd]


def host_procs_file(controller: CpuController) -> str:
    """The procs file of the `controller` group this process is in (where the processes it runs
    outside the quota groups go).

    Returns:
        The file's path.
    """
    return controller.procs(current_group(controller, os.getpid()))


def rank_command(groups: Sequence[CpuGroup], cmd: list[str], rank_variable: str) -> list[str]:
    """`cmd` run, from its first instruction, in ``groups[R]``, R the value of the environment
    variable `rank_variable` where it starts: one command for every rank of a launcher that tells
    each rank its number in the environment (``horovodrun``'s ``HOROVOD_RANK``). A shell picks the
    group, writes its own pid into it, then execs `cmd` (the same pid); a rank without a group
    exits with status 2 and a line naming the ranks that have one.

    Returns:
        The command line to give the launcher.

    Raises:
        CgroupError: no groups, or `rank_variable` is not an environment variable's name.
    """
    if not groups:
        raise CgroupError(f"no groups given to run the ranks of {cmd[:1]} in; give one group per rank")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rank_variable):
        raise CgroupError(f"rank_variable={rank_variable!r} is not an environment variable's name (letters, digits "
                          f"and _, not starting with a digit)")
    cases = " ".join(f"{rank}) procs={shlex.quote(g.procs_file)};;" for rank, g in enumerate(groups))
    missing = shlex.quote(f"no CPU-quota group for ${rank_variable}=")
    script = (f'case "${rank_variable}" in {cases} *) echo {missing}"${rank_variable}" '
              f'"(ranks 0 to {len(groups) - 1} have one)" >&2; exit 2;; esac; '
              f'echo $$ > "$procs" && exec "$@"')
    return ["sh", "-c", script, "sh", *cmd]


def current_group(controller: CpuController, pid: int) -> str:
    """The directory of the `controller` group process `pid` is in (from /proc/PID/cgroup)."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (controller.version == 2 and names == "") or (controller.version == 1 and "cpu" in names.split(",")):
                return os.path.join(controller.path, path.lstrip("/"))
    raise CgroupError(f"process {pid} is in no cgroup of the cpu controller at {controller.path}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-.+", name)
    return int(m.group(1)) if m else None


def _remove(controller: CpuController, path: str, grace_s: float) -> None:
    """Removes group `path`, waiting up to `grace_s` for its processes to end, then moving those left
    to the hierarchy's root (a group with processes cannot be removed)."""
    group = CpuGroup(controller, path, 0.0, PERIOD_US)
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pids = group.pids()
        except FileNotFoundError:
            return
        if not pids:
            break
        if time.monotonic() >= deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    _write(controller.procs(controller.path), str(pid))
            break
        time.sleep(0.05)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def group_names(controller: CpuController, owner: int | None = None) -> tuple[str, ...]:
    """The names of the hetpipe groups under the controller (of `owner`'s only, if given)."""
    return tuple(sorted(n for n in os.listdir(controller.path)
                        if _owner(n) is not None and (owner is None or _owner(n) == owner)))


def reap_orphans(controller: CpuController, grace_s: float = 2.0) -> tuple[str, ...]:
    """Removes the groups of owners that are no longer alive; returns their names."""
    names = tuple(n for n in group_names(controller) if not _alive(_owner(n) or 0))  # group_names: owned ones
    for name in names:
        _remove(controller, os.path.join(controller.path, name), grace_s)
    return names


class CpuGroups:
    """The CPU-quota groups of one owner process (default: this one), under the cgroup root `root`.

    Args:
      root: where the cgroup filesystems are mounted (a parameter for tests: a missing or
        read-only root is refused by :func:`find_cpu_controller`).
      owner: the process whose groups these are; they go with it (:meth:`start_reaper`).
      period_us: the period of the groups' quotas (see the module docstring).
    """

    def __init__(self, root: str = CGROUP_ROOT, owner: int | None = None, period_us: int = PERIOD_US):
        self.controller = find_cpu_controller(root)
        self.owner = owner or os.getpid()
        self.period_us = int(period_us)
        self._groups: dict[str, CpuGroup] = {}

    def create(self, name: str, cores: float) -> CpuGroup:
        """A new group `name` of `cores` CPU seconds per wall second."""
        if not cores * self.period_us >= MIN_QUOTA_US:
            raise CgroupError(f"a CPU quota of {cores!r} cores for '{name}' is below the kernel's least quota "
                              f"({MIN_QUOTA_US} us per period of {self.period_us} us, "
                              f"{MIN_QUOTA_US / self.period_us:g} cores); give a quota of at least that")
        if name in self._groups:
            raise CgroupError(f"group '{name}' was already made for process {self.owner}; give each group a name "
                              f"of its own")
        group = CpuGroup(self.controller, os.path.join(self.controller.path, f"{PREFIX}{self.owner}-{name}"),
                         float(cores), self.period_us)
        os.mkdir(group.path)
        if self.controller.version == 1:
            _write(os.path.join(group.path, "cpu.cfs_period_us"), str(self.period_us))
            _write(os.path.join(group.path, "cpu.cfs_quota_us"), str(group.quota_us))
            _write(os.path.join(group.path, "cpu.shares"), str(WEIGHT * 1024))
        else:
            _write(os.path.join(group.path, "cpu.max"), f"{group.quota_us} {self.period_us}")
            _write(os.path.join(group.path, "cpu.weight"), str(WEIGHT * 100))
        self._groups[name] = group
        return group

    def __getitem__(self, name: str) -> CpuGroup:
        return self._groups[name]

    def remove(self, name: str, grace_s: float = 5.0) -> None:
        """Removes group `name`, waiting up to `grace_s` for its processes to end (those left are
        moved to the hierarchy's root)."""
        _remove(self.controller, self._groups.pop(name).path, grace_s)

    def remove_all(self, grace_s: float = 5.0) -> None:
        """Removes every group of this owner (see :meth:`remove`)."""
        for name in list(self._groups):
            self.remove(name, grace_s)

    def start_reaper(self) -> "subprocess.Popen[bytes]":
        """Starts a process, in a session of its own (a kill of the owner's process group spares it),
        that waits for the owner to end and then removes the owner's groups.

        Returns:
            The reaper's process.
        """
        return subprocess.Popen([sys.executable, "-m", "hetpipe_tf.distributed.cgroups", str(self.owner),
                                 self.controller.path, str(self.controller.version)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)


def _reap_after(owner: int, controller: CpuController) -> None:
    """Waits for process `owner` to end, then removes its groups."""
    with contextlib.suppress(ProcessLookupError):
        fd = os.pidfd_open(owner)
        select.select([fd], [], [])
        os.close(fd)
    for name in group_names(controller, owner):
        _remove(controller, os.path.join(controller.path, name), grace_s=5.0)


if __name__ == "__main__":
    _reap_after(int(sys.argv[1]), CpuController(sys.argv[2], int(sys.argv[3])))
