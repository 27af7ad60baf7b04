"""Pipeline schedules and the two seams around them (HetPipe §4, §5).

Pure Python. A :class:`Schedule` holds one :class:`StageProgram` per stage: a
prologue run first, in order, then one or more task streams. A single stream
runs in its order. Several streams are merged by the rule of §4, written here
once in :func:`fifo_pick` and applied by both the executor and the simulator:

  1. a forward task for minibatch p runs after the forward task of every p' < p;
  2. a backward task for p runs after the backward task of every p' < p;
  3. among ready tasks, first ready, first run (FIFO); equal ready times go to
     the older minibatch.

Rules 1 and 2 are the order within each stream; rule 3 is the merge. It is the
one place where timing decides, for example when a middle stage has a forward
and a backward task ready, and the program says so: it lists both streams.
"""
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from hetpipe_tf.pipeline.instructions import Instruction, Key, TaskStream

#: A stage of one of several virtual workers, as the simulator names it: (worker, stage).
Agent = tuple[int, int]
#: §4 rule 3's order of a ready task: (ready time, minibatch, stream index).
Candidate = tuple[float, int, int]
#: How the executor carries out an instruction: handler(executor, stage, instruction, *taken
#: keys' values). The executor belongs to the layer above, hence ``Any`` for its arguments.
Handler = Callable[..., None]
#: The seconds an agent's instruction takes.
Timing = Callable[[Agent, Instruction], float]
_Registered = TypeVar("_Registered")


class ServerModel(Protocol):
    """What plays the parameter servers in the simulator (:meth:`SyncScheme.simulation_model`)."""

    def receive(self, agent: Agent, key: Key, instruction: Instruction, time: float) -> None:
        """Takes a request that `agent`'s `instruction` sent at `time`."""

    def answers(self, agents: Sequence[Agent]) -> list[tuple[Agent, Key, float, float]]:
        """(agent, key, requested, arrival) of every request answered now."""


@dataclass(frozen=True)
class WorkerUpdate:
    """What the stages of a virtual worker share before any applies minibatch p's update: a clip
    by the norm of all the stages' gradients together and a loss scale need every stage's gradient
    (whether it is finite, its squared norm), and a tied weight's replicas (a layer several stages
    call) need the sum of their gradients. The first stage, the last to end p's backward pass (§4),
    gathers them (the others' come with the gradient they send it, the tied replicas' gradients
    by :class:`hetpipe_tf.pipeline.instructions.SendTiedGradients` from the stages in `tied`) and
    sends the stages in `waiting` its terms; their update of p waits for them. That costs no pause:
    the next version holding update p is w_{p+Nm}, whose forward pass starts on the first stage
    after it applied p. Empty (the default): every stage applies its update as its backward pass ends."""
    waiting: tuple[int, ...] = ()
    tied: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.waiting)


NO_WORKER_UPDATE = WorkerUpdate()


def fifo_pick(candidates: Iterable[Candidate]) -> Candidate:
    """§4 rule 3: the candidate that became ready first; ties go to the older minibatch.

    Args:
      candidates: (ready_time, minibatch, stream_index) tuples of ready tasks.
    Returns:
      The chosen tuple.
    """
    return min(candidates)


