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
from dataclasses import dataclass


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
    waiting: tuple = ()
    tied: tuple = ()

    def __bool__(self):
        return bool(self.waiting)


NO_WORKER_UPDATE = WorkerUpdate()


def fifo_pick(candidates):
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
    prologue: tuple
    streams: tuple

    def format(self, max_minibatches=6):
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
    """Per-stage programs for `steps` minibatches with `num_in_flight` (Nm) in flight."""
    name: str
    num_stages: int
    steps: int
    num_in_flight: int
    programs: tuple

    def format(self, max_minibatches=6):
        head = (f"{self.name} schedule: {self.num_stages} stages, {self.steps} "
                f"minibatches, Nm={self.num_in_flight}")
        return "\n".join([head] + [p.format(max_minibatches) for p in self.programs])

    def __str__(self):
        return self.format()


class PipelineSchedule:
    """The schedule seam: how the stages of one virtual worker order their work.

    A schedule is a registered object (:func:`register_schedule`) that generates every
    stage's program and states the facts the cost model and the planner charge for it;
    ``VirtualWorker(schedule=NAME)``, the planner, the cost model and the simulator ask it
    and hard-wire nothing of any one schedule. HetPipe's (:mod:`hetpipe_tf.pipeline.hetpipe`)
    is the first registration; tests/pipeline/test_seams.py registers a toy one.
    """

    name = None
    #: The instruction types its programs contain (the executor must carry out each).
    instructions = frozenset()
    #: Its instructions that cost about an update (elementwise work over the stage's weights):
    #: the planner charges each the stage's apply time.
    apply_like = frozenset()
    #: Whether its programs can hold a :class:`WorkerUpdate` (each stage's update of minibatch p
    #: waiting for the first stage's terms).
    worker_update = False

    def programs(self, num_stages, steps, num_in_flight, input_stages=(0,), snapshot_after=(),
                 sync=None, worker_update=NO_WORKER_UPDATE):
        """The :class:`Schedule` of a run of `steps` minibatches with `num_in_flight`
        (Nm) in flight; `sync` (a :class:`SyncScheme`, default none) adds its instructions, and
        `worker_update` (a :class:`WorkerUpdate`) the terms the stages share before an update."""
        raise NotImplementedError

    def activations_held(self, position, num_stages, num_in_flight):
        """The most minibatches whose activations the stage at `position` holds at once."""
        raise NotImplementedError

    def weight_versions(self, num_in_flight):
        """The most stashed weight versions a stage holds at once (besides its live weights)."""
        raise NotImplementedError

    def before_update(self, minibatch):
        """Instructions a stage runs on minibatch p's weight gradient after its backward pass,
        while the version w_p it used is still stashed, before its update is applied (the
        schedules that stash versions, HetPipe's and PipeDream's, ask; TaylorPipe's
        compensation, :mod:`hetpipe_tf.pipeline.taylorpipe`). None by default."""
        return ()


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
    instructions = frozenset()
    #: Its instructions that rewrite a stage's weights like an update: the planner charges
    #: each the stage's apply time.
    apply_like = frozenset()
    weight_copies = 0
    #: The names of the schedules this scheme works with (None: every registered one).
    schedules = None
    #: Whether it bounds how far a worker runs ahead of the slowest, so that in the long run
    #: every worker goes at the slowest one's pace (any finite staleness bound does; ASP not):
    #: what the planner predicts for each worker.
    bounded = True

    def after_update(self, minibatch, steps, num_in_flight):
        """Instructions a stage runs right after applying `minibatch`'s update."""
        return ()

    def forward_waits(self, minibatch, num_in_flight):
        """Keys (at the stage itself) that `minibatch`'s forward pass waits for."""
        return ()

    def streams(self, stage, steps, num_in_flight):
        """Task streams a stage runs beside its pipeline's own."""
        return ()

    def checked_bound(self, staleness_bound):
        """The bound the scheme keeps for the `staleness_bound` a user gave, or a ValueError that
        names the bounds it can keep. This base (no workers to synchronise) keeps none."""
        return None

    def stage_state(self, weights):
        """What the scheme keeps on each stage (`weights`, the stage's synchronised weights,
        :class:`hetpipe_tf.runtime.stage.synchronised.SynchronisedWeights`) for its handlers, or
        None. It has ``snapshot()`` and ``restore(snapshot)``; the stage's state carries it."""
        return None

    def bind(self, worker, servers, staleness_bound, timeout_s):
        """The binding of virtual worker `worker` to the parameter servers: what its executor's
        handlers use. It has ``scheme`` (this scheme), ``worker`` and ``pull_waits`` (a list of
        (stage, clock, asked, answered) the handlers append to)."""
        raise NotImplementedError(f"the synchronisation scheme {self.name!r} binds no workers to servers")

    def handlers(self, binding):
        """Instruction type -> handler(executor, stage, instruction, *taken keys), for one
        worker bound to the others by `binding`."""
        return {}

    def run_ended(self, binding):
        """A worker bound by `binding` ended its run normally (all its steps, or stopped early)."""

    def dry_handlers(self):
        """Handlers that do the scheme's work on the stages but talk to no server and change
        nothing that a restored snapshot does not undo, for the emulation's probe runs (None:
        probes run without the scheme)."""
        return None

    def simulation_model(self, staleness_bound, push_time, pull_time):
        """What answers the schedule's requests to the servers in the simulator (None: none)."""
        return None


