"""Emulating slower devices and smaller memories on the host. Every output that uses it says so.

Pure Python (no TensorFlow), so that any runner can use it: the pipeline
executor, the Horovod baseline in its own environment, the benchmarks.

Time rule. A task on an emulated device of relative speed ``v`` takes

    max(actual, dilation / v * reference)

where ``reference`` is the same task's compute time measured alone at start-up
(the minimum over a few solo runs, so the target does not inflate when several
emulated devices share the host's cores or other work interferes; with what the task
receives already on its device, since moving it is communication, which is not padded) and ``dilation``
multiplies every device's slowdown alike. The rule holds
only while the actual time stays below the target; a task that overran means
the host could not keep up. The fraction of tasks that overran is the
emulation's fidelity figure (``overrun_fraction``): a run is faithful while it
stays below ``FAITHFUL_OVERRUN`` (5 %). Unless the user gives a dilation, the
runners choose it with :func:`calibrate_dilation`: short probe runs of the real
pipeline at growing dilations until one overran on fewer than half that limit,
then two steps more.

Device timeline. An emulated device runs its tasks one after another, apart from the host
thread that issues them, as a GPU's stream runs the kernels a host enqueued: a task occupies
the device from when it was issued (or when the device's previous task ends, if later) for
its time above (:meth:`Pacer.occupy`), and what it produces is there for the other devices
when it ends. The host goes on meanwhile with work that reads nothing the device is still
computing (issuing an optimizer step, releasing a stashed version); what reads a result of
the device back waits for the device first (:meth:`Pacer.wait_idle`), as a host reading a GPU
tensor does. A runner whose next step needs its device's result at once (a baseline's
all-reduce of the gradients) therefore waits as if it had slept: :meth:`Pacer.pace`.

Persistent slowdowns. A :class:`PersistentSlowdown` makes one emulated device (by its name in the
cluster description) ``factor`` times slower from a point of the run on, for good: from a count of
minibatches completed by all workers together, or from a number of seconds after the run started,
both read from the run's :class:`RunProgress`. It is attached to the device, not to a worker's
minibatch ids, so it stays with the device whatever plan the run trains under (a re-plan moves
layers, not devices). A worker's :class:`Pacer` of that device takes the factor the slowdown gives
at each task (``WorkerSpec.slowdown``: one per stage, :meth:`PersistentSlowdown.for_devices`).

Memory rule. Each emulated device has a capacity; what a stage holds (weights,
optimizer slots, stashed versions, activations in flight) is accounted, and an
allocation past the capacity fails like an out-of-memory on a real card.
"""
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe_tf.errors import HetPipeRunError

FAITHFUL_OVERRUN = 0.05
"""An emulated run is faithful while fewer than this fraction of its paced tasks overran."""

HOST_SATURATED = 0.9
"""Above this fraction of the host's CPU time busy, the host's own work (dispatch, RPCs), not the
emulated devices, sets a run's pace: its figures do not show the devices (:class:`HostCpu`)."""

DILATIONS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)
"""The dilations :func:`calibrate_dilation` tries, in order."""


class DeviceOutOfMemoryError(HetPipeRunError, MemoryError):
    """An emulated device would hold more bytes than its capacity."""


