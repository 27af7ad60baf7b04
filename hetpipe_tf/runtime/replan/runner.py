"""A run of virtual workers in this process that re-plans when a device slows down for good.

:class:`ReplanningRunner` trains as a :class:`hetpipe_tf.runtime.wsp_runner.WSPRunner` does (it
holds one, the run under its current plan) and adds three things:

**Drained points.** It trains each epoch in chunks of about `chunk_minibatches` minibatches of every
worker (whole waves of Nm minibatches, the epoch's last chunk its rest). At a chunk's end every worker
has pushed its last wave and every stage takes the global weights: the drained state at a
checkpointing epoch's end (:mod:`hetpipe_tf.runtime.checkpoint`), here at a common wave
boundary within an epoch. Under D > 0 the workers stand at different clocks inside a chunk; at
its end the faster ones have waited, as at an epoch's end.

**Watching.** Each worker's stages report their device compute per wave
(:meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.stage_compute_s`) to a
:class:`hetpipe_tf.runtime.replan.watch.StageWatch` of the current plan.

**Switching.** At a chunk's end where the watch found devices slowed for good, the run decides
(at an epoch's last chunk: before the next epoch trains, once the epoch's callbacks ran and its
checkpoint, if due, is saved from the plan the epoch trained under)
(:func:`hetpipe_tf.runtime.replan.decide.decide`) and, if it switches: takes its state in memory
as a checkpoint would (:meth:`WSPRunner.run_state`: the Keras model's global weights, every
worker's optimizer state per model variable, the clocks) and goes on under the new plan (same
workers and devices: new cuts and Nm) from that state, as a checkpoint resumes under another
cut and Nm (:data:`SwitchFactory`). In this process a new :class:`WSPRunner` of the plan takes
the streams of data over (:func:`rebuilt_in_process`); with a process per worker every process
stays and builds its worker again under the new plan from the state sent to it
(:meth:`hetpipe_tf.distributed.process_runner.ProcessRunner.switch_plan`), its data stream where
it stands. The data's rule: every worker keeps its shard and its place in it, so the rest of
the epoch is divided as it was: each worker trains the rest of its share
(:func:`hetpipe_tf.runtime.checkpoint.epoch_shares`), none of the epoch's minibatches skipped
or seen twice. The Keras loop sees one run: the same events, epochs and callbacks.

Every decision, with its figures, goes to the log (a line on stdout), the trace (a span of
category ``Replan``, when the fit is traced) and :meth:`stats`; a switch adds its wall time by
parts: `drain_s` (from the first worker's last update of the chunk to the chunk's end: the
pipelines empty, the faster workers wait), `plan_s` (watch, planner, simulator), `state_s` (the
state in memory), `rebuild_s` (the new runner and its servers, then to its first update: its
workers built, their stages' functions traced, their pipelines filled). The switch's cost that a
decision weighs is predicted from the run's own start: its runner's construction and the time
to its first update, and the drain.
"""
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import keras
import tensorflow as tf

from hetpipe_tf.pipeline.emulation import EmulationReport, RunProgress
from hetpipe_tf.pipeline.trace import TraceRecorder
from hetpipe_tf.planning.planner import Plan, PlanError
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime.checkpoint import PlanCuts, RunState
from hetpipe_tf.runtime.fit_loop import Events, done_event
from hetpipe_tf.runtime.replan.decide import Decision, SwitchRule, decide
from hetpipe_tf.runtime.replan.watch import StageKey, StageWatch, WatchRule
from hetpipe_tf.runtime.run_config import RunConfig
from hetpipe_tf.runtime.wsp_runner import WSPRunner

