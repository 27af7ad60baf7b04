"""A discrete-event simulation of schedules: the same instruction lists, with modelled times.

Pure Python. Every stage of every virtual worker carries out its program exactly as
the executor does: the prologue in order, then tasks chosen by
:func:`hetpipe_tf.pipeline.schedule.fifo_pick` among those whose required keys are present.
Instead of running TensorFlow, an instruction takes ``duration(stage, instruction)``
seconds (``duration((worker, stage), instruction)`` for several workers), and a key
provided to another stage arrives ``transfer(src, dst, instruction)`` seconds after
the instruction ends.

With several virtual workers, the synchronisation scheme's simulation model
(:meth:`hetpipe_tf.pipeline.schedule.SyncScheme.simulation_model`, for WSP
:class:`hetpipe_tf.sync.wsp.ParameterServerModel`) plays the servers: it receives
what instructions send to ``PARAMETER_SERVER`` and says when its answers arrive.
"""
import bisect
import gc
import heapq
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.pipeline.instructions import Delivery, Instruction, Key, Task, TaskStream
from hetpipe_tf.pipeline.schedule import (
    Agent, Candidate, Schedule, ServerModel, StageProgram, Timing, fifo_pick)

#: Where an instruction ran: a stage (one virtual worker), or (worker, stage).
Place = int | Agent
#: The seconds for what an agent's instruction provides to reach another agent.
Transfer = Callable[[Agent, Agent, Instruction], float]
#: The task an agent runs next: (start, agent, stream index, task).
Next = tuple[float, Agent, int, Task]


class ScheduleDeadlock(HetPipeUsageError, RuntimeError):
    """No stage can go on, but some tasks have not run: the schedules can never finish."""


class Span(NamedTuple):
    """One instruction as carried out: where (stage, or (worker, stage)), which, and when."""
    stage: Place
    instruction: Instruction
    start: float
    end: float


