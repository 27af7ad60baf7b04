"""A discrete-event simulation of a schedule: the same instruction lists, with modelled times.

Pure Python. Each stage carries out its program exactly as the executor does:
the prologue in order, then tasks chosen by :func:`hetpipe_tf.schedule.fifo_pick`
among those whose required keys are present. Instead of running TensorFlow, an
instruction takes ``duration(stage, instruction)`` seconds, and a key provided
to another stage arrives ``transfer(src, dst, instruction)`` seconds after the
instruction ends.
"""
from dataclasses import dataclass, field

from hetpipe_tf.schedule import fifo_pick


class ScheduleDeadlock(RuntimeError):
    """No stage can go on, but some tasks have not run: the schedule can never finish."""


@dataclass(frozen=True)
class Span:
    """One instruction as carried out: where, which, and when."""
    stage: int
    instruction: object
    start: float
    end: float


@dataclass
class SimulationResult:
    num_stages: int
    num_minibatches: int
    spans: list = field(default_factory=list)
    task_order: list = field(default_factory=list)  # per stage: (kind, minibatch) in run order

    @property
    def makespan(self):
        return max((s.end for s in self.spans), default=0.0)

    @property
    def throughput(self):
        """Minibatches per second over the whole run."""
        return self.num_minibatches / self.makespan if self.makespan > 0 else 0.0

    def busy_time(self, stage):
        return sum(s.end - s.start for s in self.spans if s.stage == stage)

    def busy_fraction(self):
        m = self.makespan
        return tuple(self.busy_time(s) / m if m else 0.0 for s in range(self.num_stages))

    def completion_times(self, stage=0, instruction_type=None):
        """When each minibatch's update finished on `stage` (the first stage applies last)."""
        from hetpipe_tf.instructions import ApplyUpdate
        kind = instruction_type or ApplyUpdate
        return {s.instruction.minibatch: s.end for s in self.spans
                if s.stage == stage and type(s.instruction) is kind}


def simulate(schedule, duration, transfer=None):
    """Runs `schedule` in simulated time.

    Args:
      schedule: a :class:`hetpipe_tf.schedule.Schedule`.
      duration: duration(stage, instruction) -> seconds.
      transfer: transfer(src_stage, dst_stage, instruction) -> seconds a key takes
        to reach another stage (default: 0).
    Returns:
      A :class:`SimulationResult`.
    Raises:
      ScheduleDeadlock: if the programs can never all finish.
    """
    programs = schedule.programs
    k = len(programs)
    avail = [dict() for _ in range(k)]  # key -> time it is present at that stage
    free = [0.0] * k
    pos = [[0] * len(p.streams) for p in programs]
    result = SimulationResult(num_stages=k, num_minibatches=schedule.num_minibatches,
                              task_order=[[] for _ in range(k)])

    def run(stage, instructions, start):
        t = start
        for ins in instructions:
            end = t + duration(stage, ins)
            result.spans.append(Span(stage, ins, t, end))
            for dst, key in ins.provides(stage):
                delay = transfer(stage, dst, ins) if (transfer and dst != stage) else 0.0
                avail[dst][key] = end + delay
            t = end
        return t

    for s, prog in enumerate(programs):
        free[s] = run(s, prog.prologue, 0.0)

    while True:
        best = None  # ((start, stage), stage, stream index, task)
        for s, prog in enumerate(programs):
            ready = []
            for i, stream in enumerate(prog.streams):
                if pos[s][i] >= len(stream):
                    continue
                task = stream[pos[s][i]]
                needed = task.requires
                if all(key in avail[s] for key in needed):
                    r = max((avail[s][key] for key in needed), default=0.0)
                    ready.append(((r, task.minibatch, i), task))
            if not ready:
                continue
            chosen = fifo_pick([c[0] for c in ready])
            task = next(t for c, t in ready if c == chosen)
            start = max(free[s], chosen[0])
            if best is None or (start, s) < best[0]:
                best = ((start, s), s, chosen[2], task)
        if best is None:
            pending = [(s, stream.kind, stream[pos[s][i]])
                       for s, prog in enumerate(programs)
                       for i, stream in enumerate(prog.streams) if pos[s][i] < len(stream)]
            if not pending:
                return result
            detail = "; ".join(
                f"stage {s} {kind} task {task!r} lacks "
                f"{[key for key in task.requires if key not in avail[s]]}"
                for s, kind, task in pending)
            raise ScheduleDeadlock(f"schedule '{schedule.name}' cannot go on: {detail}")
        (start, _), s, i, task = best
        for key in task.requires:
            del avail[s][key]
        free[s] = run(s, task.instructions, start)
        pos[s][i] += 1
        result.task_order[s].append((task.kind, task.minibatch))
