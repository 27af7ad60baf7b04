"""Wave Synchronous Parallel behind the synchronisation seam (§5): the instructions it adds to
a schedule, and the simulated parameter servers (seed 001's example, the bound D)."""
import pytest

from hetpipe_tf.pipeline.hetpipe import hetpipe_schedule
from hetpipe_tf.pipeline.instructions import Backward as _B
from hetpipe_tf.pipeline.instructions import Forward
from hetpipe_tf.pipeline.simulator import simulate_workers
from hetpipe_tf.sync.wsp import (MERGED, PULLED, WSP_SCHEME, MergePulled, ParameterServerModel, PullWeights,
                                 PushUpdate)


def test_wsp_pushes_every_wave_including_a_partial_last_one_and_pulls_only_what_is_merged():
    s = hetpipe_schedule(num_stages=2, steps=10, num_in_flight=3, sync=WSP_SCHEME)
    for program in s.programs:
        ins = [i for stream in program.streams for task in stream for i in task.instructions]
        assert [(i.minibatch, i.wave) for i in ins if isinstance(i, PushUpdate)] == [(3, 0), (6, 1), (9, 2), (10, 3)]
        # wave c gates minibatch (c + 2) * Nm: only waves 0 and 1 have a minibatch (6, 9) to gate
        assert [i.wave for i in ins if isinstance(i, PullWeights)] == [0, 1]
        assert [i.wave for i in ins if isinstance(i, MergePulled)] == [0, 1]
    for program in s.programs:
        assert [(i.minibatch, i.waits) for t in program.streams[0] for i in t.instructions
                if isinstance(i, Forward) and i.waits] == [(6, ((MERGED, 0),)), (9, ((MERGED, 1),))]




def _wsp_run(staleness, speeds=(1.0, 2.5), nm=4, n=24, k=2):
    schedules = [hetpipe_schedule(k, n, nm, sync=WSP_SCHEME) for _ in speeds]

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
    answered = min(t for w, s, key, asked, t in result.pulls if w == 0 and key == (PULLED, 0))
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
    for worker, stage, (_, wave), asked, answered in result.pulls:
        if wave - d >= 0:
            assert answered >= _pushed(result, wave - d) + 0.5 - 1e-9


def test_push_without_parameter_servers_is_an_error():
    with pytest.raises(ValueError, match="talks to parameter servers, but none are simulated"):
        simulate_workers([hetpipe_schedule(1, 4, 2, sync=WSP_SCHEME)], lambda a, i: 1.0)