@dataclass(frozen=True)
class EmulationReport:
    """How faithful the time emulation was: tasks paced, and how many overran their target.

    `calibration` holds (dilation, overrun fraction) of each probe run when the dilation
    was chosen by :func:`calibrate_dilation` (empty when the user gave it)."""
    dilation: float
    tasks: int
    overran: int
    calibration: tuple[tuple[float, float], ...] = ()

    @property
    def overrun_fraction(self) -> float:
        """The share of the paced tasks that took longer than their target."""
        return self.overran / self.tasks if self.tasks else 0.0

    @property
    def faithful(self) -> bool:
        """Whether the overrun fraction is under the 5 % limit."""
        return self.overrun_fraction < FAITHFUL_OVERRUN

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready keys (the ones every emulated run's output carries)."""
        out: dict[str, Any] = {"emulated": True, "dilation": self.dilation, "paced_tasks": self.tasks,
               "overran_tasks": self.overran, "overrun_fraction": round(self.overrun_fraction, 4),
               "emulation_faithful": self.faithful}
        if self.calibration:
            out["dilation_calibration"] = [[d, round(f, 4)] for d, f in self.calibration]
        return out

    def warning(self) -> str | None:
        """A line saying that the run was not faithful, or None when it was."""
        if self.faithful:
            return None
        return (f"WARNING: the emulation was not faithful: {self.overran} of {self.tasks} paced tasks "
                f"({self.overrun_fraction:.1%}) overran their target (the limit is {FAITHFUL_OVERRUN:.0%}), "
                f"so this run's timings do not show the emulated devices; give a larger dilation than "
                f"{self.dilation:g} or emulate fewer devices per host core")

    @staticmethod
    def combine(reports: Iterable["EmulationReport | None"]) -> "EmulationReport | None":
        """One report of several devices' (None where none was emulated)."""
        given = [r for r in reports if r is not None]
        if not given:
            return None
        return EmulationReport(dilation=given[0].dilation, tasks=sum(r.tasks for r in given),
                               overran=sum(r.overran for r in given),
                               calibration=next((r.calibration for r in given if r.calibration), ()))


def calibrate_dilation(probe: Callable[[float], EmulationReport], candidates: Sequence[float] = DILATIONS,
                       limit: float = FAITHFUL_OVERRUN / 2, extra_steps: int = 2
                       ) -> tuple[float, tuple[tuple[float, float], ...]]:
    """Chooses the dilation of an emulated run: the first of `candidates` whose probe overran
    on fewer than `limit` of its tasks, then `extra_steps` candidates further, else the last
    candidate. Both are margins: a probe is short (about 120 tasks), a run meets slower phases
    of a shared machine and work no probe includes (WSP's servers, the data pipeline, validation
    beside the running pipeline), and a stage's thread goes on while its emulated device runs (the
    device timeline), so a run overruns more than its probe did (docs/performance.md).

    `probe(dilation)` runs the real pipeline briefly at that dilation, keeps nothing of it, and
    returns its EmulationReport. Returns (dilation, ((dilation, overrun fraction), ...)).

    Returns:
        The dilation and every probe's (dilation, overrun fraction).
    """
    tried: list[tuple[float, float]] = []
    for i, dilation in enumerate(candidates):
        report = probe(dilation)
        tried.append((dilation, report.overrun_fraction))
        if report.overrun_fraction < limit:
            return candidates[min(i + extra_steps, len(candidates) - 1)], tuple(tried)
    return tried[-1][0], tuple(tried)


class Pacer:
    """Pads tasks of one emulated device to max(actual, dilation / speed * reference).

    Args:
        speed: the device's speed relative to the host running one task alone (> 0).
        dilation: the factor (>= 1) by which every emulated time is stretched, so that the host
            can keep up with all the devices it emulates at once.
        clock: the time source, in seconds.
        sleep: how to wait, in seconds.
        slowdown: if given, maps a minibatch id to a factor >= 1 by which the device is slower
            for that minibatch's tasks: a transient straggler, as on a shared cluster.

    Raises:
        ValueError: `speed` is not > 0 or `dilation` is < 1.
    """

    def __init__(self, speed: float, dilation: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, slowdown: Callable[[int], float] | None = None) -> None:
        if speed <= 0:
            raise ValueError(f"an emulated device's speed must be > 0, got {speed}")
        if dilation < 1.0:
            raise ValueError(f"the emulation's dilation must be >= 1, got {dilation}")
        self.speed = float(speed)
        self.dilation = float(dilation)
        self.slowdown = slowdown
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self.tasks = 0
        self.overran = 0
        self.free_at = float("-inf")  # when the device's last task ends (the device timeline)

    def target(self, reference: float, minibatch: int | None = None) -> float:
        """The time a task whose solo compute time is `reference` takes on this device."""
        factor = self.slowdown(minibatch) if self.slowdown is not None and minibatch is not None else 1.0
        if factor < 1.0:
            raise ValueError(f"a slowdown factor must be >= 1, got {factor} for minibatch {minibatch}")
        return self.dilation * reference * factor / self.speed

    def occupy(self, started: float, reference: float, minibatch: int | None = None,
               actual: float | None = None) -> tuple[float, float]:
        """Puts a task on the device's timeline without waiting: it ran on the host from `started`
        for `actual` seconds (default: until now), and occupies the device from max(`started`, the
        end of the device's previous task) for its target. Counts it as overrun when the host took
        longer than the target. Returns (begin, end) on the device (clock times).

        Returns:
            The task's (begin, end) on the device.
        """
        took = self._clock() - started if actual is None else actual
        return self._place(started, took, self.target(reference, minibatch))

    def wait_idle(self, stop: threading.Event | None = None) -> None:
        """Waits until the device's last task ends (returns at once if it has); `stop`, a
        threading.Event, ends the wait early when set."""
        while True:
            left = self.free_at - self._clock()
            if left <= 0 or (stop is not None and stop.is_set()):
                return
            if stop is not None:
                stop.wait(left)
            else:
                self._sleep(left)

    def pace(self, started: float, reference: float, minibatch: int | None = None) -> tuple[float, float]:
        """A task whose result its runner reads at once: occupies the device as :meth:`occupy`
        does and waits for its end. Returns (actual, target) of the task: `actual`, the host's
        time, is the one its overrun was counted by.

        Returns:
            The task's (actual, target) seconds.
        """
        actual = self._clock() - started
        target = self.target(reference, minibatch)
        self._place(started, actual, target)
        self.wait_idle()
        return actual, target

    def _place(self, started: float, actual: float, target: float) -> tuple[float, float]:
        """Counts a task that ran on the host for `actual` seconds from `started` (an overrun when
        that is over its `target`) and puts it on the device's timeline: from max(`started`, the
        end of the device's previous task) for `target`. Returns (begin, end) on the device.

        Returns:
            The task's (begin, end) on the device.
        """
        with self._lock:
            self.tasks += 1
            if actual > target:
                self.overran += 1
            begin = max(started, self.free_at)
            self.free_at = begin + target
            return begin, self.free_at

    def report(self) -> EmulationReport:
        """The device's report so far: its tasks and how many overran."""
        with self._lock:
            return EmulationReport(self.dilation, self.tasks, self.overran)


class RunProgress:
    """How far a run is: its minibatches completed by every worker together, and the seconds since
    :meth:`start` (thread-safe; one per run, kept across a change of plan)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, record: bool = False) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._minibatches = 0
        self._started: float | None = None
        #: When each minibatch was counted (clock times), with `record` (a run's images/s over time).
        self.completions: list[float] | None = [] if record else None

    def start(self) -> "RunProgress":
        """Starts the run's clock (once: a later call keeps the first start)."""
        with self._lock:
            if self._started is None:
                self._started = self._clock()
        return self

    def minibatch_done(self, count: int = 1) -> None:
        """Counts `count` more minibatches done by the run's workers."""
        with self._lock:
            self._minibatches += count
            if self.completions is not None:
                self.completions.extend([self._clock()] * count)

    @property
    def minibatches(self) -> int:
        """The minibatches done so far, every worker's together."""
        with self._lock:
            return self._minibatches

    @property
    def seconds(self) -> float:
        """Seconds since :meth:`start` (0 before it)."""
        with self._lock:
            return 0.0 if self._started is None else self._clock() - self._started


@dataclass(frozen=True)
class PersistentSlowdown:
    """Device `device` (a cluster device's name, e.g. ``host-F:1``) is `factor` times slower from
    the moment `progress` has counted `after_minibatches` minibatches of the run (all workers
    together), or `after_s` seconds since it started (exactly one of the two), to the run's end."""
    device: str
    factor: float
    progress: RunProgress
    after_minibatches: int | None = None
    after_s: float | None = None

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"a persistent slowdown's factor must be >= 1, got {self.factor!r}")
        if (self.after_minibatches is None) == (self.after_s is None):
            raise ValueError(f"a persistent slowdown starts after a count of minibatches or a number of seconds: "
                             f"give exactly one, got after_minibatches={self.after_minibatches!r}, "
                             f"after_s={self.after_s!r}")

    @property
    def active(self) -> bool:
        """Whether the device is slowed now."""
        if self.after_minibatches is not None:
            return self.progress.minibatches >= self.after_minibatches
        return self.after_s is not None and self.progress.seconds >= self.after_s

    def factor_now(self, minibatch: int | None = None) -> float:
        """The device's factor now (`minibatch`, the task's id in its worker, plays no part:
        the slowdown belongs to the device and the run's progress).

        Returns:
            `factor` once the slowdown has begun, else 1.
        """
        return self.factor if self.active else 1.0

    @staticmethod
    def for_devices(slowdowns: Sequence["PersistentSlowdown"], devices: Sequence[str]
                    ) -> tuple[Callable[[int], float] | None, ...]:
        """Per device of `devices` (a worker's, in stage order): its slowdown's factor as a Pacer
        takes it (minibatch id -> factor; several on one device multiply), or None.

        Returns:
            One factor function or None per device.
        """
        out: list[Callable[[int], float] | None] = []
        for name in devices:
            mine = tuple(s for s in slowdowns if s.device == name)
            out.append(_DeviceSlowdowns(mine) if mine else None)
        return tuple(out)