class PlanRunner(Protocol):
    """What trains the run under one plan (:class:`WSPRunner` in this process, or the chief's
    :class:`hetpipe_tf.distributed.process_runner.ProcessRunner` of a worker process each): the
    runner of ``fit`` (:mod:`hetpipe_tf.runtime.fit_loop`) with these too."""
    model: keras.Model
    config: RunConfig

    @property
    def num_workers(self) -> int: ...

    @property
    def trace(self) -> TraceRecorder | None: ...

    def train_fit(self, steps: Sequence[int], trace: bool = False, on_minibatch_done: Callable | None = None,
                  on_started: Callable[[float], None] | None = None) -> Any: ...

    def stage_compute_s(self, worker: int) -> list[float]: ...

    def drain(self) -> None: ...

    def run_state(self, epoch: int, positions: Sequence[int], plan: PlanCuts | None) -> RunState: ...

    def emulation_report(self) -> EmulationReport | None: ...


#: Builds the run's runner for a plan under a configuration (its workers' specs at the plan's cuts).
RunnerFactory = Callable[[Plan, RunConfig], PlanRunner]

#: Goes on under a new plan: (the current runner, drained; the plan; its configuration; the run's
#: state taken from the runner) -> the runner that trains on from that state with the same data
#: streams. None: :func:`rebuilt_in_process`.
SwitchFactory = Callable[[PlanRunner, Plan, RunConfig, RunState], PlanRunner]


def rebuilt_in_process(make_runner: RunnerFactory) -> SwitchFactory:
    """The switch of a run in this process: a new :class:`WSPRunner` of the plan (`make_runner`)
    that keeps the old one's virtual workers whose devices and cuts stay
    (:meth:`WSPRunner.keep_workers`; the others are built and traced), given the old one's streams
    of data (:meth:`WSPRunner.continue_fit`), resumed from the state (:meth:`WSPRunner.resume`) as
    a checkpoint resumes under another cut and Nm."""
    def switch(old: PlanRunner, plan: Plan, config: RunConfig, state: RunState) -> PlanRunner:
        assert isinstance(old, WSPRunner)
        new = make_runner(plan, config)
        assert isinstance(new, WSPRunner)
        new.keep_workers(old)
        new.continue_fit(old.fit_data())
        new.resume(state)
        return new
    return switch


