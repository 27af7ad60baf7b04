import pytest

from hetpipe_tf.pipeline.instructions import Forward, RecvActivation, SendActivation, Task, TaskStream
from hetpipe_tf.pipeline.hetpipe import hetpipe_schedule
from hetpipe_tf.pipeline.schedule import Schedule, StageProgram
from hetpipe_tf.pipeline.simulator import ScheduleDeadlock, simulate


def test_a_key_nobody_provides_is_a_deadlock_naming_the_task():
    prog = StageProgram(0, (), (TaskStream("forward", 1, lambda p: Task(0, "forward", p, (RecvActivation(p),))),))
    with pytest.raises(ScheduleDeadlock, match=r"stage 0 forward task \[RecvActivation\(1\)\] lacks \[\('activation', 1\)\]"):
        simulate(Schedule("broken", 1, 1, 1, (prog,)), lambda s, i: 1.0)


def test_transfers_delay_the_receiving_stage():
    sched = hetpipe_schedule(2, 1, 1)

    def duration(stage, ins):
        return 1.0 if isinstance(ins, Forward) else 0.0

    fast = simulate(sched, duration)
    slow = simulate(sched, duration, transfer=lambda a, b, ins: 0.5 if isinstance(ins, SendActivation) else 0.0)
    start = lambda r: next(sp.start for sp in r.spans if sp.stage == 1 and isinstance(sp.instruction, Forward))
    assert start(slow) == pytest.approx(start(fast) + 0.5)


def test_busy_fraction_and_completions():
    result = simulate(hetpipe_schedule(2, 4, 2), lambda s, i: 1.0 if isinstance(i, Forward) else 0.0)
    assert len(result.busy_fraction()) == 2
    assert sorted(result.completion_times()) == [1, 2, 3, 4]
    assert result.throughput == pytest.approx(4 / result.makespan)