NO_SYNC = SyncScheme()

_SCHEDULES = {}
_SYNCS = {NO_SYNC.name: NO_SYNC}


def register_schedule(schedule):
    """Makes `schedule` (a :class:`PipelineSchedule`) known by its name; returns it."""
    _SCHEDULES[schedule.name] = schedule
    return schedule


def register_sync(scheme):
    """Makes `scheme` (a :class:`SyncScheme`) known by its name; returns it."""
    _SYNCS[scheme.name] = scheme
    return scheme


def _lookup(kind, registry, value):
    if not isinstance(value, str):
        return value
    if value not in registry:
        raise ValueError(f"unknown {kind} {value!r}; the registered ones are: {', '.join(sorted(registry))} "
                         f"(register_{kind} adds one)")
    return registry[value]


def get_schedule(schedule):
    """The registered :class:`PipelineSchedule` named `schedule` (or `schedule` itself)."""
    return _lookup("schedule", _SCHEDULES, schedule)


def get_sync(scheme):
    """The registered :class:`SyncScheme` named `scheme` (or `scheme` itself; None: no sync)."""
    return NO_SYNC if scheme is None else _lookup("sync", _SYNCS, scheme)


def check_worker_update(schedule, worker_update, why):
    """A ValueError naming the schedules that can, if `schedule` cannot hold `worker_update` (needed
    for `why`, e.g. "global_clipnorm")."""
    if worker_update and not schedule.worker_update:
        able = ", ".join(sorted(name for name, s in _SCHEDULES.items() if s.worker_update))
        raise ValueError(f"{why} needs every stage's gradient of a minibatch before any stage applies it, which the "
                         f"schedule {schedule.name!r} cannot wait for; the schedules that can: {able}")


def works_with(schedule, scheme):
    """Whether `scheme` (a :class:`SyncScheme`) can synchronise workers running `schedule`."""
    return scheme.schedules is None or schedule.name in scheme.schedules


def combinations():
    """Every registered (schedule name, sync name) pair that works together, sorted."""
    return sorted((schedule, sync) for schedule in _SCHEDULES for sync, scheme in _SYNCS.items()
                  if works_with(_SCHEDULES[schedule], scheme))


def check_combination(schedule, scheme):
    """The registered :class:`PipelineSchedule` and :class:`SyncScheme` named (or given) by
    `schedule` and `scheme`; a ValueError that lists the combinations that exist if the scheme
    cannot synchronise workers running that schedule."""
    schedule, scheme = get_schedule(schedule), get_sync(scheme)
    if not works_with(schedule, scheme):
        pairs = ", ".join(f"{a}+{b}" for a, b in combinations())
        raise ValueError(f"the synchronisation scheme {scheme.name!r} does not work with the schedule "
                         f"{schedule.name!r}; the combinations that exist (schedule+sync): {pairs}")
    return schedule, scheme
