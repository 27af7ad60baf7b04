"""How much of this host's CPU other processes took while something was measured.

A profile's times are wall times (HetPipe §7: the planner plans on the measured profile), so a
profile measured while other work competed for the cores is slower than the host is, and a plan
made from it is a plan for a busier host. :class:`OthersLoad` tells the two apart: over the span of
a ``with`` block it reads the host's CPU time from ``/proc/stat`` and this process tree's own
(this process, and every process it started that is still running: a cluster's tasks, on which
stages may be timed) from ``/proc/<pid>/stat``; the rest is other processes'.

The rule: the CPU time other processes spent (``/proc/stat``'s user, nice, system, irq and softirq
time, less this process tree's) over the span's wall time times the number of cores. Above
:data:`BUSY_SHARE`, the host was busy. Processes run under ``nice`` count too: the scheduler gives
them less of a core, but they still share the caches and memory bandwidth the timed passes use. Where ``/proc`` cannot be read (not Linux), nothing is
measured and the host counts as not busy.
"""
import dataclasses
import os
import time
from types import TracebackType

#: Other processes' share of the host's CPU above which a measurement counts as taken on a busy host:
#: a quarter of the cores, so that a measurement beside an idle desktop or an editor is kept, and one
#: beside another training job or a test run is not.
BUSY_SHARE = 0.25


def _host_busy_ticks() -> int | None:
    """Clock ticks every core spent running processes and interrupts."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...
    return sum(int(t) for t in fields[1:4] + fields[6:8])


def process_table() -> tuple[dict[int, int], dict[int, int]]:
    """Every running process's parent and its clock ticks of user and system time, with those of the
    children it has waited for (whose time the kernel moves to their parent's count)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ...
        except (OSError, IndexError):
            continue  # the process ended while the table was read
        pid = int(name)
        parents[pid] = int(rest[1])
        ticks[pid] = sum(int(t) for t in rest[11:15])  # utime, stime, cutime, cstime
    return parents, ticks


def process_tree(root: int, parents: dict[int, int]) -> set[int]:
    """`root` and every process below it, from each process's parent."""
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def _tree_ticks(root: int) -> int:
    """Clock ticks of `root`'s process tree (:func:`process_tree`)."""
    parents, ticks = process_table()
    return sum(ticks.get(pid, 0) for pid in process_tree(root, parents))


@dataclasses.dataclass
class OthersLoad:
    """A context manager measuring other processes' share of the host's CPU over its ``with`` block
    (see the module docstring); :attr:`share` is None until the block ends, or where it cannot be
    measured."""

    share: float | None = None
    _start: tuple[float, int, int] | None = dataclasses.field(default=None, repr=False)

    def __enter__(self) -> "OthersLoad":
        host = _host_busy_ticks()
        self._start = None if host is None else (time.monotonic(), host, _tree_ticks(os.getpid()))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        host = _host_busy_ticks()
        if self._start is None or host is None:
            return
        began, host_before, own_before = self._start
        wall_ticks = (time.monotonic() - began) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
        others = (host - host_before) - (_tree_ticks(os.getpid()) - own_before)
        self.share = max(0.0, others / wall_ticks) if wall_ticks > 0 else None

    @property
    def busy(self) -> bool:
        """Whether other processes took more than :data:`BUSY_SHARE` of the host's CPU."""
        return self.share is not None and self.share > BUSY_SHARE

    def describe(self) -> str:
        """Other processes' share, in words."""
        if self.share is None:
            return "other processes' use of the CPU was not measured (no /proc)"
        return f"other processes used {100 * self.share:.0f} % of the host's CPU"
