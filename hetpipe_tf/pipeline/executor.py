"""Carries out a schedule's instruction lists on the stages' devices (HetPipe §4).

Only the schedule decides the order. Each stage runs its program: the prologue,
then, repeatedly, the task chosen by :func:`hetpipe_tf.pipeline.schedule.fifo_pick`
among the heads of its streams whose required keys have arrived (the same rule
the simulator applies). The instructions a stage's runtime carries out on its device
(its ``device_instructions``: passes, updates, stashing) run in groups: a task's
consecutive device instructions are one call of the runtime (``runtime.run(group)``,
one compiled call on the device), and a send among them goes right after the group
that made what it sends. Every other instruction type maps to one method below, or to
a handler of the synchronisation scheme between virtual workers (``sync_handlers``); a
type without either is refused before anything runs.

Why threads in one process: the stages of a virtual worker are the devices of
one training process, as TensorFlow itself drives several GPUs of a node. Each
stage gets a Python thread that places its work with ``tf.device``; TensorFlow
releases the GIL while kernels run, so stages overlap (measured 1.9x for two
stages on two cores), and activations and gradients move between devices as
tensors, with no serialisation. Devices of another machine are reachable the
same way, as remote TensorFlow devices. The process boundary is where the paper
puts it, between virtual workers and parameter servers.

An emulated device runs apart from its stage's thread (the device timeline of
:mod:`hetpipe_tf.pipeline.emulation`): a forward or backward pass occupies the
device for its emulated time while the thread goes on with the instructions that
read nothing back (sending, releasing a version, issuing the optimizer step,
stashing the next version); the activations and gradients a pass produced reach
the other stages when it ends on its device (a delivery that fails, a key delivered
twice, fails the stage it was for), and the thread waits for its device
before it picks the next task (so the FIFO rule picks among what has arrived by
then) and before an instruction of the synchronisation scheme or a snapshot (they
read the stage's weights). A group of device instructions holding several passes (the
last stage's forward and backward pass) puts each pass on the device's timeline in
turn, the group's host time shared between them in proportion to their references.

A task that hands nothing to other stages (HetPipe's backward task on the first stage: the
update of p and the stash of w_{p+Nm}) and the task it makes ready by stashing the version
that task's forward pass uses (the forward task of p + Nm) run as one call of the stage's
runtime, when every other key that task requires has arrived: their receives first, then
their device instructions in program order, then the second task's sends. Nothing another
stage waits for comes later than it would have, each stream keeps its order (so every
stage's update order and versions are those of the schedule), and a forward pass reading a
stashed version commutes with the other tasks of its stage; the FIFO rule then sees the two
as one task (as if what else arrived meanwhile had arrived after it). It saves a call and a
task's dispatch per minibatch; on an emulated device, whose timeline paces each task, tasks
are not joined.

Nothing waits forever: each wait for a message has a timeout, and a watchdog
stops the run when no stage has made progress for ``timeout_s``, naming what
every stage was doing.
"""
import heapq
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from hetpipe_tf.errors import HetPipeRunError, HetPipeUsageError
from hetpipe_tf.pipeline.emulation import EmulationReport, Pacer
from hetpipe_tf.pipeline.instructions import (
    ACTIVATION, GRADIENT, INPUTS, LABELS, TIED_GRADIENTS, UPDATE_TERMS, WEIGHTS, ApplyAccumulated,
    ApplyUpdate, Backward, Delivery, Forward, Instruction, Key, LoadMinibatch, Recompute, RecvActivation,
    RecvGradient, RecvInputs, RecvLabels, RecvTiedGradients, RecvUpdateTerms, Send, SendActivation, SendGradient,
    SendTiedGradients, SendUpdateTerms, SnapshotState, StashWeights, Task)
from hetpipe_tf.pipeline.mailbox import Mailbox, PipelineAborted
from hetpipe_tf.pipeline.schedule import Candidate, Handler, Schedule, StageProgram, fifo_pick
from hetpipe_tf.pipeline.stage_protocol import StageRuntime
from hetpipe_tf.pipeline.trace import TraceRecorder

#: What the executor carries out in one go: an instruction, or a group of the stage's device
#: instructions (one call of its runtime).
Step = Instruction | tuple[Instruction, ...]
#: What an instruction's method hands to the stages: {(destination, key): value}.
Values = dict[Delivery, Any]
#: A stage's next task: (its stream, the task, (stream, task) of the task joined to it or None).
_Chosen = tuple[int, Task, tuple[int, Task] | None]


class _Finished:
    """What a stage's choice of its next task is when every stream is done."""


