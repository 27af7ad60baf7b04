import random

import pytest

from hetpipe_tf.pipeline.hetpipe import HETPIPE, hetpipe_schedule
from hetpipe_tf.pipeline.instructions import Backward, Forward, RecvActivation, SendActivation, Task, TaskStream
from hetpipe_tf.pipeline.schedule import Schedule, StageProgram
from hetpipe_tf.pipeline.simulator import ScheduleDeadlock, simulate, simulate_workers
from hetpipe_tf.sync.pipe_sgd import AllReduceModel, MergeAggregate, PipeSGD
from hetpipe_tf.sync.wsp import WSP_SCHEME


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


@pytest.mark.parametrize("seed", range(12))
def test_workers_that_run_as_another_give_the_times_of_running_each(seed):
    rng = random.Random(seed)
    kinds = [(rng.uniform(0.5, 2.0), rng.uniform(0.5, 3.0), rng.choice([0.0, 0.2, 0.7])) for _ in range(2)]
    of = [rng.randrange(2) for _ in range(rng.randint(2, 5))]  # each worker's kind
    stages, nm, steps = rng.randint(1, 3), rng.randint(1, 3), 12
    schedules = [HETPIPE.programs(stages, steps, nm, sync=WSP_SCHEME)] * len(of)

    def duration(agent, ins):
        f, b, _ = kinds[of[agent[0]]]
        return f if isinstance(ins, Forward) else b if isinstance(ins, Backward) else 0.01

    def servers(bound):
        push = lambda agent, ins: kinds[of[agent[0]]][2]  # noqa: E731
        return WSP_SCHEME.simulation_model(bound, push_time=push, pull_time=push)

    bound = rng.choice([0, 1])
    every = simulate_workers(schedules, duration, parameter_servers=servers(bound))
    same_as = [of.index(k) for k in of]
    for hear_all in (True, False):  # WSP's servers wait for every worker: either way is exact
        some = simulate_workers(schedules, duration, parameter_servers=servers(bound), same_as=same_as,
                                servers_hear_every_worker=hear_all)
        assert {a[0] for a in some.agents} == set(same_as)
        for w, r in enumerate(same_as):
            for s in range(stages):
                assert some.completion_times((r, s)) == every.completion_times((w, s))
        assert some.throughput == pytest.approx(every.throughput)


def test_servers_that_count_the_workers_hear_every_one_of_them():
    """Pipe-SGD's all-reduce takes longer with more workers: the workers that do not run must
    still be heard, and then three identical workers run as one exactly."""

    schedules = [hetpipe_schedule(1, 20, 1, sync=PipeSGD(staleness=1))] * 3

    def duration(agent, ins):
        return 1.0 if isinstance(ins, (Forward, Backward)) else 0.0

    def run(**same):
        result = simulate_workers(schedules, duration, parameter_servers=AllReduceModel(lambda a, i, p: 1.5 * p),
                                  **same)
        return result.completion_times((0, 0), MergeAggregate)

    every = run()
    assert run(same_as=[0, 0, 0]) == every
    assert run(same_as=[0, 0, 0], servers_hear_every_worker=False) != every  # an all-reduce of one