@dataclass(frozen=True)
class _DeviceSlowdowns:
    """One device's persistent slowdowns as a Pacer takes them: minibatch id -> their factors' product."""
    slowdowns: tuple[PersistentSlowdown, ...]

    def __call__(self, minibatch: int) -> float:
        out = 1.0
        for s in self.slowdowns:
            out *= s.factor_now(minibatch)
        return out


class HostCpu:
    """How busy the host's CPUs were (every core, from /proc/stat) since :meth:`start`.

    The overrun fraction says whether the paced passes kept to their targets; it does not see
    the work between them (a stage's RPCs, a rank's collective), which the host runs at its own
    speed only while it has cores to spare. Time stolen by a hypervisor counts as busy."""

    def __init__(self, path: str = "/proc/stat") -> None:
        self._path = path
        self._start: tuple[int, int] | None = None

    def _read(self) -> tuple[int, int] | None:
        try:
            with open(self._path) as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        idle = ticks[3] + ticks[4]  # idle, iowait
        return sum(ticks) - idle, sum(ticks)

    def start(self) -> "HostCpu":
        """Starts counting from now; returns self."""
        self._start = self._read()
        return self

    def busy_fraction(self) -> float | None:
        """The busy share of the host's CPU time since start(), or None where it cannot be read."""
        now = self._read()
        if self._start is None or now is None or now[1] <= self._start[1]:
            return None
        return round((now[0] - self._start[0]) / (now[1] - self._start[1]), 3)


