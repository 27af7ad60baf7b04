import random

import pytest

from hetpipe_tf.pipeline.hetpipe import hetpipe_schedule
from hetpipe_tf.pipeline.instructions import WEIGHTS, ApplyUpdate, Backward, Forward, ReleaseWeights, StashWeights
from hetpipe_tf.pipeline.schedule import fifo_pick
from hetpipe_tf.pipeline.simulator import simulate


def _durations(k, seed):
    rng = random.Random(seed)
    f = [rng.uniform(0.5, 2.0) for _ in range(k)]
    b = [rng.uniform(0.5, 3.0) for _ in range(k)]

    def duration(stage, ins):
        if isinstance(ins, Forward):
            return f[stage]
        if isinstance(ins, Backward):
            return b[stage]
        return 0.01 if isinstance(ins, ApplyUpdate) else 0.0
    return duration


def test_programs_follow_section_4():
    s = hetpipe_schedule(num_stages=3, steps=10, num_in_flight=4)
    assert [len(p.streams) for p in s.programs] == [2, 2, 1]
    assert all(p.prologue == tuple(StashWeights(i) for i in (1, 2, 3, 4)) for p in s.programs)
    last = s.programs[2].streams[0]
    assert last.kind == "forward_backward"  # §4: the last stage's forward and backward are one task
    assert repr(last[0]) == ("[RecvActivation(1) RecvLabels(1) Forward(1) Backward(1) "
                             "SendGradient(1, to=1) ReleaseWeights(1) ApplyUpdate(1) StashWeights(5)]")
    backward = s.programs[1].streams[1]
    assert repr(backward[5]) == ("[RecvGradient(6) Backward(6) SendGradient(6, to=0) ReleaseWeights(6) "
                                 "ApplyUpdate(6) StashWeights(10)]")
    assert not any(isinstance(i, StashWeights) for i in backward[6].instructions)  # 11 > N
    assert s.programs[0].streams[0][2].requires == ((WEIGHTS, 3),)
    text = s.format(2)
    assert "FIFO merge" in text and "stage 2" in text and "in order" in text


def test_model_inputs_of_later_stages_are_routed_by_minibatch_id():
    s = hetpipe_schedule(3, 4, 2, input_stages=(0, 2))
    load = s.programs[0].streams[0][1].instructions[0]
    assert repr(load) == "LoadMinibatch(2)" and load.inputs_to == (2,) and load.labels_to == 2
    assert [repr(i) for i in s.programs[2].streams[0][1].instructions[:3]] == \
        ["RecvInputs(2)", "RecvActivation(2)", "RecvLabels(2)"]


def test_bad_arguments_are_refused():
    for kwargs, match in [(dict(num_stages=0), "num_stages"), (dict(num_in_flight=0), "Nm"),
                          (dict(steps=-1), "steps"),
                          (dict(input_stages=(1,)), "input_stages")]:
        args = dict(num_stages=2, steps=4, num_in_flight=2) | kwargs
        with pytest.raises(ValueError, match=match):
            hetpipe_schedule(**args)


def test_activation_window_follows_stage_position():
    s = hetpipe_schedule(num_stages=4, steps=8, num_in_flight=3)
    # k - q = 4, 3, 2 against Nm = 3: only stage 2 needs a window tighter than Nm.
    windows = [s.programs[q].streams[0][4].instructions[-2].window for q in range(3)]
    assert windows == [0, 0, 2]
    assert s.programs[2].streams[0][4].requires == (("activation", 5), ("weights", 5), ("activation slot", 5))


def test_fifo_pick_takes_first_ready_then_older_minibatch():
    assert fifo_pick([(2.0, 3, 0), (1.5, 7, 1)]) == (1.5, 7, 1)
    assert fifo_pick([(2.0, 5, 0), (2.0, 3, 1)]) == (2.0, 3, 1)


@pytest.mark.parametrize("k,nm,seed", [(1, 1, 0), (1, 3, 1), (2, 1, 2), (2, 2, 3), (3, 2, 4),
                                       (4, 4, 5), (4, 7, 6), (5, 3, 7), (6, 1, 8), (3, 5, 9)])
def test_simulated_runs_keep_the_rules_of_section_4(k, nm, seed):
    n = 30
    sched = hetpipe_schedule(k, n, nm)
    result = simulate(sched, _durations(k, seed), transfer=lambda a, b, i: 0.05)
    spans = result.spans
    for s in range(k):
        order = result.task_order[s]
        assert len(order) == (n if s == k - 1 else 2 * n)
        # Rules 1 and 2: forwards in minibatch order, backwards in minibatch order.
        fwd = [p for kind, p in order if kind != "backward"]
        bwd = [p for kind, p in order if kind != "forward"]
        assert fwd == sorted(fwd) == list(range(1, n + 1))
        assert bwd == sorted(bwd) == list(range(1, n + 1))
        mine = [sp for sp in spans if sp.stage == s]
        start = {sp.instruction.minibatch: sp.start for sp in mine if isinstance(sp.instruction, Forward)}
        applied = {sp.instruction.minibatch: sp.end for sp in mine if isinstance(sp.instruction, ApplyUpdate)}
        for p in range(nm + 1, n + 1):
            assert start[p] >= applied[p - nm]  # w_p needs update p - Nm
        live, most = 0, 0
        for sp in sorted(mine, key=lambda sp: sp.start):
            if isinstance(sp.instruction, StashWeights):
                live += 1
            elif isinstance(sp.instruction, ReleaseWeights):
                live -= 1
            most = max(most, live)
        assert most == min(nm, n) and live == 0
        # Activations held: forward done, backward not yet (the last stage fuses them).
        held, most_held = 0, 0
        for sp in sorted(mine, key=lambda sp: (sp.start, isinstance(sp.instruction, Forward))):
            if isinstance(sp.instruction, Backward):
                held -= 1
            elif isinstance(sp.instruction, Forward):
                held += 1
                most_held = max(most_held, held)
        assert most_held <= min(nm, k - s)
    # Minibatch p starts (stage 0) only once update p - Nm is applied on every stage.
    first = {sp.instruction.minibatch: sp.start for sp in spans
             if sp.stage == 0 and isinstance(sp.instruction, Forward)}
    for p in range(nm + 1, n + 1):
        done = max(sp.end for sp in spans if isinstance(sp.instruction, ApplyUpdate)
                   and sp.instruction.minibatch == p - nm)
        assert first[p] >= done


def test_nm_1_is_naive_model_parallelism():
    k = 4
    result = simulate(hetpipe_schedule(k, 12, 1), _durations(k, 3))
    compute = sorted((sp.start, sp.end) for sp in result.spans if isinstance(sp.instruction, (Forward, Backward)))
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(compute, compute[1:]))  # one device computes at a time


def test_pipelining_balanced_stages_approaches_k_times_naive():
    def duration(stage, ins):
        return {Forward: 1.0, Backward: 2.0}.get(type(ins), 0.0)

    naive = simulate(hetpipe_schedule(4, 200, 1), duration).throughput
    piped = simulate(hetpipe_schedule(4, 200, 4), duration).throughput
    assert piped / naive > 3.8
    assert piped == pytest.approx(1 / 3.0, rel=0.05)  # one minibatch per slowest stage's f + b