_FINISHED = _Finished()
_STOP_GRACE_S = 5.0  # a stopped run waits this long for each stage thread to end
_STUCK_FRAMES = 12  # of the stack of a stage thread that did not end, shown in the error
_DEVICE_RESULTS = (ACTIVATION, GRADIENT, UPDATE_TERMS, TIED_GRADIENTS)  # what a device computes for another stage
# what a task takes in before its passes: joined tasks take theirs in before the joint call
_ENTRIES = (LoadMinibatch, RecvInputs, RecvLabels, RecvActivation, RecvGradient, RecvUpdateTerms, RecvTiedGradients)


def _nbytes(value: Any) -> int:
    """The bytes of the tensors in `value` (nested lists, tuples and dicts of objects with a shape
    and a dtype, such as tensors and arrays)."""
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is None or shape is None:
        return 0
    elements = 1
    for d in shape:
        elements *= int(d)
    size = getattr(dtype, "size", None) or getattr(dtype, "itemsize", 0)
    return elements * int(size or 0)


class PipelineError(HetPipeRunError, RuntimeError):
    """A stage failed; the message names the stage, its instruction and what the others were doing."""


class UnknownInstructionError(HetPipeUsageError, TypeError):
    """A schedule holds an instruction type the executor does not carry out."""


@dataclass
class StageReport:
    """What one stage did in a run: its busy and compute time, its tasks, the calls of its runtime
    that ran its device instructions (one per group), memory and stash peaks, its emulation."""
    stage: int
    device: str
    busy_s: float = 0.0
    compute_s: float = 0.0
    tasks: int = 0
    device_calls: int = 0
    memory_peak: int = 0
    stash_peak_versions: int = 0
    stash_bytes_peak: int = 0
    sent_bytes: int = 0  # what its Send instructions handed to other stages
    emulation: EmulationReport | None = None


@dataclass
class ExecutionReport:
    """What a run did: its minibatches, its wall time and each stage's report."""
    steps: int
    wall_s: float
    stages: list[StageReport] = field(default_factory=list)

    @property
    def minibatches_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0

    def busy_fraction(self) -> list[float]:
        return [s.busy_s / self.wall_s if self.wall_s else 0.0 for s in self.stages]

    @property
    def emulation(self) -> EmulationReport | None:
        return EmulationReport.combine(s.emulation for s in self.stages if s.emulation)


@dataclass(frozen=True)
class _Delivery:
    """What instruction `ins` of stage `source` computed for stage `stage` under `key`."""
    stage: int
    key: Key
    value: Any  # a stage's tensors
    source: int
    ins: Instruction


