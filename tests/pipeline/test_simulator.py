import pytest

from hetpipe_tf.pipeline.instructions import Forward, RecvActivation, SendActivation, Task, TaskStream
from hetpipe_tf.pipeline.schedule import Schedule, StageProgram, hetpipe_schedule
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


from hetpipe_tf.pipeline.instructions import Backward as _B, PullWeights, PushUpdate
from hetpipe_tf.pipeline.simulator import ParameterServerModel, simulate_workers


def _wsp_run(staleness, speeds=(1.0, 2.5), nm=4, n=24, k=2):
    schedules = [hetpipe_schedule(k, n, nm, wsp=True) for _ in speeds]

    def duration(agent, ins):
        slow = speeds[agent[0]]
        return {Forward: 1.0 * slow, _B: 2.0 * slow}.get(type(ins), 0.0)

    ps = ParameterServerModel(staleness, push_time=lambda a, i: 0.5, pull_time=lambda a, i: 0.5)
    return simulate_workers(schedules, duration, parameter_servers=ps)


def _starts(result, worker, stage, kind):
    return {s.instruction.minibatch: s.start for s in result.spans
            if s.stage == (worker, stage) and isinstance(s.instruction, kind)}


def _pushed(result, wave):
    """When every stage of every worker had pushed `wave` (arrival at the servers)."""
    return max(s.end + 0.5 for s in result.spans if isinstance(s.instruction, PushUpdate) and s.instruction.wave == wave)


def test_wsp_d0_minibatch_c_plus_2_waits_for_every_workers_wave_c():
    # Seed 001, D = 0, s_local = 3: minibatch 8 waits for wave 0 of every worker, 12 for wave 1.
    result = _wsp_run(staleness=0)
    for worker in (0, 1):
        forward = _starts(result, worker, 0, Forward)
        for c in range(4):
            assert forward[(c + 2) * 4] >= _pushed(result, c) + 0.5  # + the pull's transfer
    # The fast worker keeps minibatches 5..7 in its pipeline while it waits for wave 0.
    fast = _starts(result, 0, 0, Forward)
    answered = min(t for w, s, wave, asked, t in result.pulls if w == 0 and wave == 0)
    assert [p for p in (5, 6, 7) if fast[p] < answered] == [5, 6, 7]
    waits = result.wait_and_idle(0)
    assert waits and all(idle <= wait + 1e-9 for wait, idle in waits)


def test_wsp_larger_staleness_bound_waits_less():
    wait = {d: sum(w for w, _ in _wsp_run(d).wait_and_idle(0)) for d in (0, 1, 4)}
    assert wait[0] > wait[1] >= wait[4]
    assert _wsp_run(4).throughput >= _wsp_run(0).throughput


@pytest.mark.parametrize("d", [0, 1, 3])
def test_wsp_pull_of_clock_c_answered_only_after_wave_c_minus_d(d):
    result = _wsp_run(d, speeds=(1.0, 1.7, 3.0), nm=3, n=30, k=3)
    for worker, stage, wave, asked, answered in result.pulls:
        if wave - d >= 0:
            assert answered >= _pushed(result, wave - d) + 0.5 - 1e-9


def test_push_without_parameter_servers_is_an_error():
    with pytest.raises(ValueError, match="talks to parameter servers, but none are simulated"):
        simulate_workers([hetpipe_schedule(1, 4, 2, wsp=True)], lambda a, i: 1.0)