@dataclass
class SimulationResult:
    """What a simulated run did: its spans, each agent's tasks in order and busy time, the
    servers' answers."""
    agents: Sequence[Place]  # stage ids, or (worker, stage) pairs
    steps: int  # per virtual worker
    spans: list[Span] = field(default_factory=list)
    task_order: dict[Place, list[tuple[str, int]]] = field(default_factory=dict)  # agent -> [(kind, minibatch), ...]
    # (worker, stage, key, requested, answered) of server answers
    pulls: list[tuple[int, int, Key, float, float]] = field(default_factory=list)
    num_workers: int = 0  # virtual workers simulated, with those that ran as another (0: those of agents)
    busy: dict[Place, float] = field(default_factory=dict)  # agent -> seconds its instructions took (spans kept or not)
    ended: float = 0.0  # when the last instruction ended
    # (spans indexed, agent -> its spans)
    _index: tuple[int, dict[Place, list[Span]]] = field(default=(0, {}), repr=False, compare=False)

    @property
    def num_stages(self) -> int:
        """The number of agents (stages, or (worker, stage) pairs) simulated."""
        return len(self.agents)

    @property
    def makespan(self) -> float:
        """When the last instruction ended, in simulated seconds."""
        return self.ended

    @property
    def throughput(self) -> float:
        """Minibatches per second over the whole run, all virtual workers together."""
        workers = self.num_workers or len({a[0] for a in self.agents if isinstance(a, tuple)} or {0})
        return workers * self.steps / self.makespan if self.makespan > 0 else 0.0

    def spans_of(self, agent: Place) -> list[Span]:
        """The spans of `agent`, in the order they ran."""
        indexed, by_agent = self._index
        if indexed != len(self.spans):
            by_agent = {}
            for span in self.spans:
                by_agent.setdefault(span.stage, []).append(span)
            self._index = (len(self.spans), by_agent)
        return by_agent.get(agent, [])

    def busy_time(self, agent: Place) -> float:
        """The seconds `agent` ran instructions."""
        return self.busy.get(agent, 0.0)

    def busy_fraction(self) -> tuple[float, ...]:
        """Each agent's busy time over the makespan, in agent order."""
        m = self.makespan
        return tuple(self.busy_time(a) / m if m else 0.0 for a in self.agents)

    def completion_times(self, agent: Place = 0, instruction_type: type[Instruction] | None = None
                         ) -> dict[int, float]:
        """When each minibatch's update finished on `agent` (the first stage applies last): the
        end of the instruction that applied it (``applies()``; a GPipe flush applies several), or
        with `instruction_type`, of that type's instruction about it.

        Returns:
            The times, in minibatch order.
        """
        if instruction_type is not None:
            return {s.instruction.minibatch: s.end for s in self.spans_of(agent)
                    if type(s.instruction) is instruction_type}
        return {p: s.end for s in self.spans_of(agent) for p in s.instruction.applies()}

    def steady_throughput(self, agent: Place = 0, skip: int | None = None) -> float:
        """Minibatches per second between the completions of minibatch `skip` and the last,
        which leaves out the pipeline's fill (default skip: a quarter of the run).

        Returns:
            The minibatches per second.
        """
        done = self.completion_times(agent)
        last = max(done)
        first = skip if skip is not None else max(1, last // 4)
        return (last - first) / (done[last] - done[first]) if done[last] > done[first] else 0.0

    def wait_and_idle(self, worker: int) -> list[tuple[float, float]]:
        """Per pull of `worker`'s first stage: (seconds waited for the answer, seconds of that
        wait in which the stage ran nothing), §8.4. A stage runs one instruction at a time, so
        its busy time up to any moment is a prefix sum of its spans (a search per pull).

        Returns:
            The pairs, in pull order.
        """
        spans = self.spans_of((worker, 0))
        starts = [s.start for s in spans]
        done = [0.0]
        for s in spans:
            done.append(done[-1] + (s.end - s.start))

        def busy_until(t: float) -> float:
            i = bisect.bisect_right(starts, t)  # spans that started by t; the last may run past it
            return done[i] - (max(0.0, spans[i - 1].end - t) if i else 0.0)

        out: list[tuple[float, float]] = []
        for w, stage, key, asked, answered in self.pulls:
            if w == worker and stage == 0:
                out.append((answered - asked, answered - asked - (busy_until(answered) - busy_until(asked))))
        return out


def wait_and_idle(waits: Collection[tuple[float, float]], busy: Collection[tuple[float, float]]
                  ) -> list[tuple[float, float]]:
    """For every (asked, answered) wait of a stage for pulled weights: (seconds waited, seconds
    of that wait in which the stage ran nothing), given its busy (start, end) spans (§8.4).

    Returns:
        The pairs, in the waits' order.
    """
    out: list[tuple[float, float]] = []
    for asked, answered in waits:
        covered = sum(max(0.0, min(e, answered) - max(b, asked)) for b, e in busy)
        out.append((answered - asked, answered - asked - covered))
    return out


def simulate(schedule: Schedule, duration: Callable[[int, Instruction], float],
             transfer: Callable[[int, int, Instruction], float] | None = None) -> SimulationResult:
    """Runs one virtual worker's `schedule` in simulated time (stages are ints).

    Args:
        schedule: the worker's :class:`hetpipe_tf.pipeline.schedule.Schedule`.
        duration: duration(stage, instruction) -> seconds.
        transfer: transfer(src_stage, dst_stage, instruction) -> seconds for a key to reach
            another stage (default 0).

    Returns:
        Each stage's task order, busy time and spans, and when the run ended.

    Raises:
        ScheduleDeadlock: the programs can never all finish.
    """
    moved: Transfer | None = None
    if transfer is not None:
        def moved(a: Agent, b: Agent, ins: Instruction) -> float:
            return transfer(a[1], b[1], ins)
    result = simulate_workers([schedule], lambda agent, ins: duration(agent[1], ins), moved)
    stages = list(range(schedule.num_stages))
    plain = SimulationResult(agents=stages, steps=schedule.steps,
                             task_order={s: result.task_order[(0, s)] for s in stages},
                             busy={s: result.busy[(0, s)] for s in stages}, ended=result.ended)
    plain.spans = [Span(s.stage[1] if isinstance(s.stage, tuple) else s.stage, s.instruction, s.start, s.end)
                   for s in result.spans]
    return plain


def simulate_workers(schedules: Sequence[Schedule], duration: Timing, transfer: Transfer | None = None,
                     parameter_servers: ServerModel | None = None, same_as: Sequence[int] | None = None,
                     servers_hear_every_worker: bool = True, by_type: bool = False,
                     stages_recorded: Collection[int] | None = None) -> SimulationResult:
    """Runs the schedules of several virtual workers in one simulated time.

    Args:
      schedules: one :class:`hetpipe_tf.pipeline.schedule.Schedule` per virtual worker.
      duration: duration((worker, stage), instruction) -> seconds.
      transfer: transfer(src_agent, dst_agent, instruction) -> seconds for a key to reach
        another stage of the same worker (default 0).
      parameter_servers: the synchronisation scheme's simulation model, needed when the
        schedules talk to parameter servers: receive(agent, key, instruction, time) takes a
        request, answers(agents) gives (agent, key, requested, arrival) of those answered now.
      same_as: per worker, the index of a worker (itself, or an earlier one) whose schedule,
        durations and transfers are its own, so that it runs exactly as that one does. Only the
        workers that are their own run.
      servers_hear_every_worker: with `same_as`, whether the servers get every request of a
        worker that runs once for each worker the same as it, and see every worker's agents
        (exact whatever the servers do); if not, they hear from the workers that run only, which
        is exact for servers whose answers do not depend on how many workers ask (WSP's, which
        wait for every worker's push: the ones that do not run push at the same times).
      by_type: whether `duration` depends on the agent and the instruction's type only, so that
        it is asked once per pair.
      stages_recorded: the stage indices whose spans the result keeps (default: every stage's).
    Returns:
      A :class:`SimulationResult` whose agents are the (worker, stage) pairs that ran.
    Raises:
      ScheduleDeadlock: if the programs can never all finish.
      ValueError: `same_as` does not name every worker itself or an earlier worker, or an
        instruction talks to parameter servers and none are simulated.
    """
    runs_as = list(range(len(schedules))) if same_as is None else list(same_as)
    if len(runs_as) != len(schedules) or any(not 0 <= r <= w or runs_as[r] != r for w, r in enumerate(runs_as)):
        raise ValueError(f"same_as must give every one of the {len(schedules)} workers itself or an earlier worker "
                         f"that is its own, got {runs_as}")
    agents = [(w, s) for w, sched in enumerate(schedules) if runs_as[w] == w for s in range(sched.num_stages)]
    twins = {w: [w] for w in set(runs_as)}
    heard = agents
    if servers_hear_every_worker:
        for w, r in enumerate(runs_as):
            if w != r:
                twins[r].append(w)
        heard = [(w, s) for w, sched in enumerate(schedules) for s in range(sched.num_stages)]
    programs = {(w, s): schedules[w].programs[s] for w, s in agents}
    avail: dict[Agent, dict[Key, float]] = {a: {} for a in agents}
    free = {a: 0.0 for a in agents}
    pos = {a: [0] * len(programs[a].streams) for a in agents}
    result = SimulationResult(agents=agents, steps=schedules[0].steps, task_order={a: [] for a in agents},
                              num_workers=len(schedules))
    spans, pulls = result.spans, result.pulls
    ps = parameter_servers
    asked = [False]  # whether the servers received something since they last answered
    made: dict[tuple[TaskStream, int], Task] = {}  # tasks by (stream, index), shared by the agents of a program
    steps_of: dict[tuple[int, int], tuple[tuple[Instruction, ...], list[tuple[Instruction, tuple[Delivery, ...]]]]] = {}
    # keys the agent's next tasks need: others do not change its choice
    wanted: dict[Agent, Collection[Key]] = {a: () for a in agents}

    def steps(instructions: tuple[Instruction, ...], stage: int) -> list[tuple[Instruction, tuple[Delivery, ...]]]:
        """(instruction, what it provides) of each instruction, asked once per program."""
        key = (id(instructions), stage)
        out = steps_of.get(key)
        if out is None:
            out = steps_of[key] = (instructions, [(ins, tuple(ins.provides(stage))) for ins in instructions])
        return out[1]

    touched: set[Agent] = set()  # agents whose candidate task may have changed
    seconds: dict[tuple[Agent, type[Instruction]], float] = {}  # (agent, instruction type) -> seconds, with by_type

    def run(agent: Agent, instructions: tuple[Instruction, ...], start: float) -> float:
        t = start
        touched.add(agent)
        worker, stage = agent
        record = stages_recorded is None or stage in stages_recorded
        busy = result.busy.get(agent, 0.0)
        known = steps_of.get((id(instructions), stage))
        for ins, gives in (known[1] if known is not None else steps(instructions, stage)):
            if by_type:
                key = (agent, type(ins))
                took = seconds.get(key)
                if took is None:
                    took = seconds[key] = duration(agent, ins)
                end = t + took
            else:
                end = t + duration(agent, ins)
            busy += end - t
            if record:
                spans.append(Span(agent, ins, t, end))
            for dst, what in gives:
                if isinstance(dst, str):  # PARAMETER_SERVER, the one destination that is not a stage
                    if ps is None:
                        raise ValueError(f"{ins!r} talks to parameter servers, but none are simulated")
                    for w in twins[worker]:
                        ps.receive((w, stage), what, ins, end)
                    asked[0] = True
                    continue
                target = (worker, dst)
                delay = transfer(agent, target, ins) if (transfer and target != agent) else 0.0
                avail[target][what] = end + delay
                if what in wanted[target]:
                    touched.add(target)
            t = end
        result.busy[agent] = busy
        if t > result.ended:
            result.ended = t
        if asked[0] and ps is not None:  # answers change only with what the servers receive
            asked[0] = False
            for who, what, requested, arrival in ps.answers(heard):
                if who in avail:
                    avail[who][what] = arrival
                    if what in wanted[who]:
                        touched.add(who)
                    pulls.append((who[0], who[1], what, requested, arrival))
        return t

    streams_of = {a: tuple(enumerate(programs[a].streams)) for a in agents}
    ends = {stream: len(stream) for a in agents for stream in programs[a].streams}

    def candidate(a: Agent) -> Next | None:
        """(start, agent, stream index, task) of the task `a` would run next, or None; and the keys
        its next tasks need.

        Returns:
            The pair.
        """
        ready: list[tuple[Candidate, Task]] = []
        needs: list[Key] = []
        have = avail[a]
        at = pos[a]
        for i, stream in streams_of[a]:
            if at[i] >= ends[stream]:
                continue
            task = made.get((stream, at[i]))
            if task is None:
                task = made[(stream, at[i])] = stream[at[i]]
            needed = task.requires
            needs += needed
            r = 0.0
            for key in needed:
                if key not in have:
                    break
                if have[key] > r:
                    r = have[key]
            else:
                ready.append(((r, task.minibatch, i), task))
        wanted[a] = frozenset(needs)
        if not ready:
            return None
        if len(ready) == 1:
            chosen, task = ready[0]
        else:
            chosen = fifo_pick([c for c, _ in ready])
            task = next(t for c, t in ready if c == chosen)
        return (max(free[a], chosen[0]), a, chosen[2], task)

    # The loop makes millions of spans and tasks and frees none: the cycle collector would walk them
    # again and again (a quarter of a long run's time), so it waits until the loop ends.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _loop(agents, programs, pos, avail, free, result, touched, candidate, run, schedules)
    finally:
        if collecting:
            gc.enable()


def _loop(agents: list[Agent], programs: dict[Agent, StageProgram], pos: dict[Agent, list[int]],
          avail: dict[Agent, dict[Key, float]], free: dict[Agent, float], result: SimulationResult,
          touched: set[Agent], candidate: Callable[[Agent], Next | None],
          run: Callable[[Agent, tuple[Instruction, ...], float], float], schedules: Sequence[Schedule]
          ) -> SimulationResult:
    """simulate_workers' event loop."""
    for a in agents:
        free[a] = run(a, programs[a].prologue, 0.0)

    # Every agent's next task, in a heap by (start, agent): §4's order across agents is the
    # earliest start, ties to the lower agent; an entry is stale once its agent was looked at again.
    candidates: dict[Agent, Next] = {}
    heap: list[tuple[float, Agent, int]] = []
    looked = {a: 0 for a in agents}
    while True:
        for a in touched:
            c = candidate(a)
            looked[a] += 1
            if c is not None:
                candidates[a] = c
                heapq.heappush(heap, (c[0], a, looked[a]))
        touched.clear()
        while heap and heap[0][2] != looked[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            pending = [(a, stream.kind, stream[pos[a][i]]) for a in agents
                       for i, stream in enumerate(programs[a].streams) if pos[a][i] < len(stream)]
            if not pending:
                return result
            detail = "; ".join(
                f"{'stage %d' % a[1] if len(schedules) == 1 else 'worker %d stage %d' % a} {kind} task "
                f"{task!r} lacks {[key for key in task.requires if key not in avail[a]]}"
                for a, kind, task in pending)
            raise ScheduleDeadlock(f"schedule '{schedules[0].name}' cannot go on: {detail}")
        _, a, _ = heapq.heappop(heap)
        start, a, i, task = candidates[a]
        have = avail[a]
        for key in task.requires:
            del have[key]
        free[a] = run(a, task.instructions, start)
        pos[a][i] += 1
        result.task_order[a].append((task.kind, task.minibatch))