class _Deliveries:
    """Puts deliveries into their stages' mailboxes at given clock times, in time order, from a
    thread of its own: what an emulated device computed reaches the other stages when its task
    ends. A delivery that fails (a key delivered twice) is passed to `on_error(where, exc)`,
    `where` naming the stage that was to receive it and the instruction that sent it."""

    def __init__(self, clock: Callable[[], float], mailboxes: Sequence[Mailbox],
                 on_error: Callable[[str, BaseException], None]) -> None:
        self._clock = clock
        self._mailboxes = mailboxes
        self._stop = threading.Event()
        self._on_error = on_error
        self._heap: list[tuple[float, int, _Delivery]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._main, name="hetpipe-deliveries", daemon=True)
        self._thread.start()

    def put_at(self, due: float, delivery: _Delivery) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._order), delivery))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._heap.clear()
            self._stop.set()
            self._cond.notify()
        self._thread.join(timeout=5.0)

    def _main(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._heap:
                    self._cond.wait(0.2)
                    continue
                left = self._heap[0][0] - self._clock()
                if left > 0:
                    self._cond.wait(left)
                    continue
                _, _, delivery = heapq.heappop(self._heap)
            try:
                self._mailboxes[delivery.stage].put(delivery.key, delivery.value)
            except BaseException as exc:  # noqa: BLE001 - reported by the executor
                self._on_error(f"stage {delivery.stage} failed receiving {delivery.key} from stage "
                               f"{delivery.source}'s {delivery.ins!r}", exc)


class PipelineExecutor:
    """Runs `schedule` with one :class:`hetpipe_tf.runtime.stage.StageRuntime` per stage.

    Args:
      schedule: a :class:`hetpipe_tf.pipeline.schedule.Schedule`.
      runtimes: a StageRuntime per stage.
      data: iterator of (inputs, labels) minibatches; only stage 0 reads it.
      split_inputs: inputs -> {stage: [tensors]} (``StagedModel.split_inputs``).
      pacers: per stage, an emulation Pacer or None.
      references: per stage, {instruction type: seconds measured alone}, for pacers.
      timeout_s: the longest any stage may wait, and the longest the run may go with no progress.
      trace: a TraceRecorder or None; pid: its process id for this virtual worker.
      on_minibatch_done: called (from a stage thread) with (p, logs) when update p is in every stage.
      on_snapshot: called with (p, [StageState per stage]) once every stage recorded state p.
      sync_handlers: how to carry out the instructions of the synchronisation scheme between
        virtual workers: {instruction type: handler(executor, stage, instruction, *taken keys)}
        (:meth:`hetpipe_tf.pipeline.schedule.SyncScheme.handlers`). Handlers use the executor's
        ``runtimes``, ``schedule``, :meth:`clock`, :meth:`trace_span` and :meth:`in_background`.
    """

    _HANDLERS: dict[type[Instruction], str] = {
        LoadMinibatch: "_load_minibatch", RecvInputs: "_recv_inputs", RecvLabels: "_recv_labels",
        RecvActivation: "_recv_activation", SendActivation: "_send_activation",
        RecvGradient: "_recv_gradient", SendGradient: "_send_gradient", SnapshotState: "_snapshot_state",
        SendUpdateTerms: "_send_update_terms", RecvUpdateTerms: "_recv_update_terms",
        SendTiedGradients: "_send_tied_gradients", RecvTiedGradients: "_recv_tied_gradients",
    }
    # what each pass is paced as
    _PACED: dict[type[Instruction], type[Instruction]] = {Forward: Forward, Recompute: Forward, Backward: Backward}

    def __init__(self, schedule: Schedule, runtimes: Sequence[StageRuntime], data: Iterator[Any],
                 split_inputs: Callable[[Any], Mapping[int, Any]], pacers: Sequence[Pacer | None] | None = None,
                 references: Sequence[Mapping[type[Instruction], float]] | None = None, timeout_s: float = 120.0,
                 trace: TraceRecorder | None = None, pid: int = 0,
                 on_minibatch_done: Callable[[int, dict[str, Any]], None] | None = None,
                 on_snapshot: Callable[[int, list[Any]], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 sync_handlers: Mapping[type[Instruction], Handler] | None = None) -> None:
        if len(runtimes) != schedule.num_stages:
            raise ValueError(f"{schedule.num_stages} stages in the schedule, {len(runtimes)} runtimes")
        self.schedule = schedule
        self.runtimes = runtimes
        self._data = data
        self._split_inputs = split_inputs
        self._pacers: Sequence[Pacer | None] = pacers or [None] * len(runtimes)
        self._references: Sequence[Mapping[type[Instruction], float]] = references or [{} for _ in runtimes]
        self.timeout_s = float(timeout_s)
        self._trace = trace
        self._pid = pid
        self._on_done = on_minibatch_done
        self._on_snapshot = on_snapshot
        self._clock = clock
        self._abort = threading.Event()
        k = schedule.num_stages
        self._mailboxes = [Mailbox(f"stage {s} ({runtimes[s].device})", self._abort, clock) for s in range(k)]
        self._positions = [[0] * len(p.streams) for p in schedule.programs]  # next task of each stream
        self._status: list[tuple[str, Step | list[Task] | None]] = [("not started", None)] * k  # formatted when asked
        self._since = [0.0] * k
        self._progress = clock()
        self._errors: list[tuple[str, BaseException, str]] = []
        self._limit = schedule.steps
        self._admitted = 0
        self._snapshots: dict[int, dict[int, Any]] = {}
        self._snapshot_lock = threading.Lock()
        self._logs: dict[int, dict[str, Any]] = {}
        self.reports = [StageReport(s, runtimes[s].device) for s in range(k)]
        self._sync_handlers = dict(sync_handlers or {})
        self._background: ThreadPoolExecutor | None = None
        self._deliveries: _Deliveries | None = None
        # (minibatch, logs) the first stage applied, reported once its device is idle
        self._done: list[tuple[int, dict[str, Any]]] = []
        # (start, end) of the first stage's tasks (§8.4's idle time)
        self.first_stage_busy: list[tuple[float, float]] = []
        self._check_instructions()

    def _check_instructions(self) -> None:
        for prog in self.schedule.programs:
            samples = list(prog.prologue) + [ins for stream in prog.streams for task in stream[:2]
                                             for ins in task.instructions]
            device = self.runtimes[prog.stage].device_instructions
            for ins in samples:
                if type(ins) not in self._HANDLERS and type(ins) not in self._sync_handlers and type(ins) not in device:
                    known = ", ".join(sorted(t.__name__ for t in [*self._HANDLERS, *self._sync_handlers, *device]))
                    raise UnknownInstructionError(
                        f"stage {prog.stage}: the executor does not carry out {ins!r}; it knows: {known}")

    # Running ----------------------------------------------------------------------------
    def run(self) -> ExecutionReport:
        """Runs the whole schedule; returns an ExecutionReport or raises PipelineError."""
        if self._sync_handlers:
            self._background = ThreadPoolExecutor(max_workers=self.schedule.num_stages,
                                                  thread_name_prefix=f"hetpipe-sync-w{self._pid}")
        threads = [threading.Thread(target=self._stage_main, args=(s,), name=f"hetpipe-stage-{s}",
                                    daemon=True) for s in range(self.schedule.num_stages)]
        if any(p is not None for p in self._pacers):
            self._deliveries = _Deliveries(self._clock, self._mailboxes, self._fail)
        start = self._clock()
        self._progress = start
        if self._trace:
            self._trace.set_origin(start)
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.2)
            if self._errors:
                break
            idle = self._clock() - self._progress
            if idle > self.timeout_s:
                self._fail("the pipeline stalled", TimeoutError(
                    f"no stage made progress for {idle:.0f} s (timeout_s={self.timeout_s:g})"))
                break
        self._abort.set()
        for mb in self._mailboxes:
            mb.wake()
        for t in threads:
            t.join(timeout=_STOP_GRACE_S)
        stuck = _stacks_of([t for t in threads if t.is_alive()])
        # The run holds its data no longer. An executor outlives its run (its runner keeps it for
        # stats, in reference cycles): a tf.data iterator it kept would end whenever the garbage
        # collector runs, in whatever thread, which waits there for the iterator's threads.
        self._data = iter(())
        if self._deliveries is not None:
            self._deliveries.close()
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)
        for rt in self.runtimes:
            try:
                rt.end_run()
            except Exception:  # noqa: BLE001 - a failed run's devices may be gone; report its cause
                if not self._errors:
                    raise
        if self._errors:
            where, exc, tb = self._errors[0]
            where = f"virtual worker {self._pid}: {where}"
            raise PipelineError(f"{where}: {type(exc).__name__}: {exc}\n"
                                f"stages: {self.describe_status()}\n{stuck}{tb}") from exc
        wall = self._clock() - start
        for rep, rt, pacer in zip(self.reports, self.runtimes, self._pacers):
            rep.memory_peak = rt.memory.peak
            if pacer is not None:
                rep.emulation = pacer.report()
        return ExecutionReport(steps=min(self._limit, self.schedule.steps),
                               wall_s=wall, stages=self.reports)

    def abort(self) -> None:
        """Stops every stage now (for example when the caller was interrupted)."""
        self._fail("the pipeline stalled", KeyboardInterrupt("the run was aborted by its caller"))

    def request_stop(self) -> int:
        """Stops admitting minibatches: every stream ends at the last one already started.

        Returns the id of the last minibatch the run will complete.
        """
        with self._mailboxes[0].cond:
            self._limit = min(self._limit, max(self._admitted, 0))
        return self._limit

    def describe_waits(self) -> str:
        """For every stage: the next task of each stream and the keys it still lacks."""
        parts = []
        for s, prog in enumerate(self.schedule.programs):
            mb = self._mailboxes[s]
            lacking = [f"{prog.streams[i].kind} {stream[p]!r} lacks {[k for k in stream[p].requires if mb.arrival(k) is None]}"
                       for i, (stream, p) in enumerate(zip(prog.streams, self._positions[s])) if p < len(stream)]
            parts.append(f"stage {s}: " + ("; ".join(lacking) or "done"))
        return " | ".join(parts)

    def describe_status(self) -> str:
        now = self._clock()
        return "; ".join(f"stage {s}: {_format_status(*st)} ({now - self._since[s]:.1f} s)"
                         for s, st in enumerate(self._status))

    def _fail(self, where: str, exc: BaseException) -> None:
        """Stops every stage for `exc`; run() raises it as a PipelineError that starts with
        `where`, what failed ("stage 1 failed at Forward(3)"), and shows the traceback it was
        raised with, if it was raised."""
        tb = "".join(traceback.format_exception(exc)) if exc.__traceback__ is not None else ""
        self._errors.append((where, exc, tb))
        self._abort.set()
        for mb in self._mailboxes:
            mb.wake()

    def _set_status(self, s: int, what: str, about: Step | list[Task] | None = None) -> None:
        self._status[s] = (what, about)
        self._since[s] = self._clock()

    def _stage_main(self, s: int) -> None:
        with self.runtimes[s].execution_scope():
            self._run_program(s)

    def _run_program(self, s: int) -> None:
        prog = self.schedule.programs[s]
        ins: Step | None = None
        try:
            for ins in self._steps(s, prog.prologue):
                self._execute(s, ins)
            # HetPipe's stash is fullest now: ask it once. (A schedule that stashes at its forward
            # passes, PipeDream's, holds more later; the op refuses more than Nm versions.)
            stats = self.runtimes[s].stash.stats()
            self.reports[s].stash_peak_versions = stats.num_versions
            self.reports[s].stash_bytes_peak = stats.bytes
            pos = self._positions[s]
            while True:
                self._wait_for_device(s)  # so that the FIFO rule picks among what arrived meanwhile
                self._flush_reports(s)
                chosen = self._next_task(s, prog, pos)
                if chosen is None:
                    break
                i, task, joined = chosen
                t0 = self._clock()
                instructions = task.instructions if joined is None else _joint(task, joined[1])
                for ins in self._steps(s, instructions):
                    self._execute(s, ins)
                t1 = self._clock()
                self.reports[s].tasks += 1 if joined is None else 2
                if self._pacers[s] is None:  # an emulated device's busy time is its timeline's
                    self.reports[s].busy_s += t1 - t0
                if s == 0:  # until its device ended the task
                    pacer = self._pacers[0]
                    self.first_stage_busy.append((t0, t1 if pacer is None else max(t1, pacer.free_at)))
                pos[i] += 1
                if joined is not None:
                    pos[joined[0]] += 1
            self._wait_for_device(s)
            self.runtimes[s].check_applied()
            self._flush_reports(s)
            self._set_status(s, "done")
        except PipelineAborted:
            self._set_status(s, "stopped at", ins)
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            self._set_status(s, "failed at", ins)
            self._fail(f"stage {s} failed at {_format_step(ins)}", exc)

    def _next_task(self, s: int, prog: StageProgram, pos: list[int]) -> _Chosen | None:
        """The task stage `s` runs next, by §4's rules (:func:`fifo_pick` among the heads of its
        streams whose required keys have arrived), once one is ready, with the task joined to it
        (:meth:`_joined`) or None; None when every stream is done."""
        mb = self._mailboxes[s]

        def choose() -> _Chosen | _Finished | None:  # under the mailbox's lock: stage 0's choice and
            # request_stop see one _admitted
            left = False
            ready: list[tuple[Candidate, Task]] = []
            for i, stream in enumerate(prog.streams):
                # After a stop, a stream skips the tasks of minibatches past the limit: in a
                # stream that interleaves passes (1F1B), the backward passes of those already
                # started come after the next forward pass.
                while pos[i] < len(stream) and stream[pos[i]].minibatch > self._limit:
                    pos[i] += 1
                if pos[i] == len(stream):
                    continue
                left, task = True, stream[pos[i]]
                latest = mb.ready_time(task.requires)
                if latest is not None:
                    ready.append(((latest, task.minibatch, i), task))
            if not left:
                return _FINISHED  # every stream is done (or was stopped while this stage waited)
            if not ready:
                return None
            pick = fifo_pick([c for c, _ in ready])
            task = next(t for c, t in ready if c == pick)
            joined = self._joined(s, prog, pos, pick[2], task)
            if s == 0:
                for t in (task,) if joined is None else (task, joined[1]):
                    if t.kind in ("forward", "forward_backward"):
                        self._admitted = max(self._admitted, t.minibatch)
            return pick[2], task, joined

        def waiting() -> None:
            self._set_status(s, "waiting:", [stream[pos[i]] for i, stream in enumerate(prog.streams)
                                             if pos[i] < len(stream)])

        # mypy joins choose's union to object when it solves wait_until's type variable: say it
        chosen = cast("_Chosen | _Finished", mb.wait_until(choose, self.timeout_s, self.describe_waits,
                                                           on_wait=waiting))
        return None if isinstance(chosen, _Finished) else chosen

    def _joined(self, s: int, prog: StageProgram, pos: list[int], i: int, task: Task) -> tuple[int, Task] | None:
        """(stream, task) that runs in one call with `task`, the task stage `s` picked from stream
        `i` (see the module docstring), or None: the head of another stream whose forward pass
        uses the version `task` stashes, every other key it requires there already, when `task`
        takes in and runs on the device only, the other takes in, runs on the device and then
        sends only, and the stage's device is not emulated."""
        device = self.runtimes[s].device_instructions
        if self._pacers[s] is not None or not all(type(ins) in device or isinstance(ins, _ENTRIES)
                                                  for ins in task.instructions):
            return None
        made = {key for ins in task.instructions for dst, key in ins.provides(s) if dst == s}
        if not any(key[0] == WEIGHTS for key in made):
            return None
        for j, stream in enumerate(prog.streams):
            if j == i or pos[j] >= len(stream):
                continue
            head = stream[pos[j]]
            if head.minibatch > self._limit or not any(key[0] == WEIGHTS and key in made for key in head.requires):
                continue
            if self._mailboxes[s].ready_time([key for key in head.requires if key not in made]) is None:
                continue
            entries = _leading(head.instructions, _ENTRIES)
            rest = head.instructions[len(entries):]
            passes = _leading(rest, tuple(device))
            if all(isinstance(ins, Send) for ins in rest[len(passes):]) and not any(
                    key in made for ins in entries for key in ins.requires()):
                return j, head
        return None

    def _steps(self, s: int, instructions: Iterable[Instruction]) -> list[Step]:
        """`instructions` as they run: a maximal run of the stage's device instructions is one
        group (a tuple, one call of its runtime), a send inside such a run goes right after the
        group (what it sends is made there), every other instruction is a step of its own. After
        a stop, versions are not stashed for minibatches past the last one admitted."""
        device = self.runtimes[s].device_instructions
        steps: list[Step] = []
        group: list[Instruction] = []
        sends: list[Instruction] = []
        for ins in instructions:
            if type(ins) in device:
                if not (isinstance(ins, StashWeights) and ins.minibatch > self._limit):
                    group.append(ins)
            elif group and isinstance(ins, Send):
                sends.append(ins)
            else:
                if group:
                    steps.append(tuple(group))
                    steps.extend(sends)
                    group, sends = [], []
                steps.append(ins)
        if group:
            steps.append(tuple(group))
            steps.extend(sends)
        return steps

    def _execute(self, s: int, step: Step) -> None:
        """Carries out one step (:meth:`_steps`): a group of device instructions, or an instruction."""
        if isinstance(step, tuple):
            self._execute_group(s, step)
        else:
            self._execute_one(s, step)

    def _execute_group(self, s: int, group: tuple[Instruction, ...]) -> None:
        """Runs a group of device instructions in one call of the stage's runtime, puts its passes on
        the emulated device's timeline, and delivers the keys they provide at their own stage."""
        rt = self.runtimes[s]
        self._set_status(s, "running", group)
        t0 = self._clock()
        rt.run(group)
        t1 = self._clock()
        self.reports[s].device_calls += 1
        spans = self._pace(s, group, t0, t1)
        for ins in group:
            for dst, key in ins.provides(s):  # a version stashed, an activation slot freed: this stage's
                if isinstance(dst, int):
                    self._mailboxes[dst].put(key)
            if isinstance(ins, (ApplyUpdate, ApplyAccumulated)):
                self._report_done(s, ins)
            elif rt.is_last and isinstance(ins, Forward):
                self._logs[ins.minibatch] = rt.logs.pop(ins.minibatch)
        self._progress = self._clock()
        if self._trace:  # a paced pass shows its time on the device
            for ins in group:
                begin, end = spans.get(ins, (t0, t1))
                self._trace.span(self._pid, s, repr(ins), begin, end, category=type(ins).__name__)

    def _pace(self, s: int, group: tuple[Instruction, ...], t0: float, t1: float
              ) -> dict[Instruction, tuple[float, float]]:
        """Puts the passes of a group that ran on the host from `t0` to `t1` on the stage's emulated
        device's timeline, in turn, each taking a share of the host's time in proportion to its
        reference; returns {pass: (begin, end) on the device} (empty on a device not emulated)."""
        pacer = self._pacers[s]
        report = self.reports[s]
        if pacer is None:
            report.compute_s += t1 - t0
            return {}
        paced = [(ins, self._references[s][self._PACED[type(ins)]]) for ins in group if type(ins) in self._PACED]
        total = sum(reference for _, reference in paced)
        spans: dict[Instruction, tuple[float, float]] = {}
        start = t0
        for ins, reference in paced:
            actual = (t1 - t0) * reference / total
            begin, end = pacer.occupy(start, reference, ins.minibatch, actual=actual)
            spans[ins] = (begin, end)
            report.compute_s += end - begin
            report.busy_s += end - begin
            start += actual
        return spans

    def _execute_one(self, s: int, ins: Instruction) -> None:
        """Carries out one instruction: takes the keys it requires from the stage's mailbox,
        runs its method, and delivers the keys it provides, with the values the method
        returns for them ({(stage, key): value}; keys without a value carry None)."""
        if ins.minibatch > self._limit and isinstance(ins, SnapshotState):
            return  # the run was stopped before this minibatch started
        method = self._HANDLERS.get(type(ins))
        if method is None or isinstance(ins, SnapshotState):  # they read the stage's weights
            self._wait_for_device(s)
            self._flush_reports(s)  # its device has ended the updates whose reports it held
            self.runtimes[s].check_applied()
        self._set_status(s, "running", ins)
        t0 = self._clock()
        taken = [self._mailboxes[s].take(key) for key in ins.requires()]
        values: Values = (getattr(self, method)(s, ins, *taken) if method
                          else self._sync_handlers[type(ins)](self, s, ins, *taken)) or {}
        pacer = self._pacers[s]
        sent = _nbytes(list(values.values())) if isinstance(ins, Send) else 0
        self.reports[s].sent_bytes += sent
        for dst, key in ins.provides(s):
            if isinstance(dst, str):  # PARAMETER_SERVER: the method itself talked to the parameter servers
                continue
            if (pacer is not None and self._deliveries is not None and dst != s and key[0] in _DEVICE_RESULTS
                    and pacer.free_at > self._clock()):
                self._deliveries.put_at(pacer.free_at, _Delivery(dst, key, values.get((dst, key)), s, ins))
            else:
                self._mailboxes[dst].put(key, values.get((dst, key)))
        t1 = self._clock()
        self._progress = t1
        if self._trace:
            self._trace.span(self._pid, s, repr(ins), t0, t1, category=type(ins).__name__,
                             args={"bytes": sent} if sent else None)

    def _wait_for_device(self, s: int) -> None:
        """Waits until stage `s`'s emulated device has ended its tasks (returns at once on a device
        that is not emulated, or when the run stops): what reads the device's results back waits."""
        pacer = self._pacers[s]
        if pacer is not None:
            pacer.wait_idle(self._abort)

    # Messages ---------------------------------------------------------------------------
    def _load_minibatch(self, s: int, ins: LoadMinibatch) -> Values:
        item = next(self._data)
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"minibatch {ins.minibatch}: the dataset must yield (inputs, labels) "
                             f"pairs, got {type(item).__name__} of length "
                             f"{len(item) if hasattr(item, '__len__') else '?'}")
        x, y = item
        values: Values = {(ins.labels_to, (LABELS, ins.minibatch)): y}
        for stage, tensors in self._split_inputs(x).items():
            if stage == s:
                self.runtimes[s].set_loaded(ins.minibatch, tensors)
            else:
                values[(stage, (INPUTS, ins.minibatch))] = tensors
        return values

    def _recv_inputs(self, s: int, ins: RecvInputs, tensors: Any) -> None:
        self.runtimes[s].set_loaded(ins.minibatch, tensors)

    def _recv_labels(self, s: int, ins: RecvLabels, labels: Any) -> None:
        self.runtimes[s].set_labels(ins.minibatch, labels)

    def _recv_activation(self, s: int, ins: RecvActivation, tensors: Any) -> None:
        self.runtimes[s].set_received(ins.minibatch, tensors)

    def _send_activation(self, s: int, ins: SendActivation) -> Values:
        return {(ins.to, (ACTIVATION, ins.minibatch)): self.runtimes[s].sent(ins.minibatch)}

    def _recv_gradient(self, s: int, ins: RecvGradient, message: Any) -> None:
        self.runtimes[s].set_output_gradients(ins.minibatch, message)

    def _send_gradient(self, s: int, ins: SendGradient) -> Values:
        return {(ins.to, (GRADIENT, ins.minibatch)): self.runtimes[s].input_gradients(ins.minibatch)}

    def _send_update_terms(self, s: int, ins: SendUpdateTerms) -> Values:
        terms = self.runtimes[s].update_terms(ins.minibatch)
        return {key: terms for key in ins.provides(s)}

    def _recv_update_terms(self, s: int, ins: RecvUpdateTerms, terms: Any) -> None:
        self.runtimes[s].set_update_terms(ins.minibatch, terms)

    def _send_tied_gradients(self, s: int, ins: SendTiedGradients) -> Values:
        return {key: self.runtimes[s].tied_gradients(ins.minibatch) for key in ins.provides(s)}

    def _recv_tied_gradients(self, s: int, ins: RecvTiedGradients, grads: Any) -> None:
        self.runtimes[s].set_tied_gradients(ins.minibatch, ins.source, grads)

    # Reports --------------------------------------------------------------------------
    def _report_done(self, s: int, ins: Instruction) -> None:
        """The first stage, the last to apply a minibatch's update, reports every minibatch `ins`
        applied: at once, or on an emulated device at the next :meth:`_flush_reports`, which
        comes after the host waited for the device to end the update's pass."""
        if s == 0:
            self._done += [(p, self._logs.pop(p, {})) for p in ins.applies()]
            if self._pacers[0] is None:
                self._flush_reports(0)

    def _flush_reports(self, s: int) -> None:
        """On the first stage: reads back the verdicts of the minibatches it applied since the last
        flush (a minibatch whose loss or gradient was not finite on any stage fails the run here,
        applied nowhere), then calls on_minibatch_done for each (their updates are in every stage's
        weights by then); on the others, nothing."""
        if s == 0 and self._done:
            done, self._done = self._done, []
            self.runtimes[0].check_applied(logs=dict(done))
            if self._on_done is not None:
                for p, logs in done:
                    self._on_done(p, logs)

    def _snapshot_state(self, s: int, ins: SnapshotState) -> None:
        state = self.runtimes[s].snapshot()
        with self._snapshot_lock:
            states = self._snapshots.setdefault(ins.minibatch, {})
            states[s] = state
            complete = len(states) == self.schedule.num_stages
            if complete:
                del self._snapshots[ins.minibatch]
        if complete and self._on_snapshot:
            self._on_snapshot(ins.minibatch, [states[i] for i in range(self.schedule.num_stages)])

    # What the synchronisation scheme's handlers use ------------------------------------
    def clock(self) -> float:
        return self._clock()

    def trace_span(self, thread: int, name: str, start: float, end: float, category: str) -> None:
        """Adds a span to this worker's trace (if traced): `thread` is a row of its own."""
        if self._trace:
            self._trace.span(self._pid, thread, name, start, end, category=category)

    def in_background(self, s: int, ins: Instruction, key: Key, work: Callable[[], Any]) -> None:
        """Runs `work()` on a pool thread while stage `s` goes on, and delivers its result to
        the stage as `key`; an error fails the run at `ins`."""
        def run() -> None:
            try:
                self._mailboxes[s].put(key, work())
            except BaseException as exc:  # noqa: BLE001 - reported by run()
                self._fail(f"stage {s} failed at {ins!r}", exc)

        if self._background is None:
            raise RuntimeError("in_background is for the handlers of a synchronisation scheme, during run()")
        self._background.submit(run)


