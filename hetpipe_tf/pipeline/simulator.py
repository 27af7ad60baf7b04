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
from dataclasses import dataclass, field

from hetpipe_tf.pipeline.instructions import PARAMETER_SERVER
from hetpipe_tf.pipeline.schedule import fifo_pick


class ScheduleDeadlock(RuntimeError):
    """No stage can go on, but some tasks have not run: the schedules can never finish."""


@dataclass(frozen=True)
class Span:
    """One instruction as carried out: where (stage, or (worker, stage)), which, and when."""
    stage: object
    instruction: object
    start: float
    end: float


@dataclass
class SimulationResult:
    agents: list  # stage ids, or (worker, stage) pairs
    steps: int  # per virtual worker
    spans: list = field(default_factory=list)
    task_order: dict = field(default_factory=dict)  # agent -> [(kind, minibatch), ...]
    pulls: list = field(default_factory=list)  # (worker, stage, key, requested, answered) of server answers

    @property
    def num_stages(self):
        return len(self.agents)

    @property
    def makespan(self):
        return max((s.end for s in self.spans), default=0.0)

    @property
    def throughput(self):
        """Minibatches per second over the whole run, all virtual workers together."""
        workers = {a[0] for a in self.agents} if isinstance(self.agents[0], tuple) else {0}
        return len(workers) * self.steps / self.makespan if self.makespan > 0 else 0.0

    def busy_time(self, agent):
        return sum(s.end - s.start for s in self.spans if s.stage == agent)

    def busy_fraction(self):
        m = self.makespan
        return tuple(self.busy_time(a) / m if m else 0.0 for a in self.agents)

    def completion_times(self, agent=0, instruction_type=None):
        """When each minibatch's update finished on `agent` (the first stage applies last): the
        end of the instruction that applied it (``applies()``; a GPipe flush applies several), or
        with `instruction_type`, of that type's instruction about it."""
        if instruction_type is not None:
            return {s.instruction.minibatch: s.end for s in self.spans
                    if s.stage == agent and type(s.instruction) is instruction_type}
        return {p: s.end for s in self.spans if s.stage == agent for p in s.instruction.applies()}

    def steady_throughput(self, agent=0, skip=None):
        """Minibatches per second between the completions of minibatch `skip` and the last,
        which leaves out the pipeline's fill (default skip: a quarter of the run)."""
        done = self.completion_times(agent)
        last = max(done)
        first = skip if skip is not None else max(1, last // 4)
        return (last - first) / (done[last] - done[first]) if done[last] > done[first] else 0.0

    def wait_and_idle(self, worker):
        """Per pull of `worker`'s first stage: (seconds waited for the answer, seconds of that
        wait in which the stage ran nothing), §8.4."""
        agent = (worker, 0)
        busy = [(s.start, s.end) for s in self.spans if s.stage == agent]
        return wait_and_idle([(asked, answered) for w, stage, key, asked, answered in self.pulls
                              if w == worker and stage == 0], busy)


def wait_and_idle(waits, busy):
    """For every (asked, answered) wait of a stage for pulled weights: (seconds waited, seconds
    of that wait in which the stage ran nothing), given its busy (start, end) spans (§8.4)."""
    out = []
    for asked, answered in waits:
        covered = sum(max(0.0, min(e, answered) - max(b, asked)) for b, e in busy)
        out.append((answered - asked, answered - asked - covered))
    return out


def simulate(schedule, duration, transfer=None):
    """Runs one virtual worker's `schedule` in simulated time (stages are ints)."""
    result = simulate_workers([schedule], lambda agent, ins: duration(agent[1], ins),
                              None if transfer is None else (lambda a, b, ins: transfer(a[1], b[1], ins)))
    stages = list(range(schedule.num_stages))
    plain = SimulationResult(agents=stages, steps=schedule.steps,
                             task_order={a[1]: order for a, order in result.task_order.items()})
    plain.spans = [Span(s.stage[1], s.instruction, s.start, s.end) for s in result.spans]
    return plain


def simulate_workers(schedules, duration, transfer=None, parameter_servers=None):
    """Runs the schedules of several virtual workers in one simulated time.

    Args:
      schedules: one :class:`hetpipe_tf.pipeline.schedule.Schedule` per virtual worker.
      duration: duration((worker, stage), instruction) -> seconds.
      transfer: transfer(src_agent, dst_agent, instruction) -> seconds for a key to reach
        another stage of the same worker (default 0).
      parameter_servers: the synchronisation scheme's simulation model, needed when the
        schedules talk to parameter servers: receive(agent, key, instruction, time) takes a
        request, answers(agents) gives (agent, key, requested, arrival) of those answered now.
    Returns:
      A :class:`SimulationResult` whose agents are (worker, stage) pairs.
    Raises:
      ScheduleDeadlock: if the programs can never all finish.
    """
    agents = [(w, s) for w, sched in enumerate(schedules) for s in range(sched.num_stages)]
    programs = {(w, s): sched.programs[s] for w, sched in enumerate(schedules) for s in range(sched.num_stages)}
    avail = {a: {} for a in agents}
    free = {a: 0.0 for a in agents}
    pos = {a: [0] * len(programs[a].streams) for a in agents}
    result = SimulationResult(agents=agents, steps=schedules[0].steps,
                              task_order={a: [] for a in agents})
    ps = parameter_servers

    touched = set()  # agents whose candidate task may have changed

    def run(agent, instructions, start):
        t = start
        touched.add(agent)
        for ins in instructions:
            end = t + duration(agent, ins)
            result.spans.append(Span(agent, ins, t, end))
            for dst, key in ins.provides(agent[1]):
                if dst == PARAMETER_SERVER:
                    if ps is None:
                        raise ValueError(f"{ins!r} talks to parameter servers, but none are simulated")
                    ps.receive(agent, key, ins, end)
                    continue
                target = (agent[0], dst)
                delay = transfer(agent, target, ins) if (transfer and target != agent) else 0.0
                avail[target][key] = end + delay
                touched.add(target)
            t = end
        if ps is not None:
            for who, key, asked, arrival in ps.answers(agents):
                avail[who][key] = arrival
                touched.add(who)
                result.pulls.append((who[0], who[1], key, asked, arrival))
        return t

    def candidate(a):
        """(start, agent, stream index, task) of the task `a` would run next, or None."""
        ready = []
        for i, stream in enumerate(programs[a].streams):
            if pos[a][i] >= len(stream):
                continue
            task = stream[pos[a][i]]
            needed = task.requires
            if all(key in avail[a] for key in needed):
                r = max((avail[a][key] for key in needed), default=0.0)
                ready.append(((r, task.minibatch, i), task))
        if not ready:
            return None
        chosen = fifo_pick([c for c, _ in ready])
        task = next(t for c, t in ready if c == chosen)
        return (max(free[a], chosen[0]), a, chosen[2], task)

    for a in agents:
        free[a] = run(a, programs[a].prologue, 0.0)

    candidates = {}
    while True:
        for a in touched:
            candidates[a] = candidate(a)
        touched.clear()
        live = [c for c in candidates.values() if c is not None]
        if not live:
            pending = [(a, stream.kind, stream[pos[a][i]]) for a in agents
                       for i, stream in enumerate(programs[a].streams) if pos[a][i] < len(stream)]
            if not pending:
                return result
            detail = "; ".join(
                f"{'stage %d' % a[1] if len(schedules) == 1 else 'worker %d stage %d' % a} {kind} task "
                f"{task!r} lacks {[key for key in task.requires if key not in avail[a]]}"
                for a, kind, task in pending)
            raise ScheduleDeadlock(f"schedule '{schedules[0].name}' cannot go on: {detail}")
        start, a, i, task = min(live, key=lambda c: (c[0], c[1]))
        for key in task.requires:
            del avail[a][key]
        free[a] = run(a, task.instructions, start)
        pos[a][i] += 1
        result.task_order[a].append((task.kind, task.minibatch))
