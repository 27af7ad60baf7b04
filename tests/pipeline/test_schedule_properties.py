"""Property tests of HetPipe's schedule (§4): random k, Nm, run length and task times.

Pure Python (hypothesis). Every schedule runs in the simulator with random per-stage
forward, backward and update times and random link delays; the run must finish (no
deadlock), and every stage's run, read back from the simulator's spans, must keep the
rules of :mod:`hetpipe_tf.pipeline.schedule` and :mod:`hetpipe_tf.pipeline.hetpipe`:

* rule 1: forward tasks in minibatch order; a minibatch's forward on stage q + 1 after
  its forward on q;
* rule 2: backward tasks in minibatch order; a minibatch's backward on stage q after its
  backward on q + 1 (reverse order) and after its own forward on q;
* rule 3: a stage runs, among its ready tasks, the one that became ready first (ties to
  the older minibatch), and never idles while a task is ready;
* every minibatch forwarded, backwarded and applied exactly once per stage;
* weight stashing: w_p holds exactly the stage's local updates 1..p-Nm, it is stashed
  before Forward(p) and released after Backward(p), and at most Nm versions are live;
* at most Nm minibatches in flight on a stage (forward started, update not yet applied),
  and at most min(Nm, k - q) minibatches' activations held at position q.

Task times are drawn as quarters (frequent ties, which rule 3's tie-break decides) or as
any float; compute times are positive, so a message always arrives after its sender
started. A failure prints the falsifying run (hypothesis) and the schedule's programs.
"""
from dataclasses import dataclass

from hypothesis import given, note, settings

from hetpipe_tf.pipeline.hetpipe import hetpipe_schedule
from hetpipe_tf.pipeline.simulator import simulate
from tests.helpers.schedule_runs import check_across_stages, check_stage, runs


@dataclass(frozen=True)
class RunTask:
    """A task as a stage ran it: which stream, when, and the heads of its other streams then."""
    task: object
    stream: int
    start: float
    end: float
    others: tuple  # (stream index, task) at the head of every other unfinished stream


def _arrivals(run, result):
    """(stage, key) -> when the key arrived there; every key is provided exactly once."""
    out = {}
    for sp in result.spans:
        for dst, key in sp.instruction.provides(sp.stage):
            assert (dst, key) not in out, f"{key} provided twice to stage {dst}"
            out[(dst, key)] = sp.end + (run.transfer(sp.stage, dst, sp.instruction) if dst != sp.stage else 0.0)
    return out


def _tasks_as_run(schedule, result, stage):
    """The prologue's end and the stage's tasks as run, matched to the spans in run order."""
    program = schedule.programs[stage]
    spans = iter([sp for sp in result.spans if sp.stage == stage])
    prologue = [next(spans) for _ in program.prologue]
    assert [sp.instruction for sp in prologue] == list(program.prologue)
    kinds = {stream.kind: i for i, stream in enumerate(program.streams)}
    pos = [0] * len(program.streams)
    out = []
    for kind, p in result.task_order[stage]:
        i = kinds[kind]
        task = program.streams[i][pos[i]]
        assert task.minibatch == p
        others = tuple((j, stream[pos[j]]) for j, stream in enumerate(program.streams)
                       if j != i and pos[j] < len(stream))
        mine = [next(spans) for _ in task.instructions]
        assert [sp.instruction for sp in mine] == list(task.instructions)
        out.append(RunTask(task, i, mine[0].start, mine[-1].end, others))
        pos[i] += 1
    assert pos == [len(stream) for stream in program.streams], f"stage {stage} left tasks unrun"
    assert next(spans, None) is None
    return (prologue[-1].end if prologue else 0.0), out


def _check_rule_3(stage, arrivals, free, tasks):
    """First ready, first run (ties to the older minibatch, then the stream order), no idling."""

    def ready(task):
        keys = [(stage, key) for key in task.requires]
        if not all(key in arrivals for key in keys):
            return None
        return max((arrivals[key] for key in keys), default=0.0)

    for run in tasks:
        mine = ready(run.task)
        assert mine is not None and run.start == max(free, mine), (
            f"stage {stage} started {run.task!r} at {run.start}, free at {free}, ready at {mine}")
        for j, other in run.others:
            theirs = ready(other)
            if theirs is not None and theirs <= run.start:
                assert (mine, run.task.minibatch, run.stream) <= (theirs, other.minibatch, j), (
                    f"stage {stage} ran {run.task!r} (ready at {mine}) at {run.start} although "
                    f"{other!r} was ready at {theirs}")
        free = run.end


@settings(max_examples=200, deadline=None, print_blob=True)
@given(runs())
def test_hetpipe_schedules_keep_the_rules_of_section_4(run):
    schedule = hetpipe_schedule(run.k, run.n, run.nm)
    note(schedule.format(max_minibatches=3))
    result = simulate(schedule, run.duration, transfer=run.transfer)  # raises ScheduleDeadlock if stuck
    arrivals = _arrivals(run, result)
    for stage in range(run.k):
        free, tasks = _tasks_as_run(schedule, result, stage)
        assert len(tasks) == (run.n if stage == run.k - 1 else 2 * run.n)
        _check_rule_3(stage, arrivals, free, tasks)
        check_stage(run, stage, [sp for sp in result.spans if sp.stage == stage])
    check_across_stages(run, result)