def _leading(instructions: Sequence[Instruction], types: tuple[type[Instruction], ...]) -> tuple[Instruction, ...]:
    """The instructions at the start of `instructions` that are of one of `types`."""
    n = 0
    while n < len(instructions) and isinstance(instructions[n], types):
        n += 1
    return tuple(instructions[:n])


def _joint(first: Task, second: Task) -> tuple[Instruction, ...]:
    """The instructions of two joined tasks (:meth:`PipelineExecutor._joined`) in the order they
    run: what each takes in, the first's device instructions, the second's, its sends."""
    entries = _leading(first.instructions, _ENTRIES)
    later = _leading(second.instructions, _ENTRIES)
    return entries + later + first.instructions[len(entries):] + second.instructions[len(later):]


def _stacks_of(threads: Iterable[threading.Thread]) -> str:
    """Where each of `threads` (stage threads that did not stop when the run did) is: its Python
    stack, innermost call last, for the error (a call into TensorFlow that never returns shows as
    the TensorFlow call it is in)."""
    threads = list(threads)
    if not threads:
        return ""
    # Every thread's frames, this one's too: this frame holding them is a reference cycle, which
    # would keep every frame alive (and what their locals hold, such as tf.data iterators) until
    # the garbage collector runs; it is broken before returning.
    frames = sys._current_frames()
    try:
        parts: list[str] = []
        for t in threads:
            frame = frames.get(t.ident) if t.ident is not None else None
            if frame is not None:
                stack = "".join(traceback.format_stack(frame)[-_STUCK_FRAMES:])
                parts.append(f"{t.name} did not stop; it is in (innermost last):\n{stack}")
        return "".join(parts)
    finally:
        del frames


def _format_step(step: Step | None) -> str:
    """A step (:meth:`PipelineExecutor._steps`) as the program shows it."""
    return "[" + " ".join(map(repr, step)) + "]" if isinstance(step, tuple) else repr(step)


def _format_status(what: str, about: Step | list[Task] | None) -> str:
    """A stage's status for a message: what it does, and the step or tasks it is about."""
    if about is None:
        return what
    if isinstance(about, list):  # the tasks it waits to run
        return f"{what} " + ", ".join(map(repr, about))
    return f"{what} {_format_step(about)}"