class MemoryAccount:
    """Bytes held on one device by category, checked against the device's capacity."""

    def __init__(self, device: str, capacity: int | None = None) -> None:
        self.device = device
        self.capacity = capacity
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self.peak = 0

    @property
    def used(self) -> int:
        """The bytes held now."""
        return sum(self._held.values())

    def allocate(self, category: str, nbytes: int) -> None:
        """Holds `nbytes` more under `category` (weights, a stashed version, activations, ...).

        Raises:
            DeviceOutOfMemoryError: the device would hold more than its capacity.
        """
        with self._lock:
            used = self.used + nbytes
            if self.capacity is not None and used > self.capacity:
                held = format_breakdown(self._held)
                raise DeviceOutOfMemoryError(
                    f"out of memory on {self.device} (emulated capacity {format_bytes(self.capacity)}): "
                    f"allocating {format_bytes(nbytes)} for {category} would hold {format_bytes(used)} "
                    f"(now holding: {held or 'nothing'}); give this device fewer layers, lower Nm "
                    f"or the batch size, or more memory")
            self._held[category] = self._held.get(category, 0) + nbytes
            self.peak = max(self.peak, used)

    def free(self, category: str, nbytes: int) -> None:
        """Releases `nbytes` of `category`."""
        with self._lock:
            self._held[category] = self._held.get(category, 0) - nbytes

    def held(self) -> dict[str, int]:
        """The bytes held now, by category."""
        with self._lock:
            return dict(self._held)


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB or GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def format_breakdown(held: Mapping[str, float]) -> str:
    """'weights 1.0 MiB, activations 20 B' for a {category: bytes} dict (zeros left out)."""
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items() if v)