@dataclass(frozen=True)
class StageProgram:
    """What one stage runs: `prologue` in order, then its `streams` merged FIFO."""
    stage: int
    prologue: tuple[Instruction, ...]
    streams: tuple[TaskStream, ...]

    def format(self, max_minibatches: int = 6) -> str:
        """The program as text, each stream's first `max_minibatches` minibatches."""
        merge = ("FIFO merge of the streams below (§4 rule 3: first ready, first run; "
                 "ties to the older minibatch)" if len(self.streams) > 1 else "in order")
        lines = [f"stage {self.stage}: prologue {list(self.prologue)}; then {merge}"]
        for stream in self.streams:
            shown = ", ".join(repr(t) for t in stream[:max_minibatches])
            more = f", ... ({len(stream)} tasks)" if len(stream) > max_minibatches else ""
            lines.append(f"  {stream.kind:>16}: {shown}{more}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Schedule:
    """Per-stage programs for `steps` minibatches with `num_in_flight` (Nm) in flight.

    Args:
        name: the name of the schedule that made it.
        num_stages: k, the number of stages.
        steps: how many minibatches the programs train.
        num_in_flight: Nm, the number of minibatches in the pipeline at once.
        programs: one program per stage, in stage order.
    """
    name: str
    num_stages: int
    steps: int
    num_in_flight: int
    programs: tuple[StageProgram, ...]

    def format(self, max_minibatches: int = 6) -> str:
        """The schedule as text: a head line, then each stage's program (:meth:`StageProgram.format`)."""
        head = (f"{self.name} schedule: {self.num_stages} stages, {self.steps} "
                f"minibatches, Nm={self.num_in_flight}")
        return "\n".join([head] + [p.format(max_minibatches) for p in self.programs])

    def __str__(self) -> str:
        return self.format()


class SyncScheme:
    """The synchronisation seam: everything between virtual workers.

    A scheme is a registered object (:func:`register_sync`) that says which instructions
    follow a minibatch's update (:meth:`after_update`), what a minibatch's forward pass
    waits for (:meth:`forward_waits`), which extra task streams a stage runs
    (:meth:`streams`), how the executor carries its instructions out (:meth:`handlers`,
    with what it keeps on each stage, :meth:`stage_state`), how the simulator models the
    servers (:meth:`simulation_model`) and how many more copies of a stage's weights it
    keeps (:attr:`weight_copies`). Which variables are synchronised is one rule for every
    scheme (:func:`hetpipe_tf.sync.parameter_server.synchronised_variables`). This base
    class is the scheme of one virtual worker alone: nothing between workers. WSP
    (:mod:`hetpipe_tf.sync.wsp`) is the first registration.
    """

    name = "none"
    instructions: frozenset[type[Instruction]] = frozenset()
    #: Its instructions that rewrite a stage's weights like an update: the planner charges
    #: each the stage's apply time.
    apply_like: frozenset[type[Instruction]] = frozenset()
    weight_copies = 0
    #: The names of the schedules this scheme works with (None: every registered one).
    schedules: frozenset[str] | None = None
    #: Whether it bounds how far a worker runs ahead of the slowest, so that in the long run
    #: every worker goes at the slowest one's pace (any finite staleness bound does; ASP not):
    #: what the planner predicts for each worker.
    bounded = True

    def after_update(self, minibatch: int, steps: int, num_in_flight: int) -> tuple[Instruction, ...]:
        """Instructions a stage runs right after applying `minibatch`'s update."""
        return ()

    def forward_waits(self, minibatch: int, num_in_flight: int) -> tuple[Key, ...]:
        """Keys (at the stage itself) that `minibatch`'s forward pass waits for."""
        return ()

    def streams(self, stage: int, steps: int, num_in_flight: int) -> tuple[TaskStream, ...]:
        """Task streams a stage runs beside its pipeline's own."""
        return ()

    def checked_bound(self, staleness_bound: int) -> int | None:
        """The bound the scheme keeps for the `staleness_bound` a user gave, or a ValueError that
        names the bounds it can keep. This base (no workers to synchronise) keeps none.

        Returns:
            The bound kept.

        Raises:
            ValueError: the scheme cannot keep `staleness_bound`.
        """
        return None

    # The stage's synchronised weights, the servers, a binding and the executor are of the runtime
    # layer, above this one: ``Any`` here, each scheme's own types in its module.
    def stage_state(self, weights: Any) -> Any:
        """What the scheme keeps on each stage (`weights`, the stage's synchronised weights,
        :class:`hetpipe_tf.runtime.stage.synchronised.SynchronisedWeights`) for its handlers, or
        None. It has ``snapshot()`` and ``restore(snapshot)``; the stage's state carries it.

        Returns:
            The state, or None.
        """
        return None

    def bind(self, worker: int, servers: Any, staleness_bound: int, timeout_s: float) -> Any:
        """The binding of virtual worker `worker` to the parameter servers: what its executor's
        handlers use. It has ``scheme`` (this scheme), ``worker`` and ``pull_waits`` (a list of
        (stage, clock, asked, answered) the handlers append to)."""
        raise NotImplementedError(f"the synchronisation scheme {self.name!r} binds no workers to servers")

    def handlers(self, binding: Any) -> Mapping[type[Instruction], Handler]:
        """Instruction type -> handler(executor, stage, instruction, *taken keys), for one
        worker bound to the others by `binding`.

        Returns:
            The handlers by instruction type.
        """
        return {}

    def run_ended(self, binding: Any) -> None:
        """A worker bound by `binding` ended its run normally (all its steps, or stopped early)."""

    def dry_handlers(self) -> Mapping[type[Instruction], Handler] | None:
        """Handlers that do the scheme's work on the stages but talk to no server and change
        nothing that a restored snapshot does not undo, for the emulation's probe runs (None:
        probes run without the scheme).

        Returns:
            The handlers, or None.
        """
        return None

    def simulation_model(self, staleness_bound: int, push_time: Timing, pull_time: Timing) -> ServerModel | None:
        """What answers the schedule's requests to the servers in the simulator (None: none)."""
        return None


NO_SYNC = SyncScheme()


class PipelineSchedule:
    """The schedule seam: how the stages of one virtual worker order their work.

    A schedule is a registered object (:func:`register_schedule`) that generates every
    stage's program and states the facts the cost model and the planner charge for it;
    ``VirtualWorker(schedule=NAME)``, the planner, the cost model and the simulator ask it
    and hard-wire nothing of any one schedule. HetPipe's (:mod:`hetpipe_tf.pipeline.hetpipe`)
    is the first registration; tests/pipeline/test_seams.py registers a toy one.
    """

    name: str
    #: The instruction types its programs contain (the executor must carry out each).
    instructions: frozenset[type[Instruction]] = frozenset()
    #: Its instructions that cost about an update (elementwise work over the stage's weights):
    #: the planner charges each the stage's apply time.
    apply_like: frozenset[type[Instruction]] = frozenset()
    #: Whether its programs can hold a :class:`WorkerUpdate` (each stage's update of minibatch p
    #: waiting for the first stage's terms).
    worker_update = False

    def programs(self, num_stages: int, steps: int, num_in_flight: int, input_stages: Sequence[int] = (0,),
                 snapshot_after: Collection[int] = (), sync: SyncScheme = NO_SYNC,
                 worker_update: WorkerUpdate = NO_WORKER_UPDATE) -> Schedule:
        """The :class:`Schedule` of a run of `steps` minibatches with `num_in_flight`
        (Nm) in flight; `sync` (a :class:`SyncScheme`, default none) adds its instructions, and
        `worker_update` (a :class:`WorkerUpdate`) the terms the stages share before an update."""
        raise NotImplementedError

    def activations_held(self, position: int, num_stages: int, num_in_flight: int) -> int:
        """The most minibatches whose activations the stage at `position` holds at once."""
        raise NotImplementedError

    def weight_versions(self, num_in_flight: int) -> int:
        """The most stashed weight versions a stage holds at once (besides its live weights)."""
        raise NotImplementedError

    def before_update(self, minibatch: int) -> tuple[Instruction, ...]:
        """Instructions a stage runs on minibatch p's weight gradient after its backward pass,
        while the version w_p it used is still stashed, before its update is applied (the
        schedules that stash versions, HetPipe's and PipeDream's, ask; TaylorPipe's
        compensation, :mod:`hetpipe_tf.pipeline.taylorpipe`). None by default.

        Returns:
            The instructions, or None.
        """
        return ()


_SCHEDULES: dict[str, PipelineSchedule] = {}
_SYNCS: dict[str, SyncScheme] = {NO_SYNC.name: NO_SYNC}


def register_schedule(schedule: PipelineSchedule) -> PipelineSchedule:
    """Makes `schedule` (a :class:`PipelineSchedule`) known by its name; returns it."""
    _SCHEDULES[schedule.name] = schedule
    return schedule


def register_sync(scheme: SyncScheme) -> SyncScheme:
    """Makes `scheme` (a :class:`SyncScheme`) known by its name; returns it."""
    _SYNCS[scheme.name] = scheme
    return scheme


def _lookup(kind: str, registry: Mapping[str, _Registered], value: str | _Registered) -> _Registered:
    if not isinstance(value, str):
        return value
    if value not in registry:
        raise ValueError(f"unknown {kind} {value!r}; the registered ones are: {', '.join(sorted(registry))} "
                         f"(register_{kind} adds one)")
    return registry[value]


def get_schedule(schedule: str | PipelineSchedule) -> PipelineSchedule:
    """The registered :class:`PipelineSchedule` named `schedule` (or `schedule` itself)."""
    return _lookup("schedule", _SCHEDULES, schedule)


def get_sync(scheme: str | SyncScheme | None) -> SyncScheme:
    """The registered :class:`SyncScheme` named `scheme` (or `scheme` itself; None: no sync)."""
    return NO_SYNC if scheme is None else _lookup("sync", _SYNCS, scheme)


def check_worker_update(schedule: PipelineSchedule, worker_update: WorkerUpdate | bool, why: str) -> None:
    """A ValueError naming the schedules that can, if `schedule` cannot hold `worker_update` (or a
    worker update at all, given True), needed for `why`, e.g. "global_clipnorm".

    Raises:
        ValueError: `schedule` cannot hold `worker_update`.
    """
    if worker_update and not schedule.worker_update:
        able = ", ".join(sorted(name for name, s in _SCHEDULES.items() if s.worker_update))
        raise ValueError(f"{why} needs every stage's gradient of a minibatch before any stage applies it, which the "
                         f"schedule {schedule.name!r} cannot wait for; the schedules that can: {able}")


def works_with(schedule: PipelineSchedule, scheme: SyncScheme) -> bool:
    """Whether `scheme` (a :class:`SyncScheme`) can synchronise workers running `schedule`."""
    return scheme.schedules is None or schedule.name in scheme.schedules


def combinations() -> list[tuple[str, str]]:
    """Every registered (schedule name, sync name) pair that works together, sorted."""
    return sorted((schedule, sync) for schedule in _SCHEDULES for sync, scheme in _SYNCS.items()
                  if works_with(_SCHEDULES[schedule], scheme))


def check_combination(schedule: str | PipelineSchedule, scheme: str | SyncScheme | None
                      ) -> tuple[PipelineSchedule, SyncScheme]:
    """The registered :class:`PipelineSchedule` and :class:`SyncScheme` named (or given) by
    `schedule` and `scheme`; a ValueError that lists the combinations that exist if the scheme
    cannot synchronise workers running that schedule.

    Returns:
        The schedule and the scheme.

    Raises:
        ValueError: the scheme cannot synchronise workers running that schedule.
    """
    chosen, synced = get_schedule(schedule), get_sync(scheme)
    if not works_with(chosen, synced):
        pairs = ", ".join(f"{a}+{b}" for a, b in combinations())
        raise ValueError(f"the synchronisation scheme {synced.name!r} does not work with the schedule "
                         f"{chosen.name!r}; the combinations that exist (schedule+sync): {pairs}")
    return chosen, synced