@dataclass(frozen=True)
class ReplanOptions:
    """How a run re-plans: the watch's rule, the switch's margins, how often a drained point
    comes (every `chunk_minibatches` minibatches of every worker, rounded up to whole waves), and
    whether it re-plans at all (`enabled` False: one chunk per epoch, watched, never switched).
    A chunk's end costs a drain (the pipelines empty and fill again): the longer the chunks, the
    less that costs and the later a switch comes."""
    watch: WatchRule = WatchRule()
    switch: SwitchRule = SwitchRule()
    chunk_minibatches: int = 32
    enabled: bool = True

    def __post_init__(self) -> None:
        value = self.chunk_minibatches
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"chunk_minibatches must be an integer >= 1, got {value!r}")

    def chunk(self, num_in_flight: int) -> int:
        """Minibatches of each worker per chunk: whole waves of Nm, at least `chunk_minibatches`."""
        return -(-self.chunk_minibatches // num_in_flight) * num_in_flight


@dataclass
class _Chunk:
    """What the watch needs of the chunk being trained: each worker's compute at its last wave end."""
    num_in_flight: int
    called: float
    last: dict[int, list[float]] = field(default_factory=dict)
    last_done: dict[int, float] = field(default_factory=dict)


class ReplanningRunner:
    """A run that re-plans (see the module docstring); what ``fit`` trains, as a WSPRunner.

    Args:
      plan: the run's plan; `request`: what it was planned from (planned again with it).
      config: the run's resolved configuration.
      make_runner: builds the runner of a plan under a configuration (:data:`RunnerFactory`).
      switch_runner: how the run goes on under a new plan (:data:`SwitchFactory`; default: a new
        runner in this process, :func:`rebuilt_in_process`).
      options: :class:`ReplanOptions`.
      optimizer_slots: the optimizer's slots per weight (the planner charges their memory).
      progress: the run's :class:`RunProgress` (its minibatches counted here; a persistent
        emulated slowdown reads it).
    """

    trains_by_epoch = True

    def __init__(self, plan: Plan, request: PlanRequest, config: RunConfig, make_runner: RunnerFactory,
                 options: ReplanOptions = ReplanOptions(), optimizer_slots: int = 1,
                 progress: RunProgress | None = None, switch_runner: SwitchFactory | None = None) -> None:
        # HetPipeStrategy refuses replan="auto" with uneven minibatches: every worker keeps its shard
        assert not (plan.minibatch_sizes and options.enabled), "re-planning re-plans even minibatches only"
        self.plan = plan
        self.request = request
        self.make_runner = make_runner
        self.switch_runner = switch_runner or rebuilt_in_process(make_runner)
        self.options = options
        self.optimizer_slots = optimizer_slots
        self.progress = progress or RunProgress()
        started = time.perf_counter()
        self.runner = make_runner(plan, config)
        self._build_s = time.perf_counter() - started  # the runner's construction
        self._first_update_s: float | None = None  # from the first chunk's start to its first update
        self._known: dict[str, float] = {}  # devices' speeds measured so far
        self._watch: StageWatch | None = None
        self._lock = threading.Lock()
        self._chunk: _Chunk | None = None
        self._trace: TraceRecorder | None = None
        self._fit_left: int | None = None  # minibatches of every worker still to train in the fit
        self._decide_next = False  # an epoch ended: decide before the next one trains
        self.decisions: list[dict[str, Any]] = []
        self.switches: list[dict[str, Any]] = []
        self.positions: list[int] = []
        #: Every chunk trained: (Nm, minibatches of each worker).
        self.chunk_log: list[tuple[int, list[int]]] = []
        #: Every chunk's wall time, from its call to its drain (a switch's traces made after its first
        #: update show as the excess of the chunk after it over the next).
        self.chunk_seconds: list[float] = []

    # The run under its current plan -------------------------------------------------------
    #: What this runner is as the run under its current plan is (attributes and methods of ``fit``'s
    #: runner that re-planning adds nothing to): asked of that runner at each use.
    DELEGATED = frozenset({"model", "config", "num_workers", "drain", "after_drain", "epoch_weights", "evaluate",
                           "end_fit", "release_fit_data", "resume", "task_lost", "stage_optimizers", "request_stop",
                           "abort", "emulation_report", "images_per_s"})

    def __getattr__(self, name: str) -> Any:
        if name in ReplanningRunner.DELEGATED and "runner" in self.__dict__:
            return getattr(self.runner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def trace(self) -> TraceRecorder | None:
        """Every chunk's trace of the fit, with each decision as a span (category ``Replan``) of its planning."""
        return self._trace

    @property
    def cuts(self) -> PlanCuts:
        return PlanCuts.of_plan(self.plan)

    def set_fit_length(self, minibatches: int) -> None:
        """How many minibatches (every worker together) the fit trains from now: the remaining
        work a switch's gain is counted over (default: the rest of the current epoch)."""
        self._fit_left = int(minibatches)

    def begin_fit(self, shards: Sequence[Iterable], positions: Sequence[int]) -> None:
        self.runner.begin_fit(shards, positions)
        self.positions = list(positions)

    def train_segment(self, steps: Sequence[int], events: Events, first: bool, trace: bool,
                      epoch_ends: Sequence[int]) -> None:
        left = list(steps)
        if self._decide_next:  # found at the last epoch's end: decided here, after its callbacks and checkpoint
            self._decide_next = False
            self._maybe_switch(sum(steps) if self._fit_left is None else self._fit_left)
        if trace and self._trace is None:
            self._trace = TraceRecorder(metadata={"hetpipe_tf": "re-planning run"})
        while any(left):
            size = self.options.chunk(self.config.num_in_flight)
            last = not self.options.enabled or min(left) <= size + self.config.num_in_flight
            chunk = list(left) if last else [size] * len(left)
            called = time.perf_counter()
            self._train_chunk(chunk, events, first and left == list(steps), trace)
            self.chunk_seconds.append(time.perf_counter() - called)
            self.chunk_log.append((self.config.num_in_flight, list(chunk)))
            left = [a - b for a, b in zip(left, chunk)]
            self.positions = [p + n for p, n in zip(self.positions, chunk)]
            if self._fit_left is not None:
                self._fit_left -= sum(chunk)
            if self.options.enabled and any(left):
                self._maybe_switch(sum(left) if self._fit_left is None else self._fit_left)
            elif self.options.enabled and (self._fit_left or 0) > 0:
                self._decide_next = True

    def _train_chunk(self, chunk: Sequence[int], events: Events, first: bool, trace: bool) -> None:
        runner, k = self.runner, self.num_workers
        called = time.perf_counter()
        self._chunk = _Chunk(self.config.num_in_flight, called)
        report_done = done_event(events)

        def done(i: int, p: int, logs: Any) -> None:
            self._completed(i, p)
            report_done(i, p, logs)

        def started(t: float) -> None:
            if first:
                for _ in range(k):
                    events.put("started", t)
            if self._watch is None:
                self._watch = self._new_watch(None)

        runner.train_fit(list(chunk), trace, done, started)
        runner.drain()
        if trace and runner.trace is not None and self._trace is not None:
            self._trace.add_events(runner.trace.events(), runner.trace.origin or 0.0)

    def _completed(self, i: int, p: int) -> None:
        """Worker `i`'s minibatch `p` is in: counted, and at a wave's end its stages' compute watched."""
        self.progress.minibatch_done()
        chunk, watch = self._chunk, self._watch
        if chunk is None:
            return
        now = time.perf_counter()
        with self._lock:
            if not chunk.last_done:  # the chunk's first update: its workers built, traced, their pipelines filled
                self._started_chunk(now - chunk.called)
            chunk.last_done[i] = now
            if watch is None or p % chunk.num_in_flight:
                return
            compute = self.runner.stage_compute_s(i)
            before = chunk.last.get(i, [0.0] * len(compute))
            chunk.last[i] = compute
            for q, (a, b) in enumerate(zip(compute, before)):
                if (i, q) in watch.expected:
                    watch.observe((i, q), (a - b) / chunk.num_in_flight)

    def _started_chunk(self, seconds: float) -> None:
        """The first chunk of a plan took `seconds` to its first update: the build of its workers
        (the first chunk of the run: the switch's cost is predicted from it) or the rebuild of a
        switch (its part ``rebuild_s``)."""
        if self._first_update_s is None:
            self._first_update_s = seconds
        if self.switches and "rebuild_s" not in self.switches[-1]:
            self.switches[-1]["rebuild_s"] = round(self.switches[-1].pop("_built_s") + seconds, 4)

    def _new_watch(self, host_factor: float | None) -> StageWatch:
        """The watch of the current plan: each stage's forward and backward passes as the plan's
        profile times them on this host, on its device at the speed planned, at the run's
        dilation (what an emulated device is paced to, :mod:`hetpipe_tf.pipeline.emulation`)."""
        report = self.runner.emulation_report()
        dilation = report.dilation if report is not None else 1.0
        times = self.plan.profile.times.get("host")
        expected: dict[StageKey, float] = {}
        devices: dict[StageKey, tuple[str, float]] = {}
        for w, worker in enumerate(self.plan.workers):
            for q, (st, d) in enumerate(zip(worker.partition.stages, worker.devices)):
                if d.type.emulated and times is not None:
                    speed = float(d.type.emulated_speed)
                    expected[(w, q)] = sum(times.pass_seconds(*st.segments)) * dilation / speed
                    devices[(w, q)] = (d.name, speed)
        return StageWatch(expected, devices, self.options.watch, host_factor)

    # Deciding and switching ---------------------------------------------------------------
    def _maybe_switch(self, remaining_minibatches: int) -> None:
        watch = self._watch
        if watch is None:
            return
        t0 = time.perf_counter()
        with self._lock:
            slowed = watch.slowed()
        if not slowed:
            return
        report = self.runner.emulation_report()
        dilation = report.dilation if report is not None else 1.0
        batch = self.plan.profile.batch_size
        ends = list(self._chunk.last_done.values()) if self._chunk else []
        drain_s = (t0 - min(ends)) if ends else 0.0
        cost = self._build_s + (self._first_update_s or 0.0) + drain_s
        decision = decide(self.plan, self.request, slowed, self._known, remaining_minibatches * batch, cost, dilation,
                          self.optimizer_slots, self.options.switch)
        plan_s = time.perf_counter() - t0
        self._known.update({s.device: s.measured_speed for s in slowed})
        figures = dict(decision.as_dict(), positions=list(self.positions), plan_s=round(plan_s, 4))
        self.decisions.append(figures)
        print(f"hetpipe: re-plan at positions {self.positions}: {decision.reason} "
              f"(predicted {decision.current_images_per_s:.1f} -> {decision.new_images_per_s:.1f} images/s)",
              flush=True)
        if self._trace is not None:
            self._trace.span(0, 999, "replan: switch" if decision.switch else "replan: stay", t0, t0 + plan_s,
                             category="Replan", args=figures)
        if not decision.switch or decision.plan is None:
            with self._lock:
                watch.known(slowed)
            return
        try:
            self._switch(decision, dilation, drain_s, plan_s, watch.host_factor)
        except PlanError as e:  # the runner cannot take the plan (a worker's process would move): nothing changed
            figures.update(switch=False, reason=f"the run cannot go on under the new plan: {e}")
            print(f"hetpipe: re-plan at positions {self.positions}: stays: {figures['reason']}", flush=True)
            with self._lock:
                watch.known(slowed)

    def _switch(self, decision: Decision, dilation: float, drain_s: float, plan_s: float,
                host_factor: float | None) -> None:
        """Goes on under `decision.plan` from the run's state taken in memory (module docstring)."""
        assert decision.plan is not None
        t0 = time.perf_counter()
        old = self.runner
        state = old.run_state(0, self.positions, self.cuts)
        state_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.runner = self.switched_runner(old, decision.plan, state, dilation)
        self.plan = decision.plan
        self._watch = self._new_watch(host_factor)
        self.switches.append({"positions": list(self.positions), "after_chunks": len(self.chunk_log),
                              "drain_s": round(drain_s, 4),
                              "plan_s": round(plan_s, 4), "state_s": round(state_s, 4),
                              "_built_s": time.perf_counter() - t1, "num_in_flight": decision.plan.num_in_flight,
                              "boundaries": [list(decision.plan.node_boundaries(w))
                                             for w in range(len(decision.plan.workers))]})

    def switched_runner(self, old: PlanRunner, new_plan: Plan, state: RunState, dilation: float) -> PlanRunner:
        """The runner of `new_plan`, going on from `state` (taken from `old`, drained) at the run's
        `dilation`, with `old`'s streams of data (:data:`SwitchFactory`)."""
        config = old.config.replace(num_in_flight=new_plan.num_in_flight, placement=new_plan.placement,
                                    dilation=dilation)
        return self.switch_runner(old, new_plan, config, state)

    # What fit asks of a runner with global weights (and DELEGATED) ---------------------------
    def epoch_logs(self) -> dict:
        return dict(self.runner.epoch_logs(), plan_switches=len(self.switches))

    def run_state(self, epoch: int, positions: Sequence[int], plan: PlanCuts | None) -> RunState:
        """The run as a checkpoint holds it, under its current plan's cuts (whatever `plan` the
        fit started with)."""
        return self.runner.run_state(epoch, positions, self.cuts)

    def stats(self, since: float | None = None) -> list[dict]:
        """Per worker, as :meth:`WSPRunner.stats` (under the current plan), with the run's
        re-planning: every decision and its figures (``replan_decisions``) and the switches with
        their wall time by parts (``plan_switches``)."""
        return [dict(row, replan_decisions=list(self.decisions), plan_switches=list(self.switches))
                for row in self.runner.stats(since)]
