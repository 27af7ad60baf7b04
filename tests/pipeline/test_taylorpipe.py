"""TaylorPipe's schedules (seed 003) in the simulator, and what the planner charges for them:
random k, Nm, run length and task times (hypothesis), read back from the simulator's spans.

* "taylorpipe": no deadlock; every minibatch forwarded, backwarded and applied once per stage;
  1F1B after admitting min(Nm, 2(k - q) - 1) (Figure 2); the local model stashed right before
  each forward pass; versions and activations within the schedule's own numbers;
* both ("taylorpipe", "hetpipe-taylor"): exactly one CompensateGradient(p) per stage, after
  Backward(p) and before ReleaseWeights(p) and ApplyUpdate(p), carrying λ;
* "hetpipe-taylor" keeps every rule of HetPipe's schedule (§4), and with WSP between two
  workers the simulation finishes.
"""
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, CompensateGradient, Forward, ReleaseWeights, StashWeights)
from hetpipe_tf.pipeline.pipedream import one_f_one_b
from hetpipe_tf.pipeline.schedule import check_combination, combinations, get_schedule
from hetpipe_tf.pipeline.simulator import simulate, simulate_workers
from hetpipe_tf.pipeline.taylorpipe import DEFAULT_VARIANCE_CONTROL, HetPipeTaylorSchedule, TaylorPipeSchedule
from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.planning.cost_model import CostModel, LinkModel
from hetpipe_tf.planning.planner import plan
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.sync.wsp import WSP_SCHEME, ParameterServerModel
from tests.helpers.schedule_runs import check_across_stages, check_stage, runs, simulate_schedule
from tests.helpers.profiles import toy_profile

TAYLOR = ("taylorpipe", "hetpipe-taylor")


def _check_compensation(stage, spans, n, variance_control):
    """One CompensateGradient(p) per minibatch, between Backward(p) and ReleaseWeights(p), ApplyUpdate(p)."""
    at = {}
    for i, sp in enumerate(spans):
        at.setdefault((type(sp.instruction), sp.instruction.minibatch), []).append(i)
    for p in range(1, n + 1):
        [c] = at[(CompensateGradient, p)]
        [b], [r], [a] = at[(Backward, p)], at[(ReleaseWeights, p)], at[(ApplyUpdate, p)]
        assert b < c < r and c < a, (
            f"stage {stage}: CompensateGradient({p}) at {c}, Backward({p}) at {b}, release at {r}, apply at {a}")
        assert spans[c].instruction.variance_control == variance_control


@settings(max_examples=60, deadline=None)
@given(run=runs())
def test_taylorpipe_runs_1f1b_with_the_seeds_replicas_and_compensates_before_every_update(run):
    schedule, spans = simulate_schedule("taylorpipe", run)
    for q, stage in spans.items():
        for kind in (Forward, Backward):
            assert sorted(s.instruction.minibatch for s in stage if type(s.instruction) is kind) == \
                list(range(1, run.n + 1)), (q, kind)
        assert sorted(p for s in stage for p in s.instruction.applies()) == list(range(1, run.n + 1)), q
        passes = [("backward" if isinstance(s.instruction, Backward) else "forward", s.instruction.minibatch)
                  for s in stage if type(s.instruction) in (Forward, Backward)]
        admitted = min(run.nm, 2 * (run.k - q) - 1)
        assert schedule.admitted(q, run.k, run.nm) == max(1, admitted)
        if q < run.k - 1:
            assert passes == [one_f_one_b(admitted, run.n, i) for i in range(1, 2 * run.n + 1)]
        versions, held, most_versions, most_held = set(), set(), 0, 0
        for i, s in enumerate(stage):
            ins = s.instruction
            if isinstance(ins, StashWeights):  # the master, right before the forward pass that uses it
                assert type(stage[i + 1].instruction) is Forward and stage[i + 1].instruction.minibatch == ins.minibatch
                versions.add(ins.minibatch)
            elif isinstance(ins, ReleaseWeights):
                versions.remove(ins.minibatch)
            elif isinstance(ins, Forward):
                held.add(ins.minibatch)
            elif isinstance(ins, Backward):
                held.remove(ins.minibatch)
            most_versions, most_held = max(most_versions, len(versions)), max(most_held, len(held))
        assert most_versions <= schedule.weight_versions(run.nm)
        assert most_held <= schedule.activations_held(q, run.k, run.nm)
        assert not versions and not held
        _check_compensation(q, stage, run.n, DEFAULT_VARIANCE_CONTROL)


@settings(max_examples=60, deadline=None)
@given(run=runs())
def test_hetpipe_taylor_keeps_the_rules_of_section_4_and_compensates_before_every_update(run):
    programs = get_schedule("hetpipe-taylor").programs(run.k, run.n, run.nm)
    note(programs.format(3))
    result = simulate(programs, run.duration, transfer=run.transfer)  # raises ScheduleDeadlock if stuck
    for q in range(run.k):
        stage = [sp for sp in result.spans if sp.stage == q]
        check_stage(run, q, stage)
        _check_compensation(q, stage, run.n, DEFAULT_VARIANCE_CONTROL)
    check_across_stages(run, result)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(TAYLOR), k=st.integers(1, 4), nm=st.integers(1, 4), n=st.integers(1, 14),
       staleness=st.integers(0, 2), slow=st.floats(1.0, 3.0))
def test_two_workers_under_wsp_finish_and_compensate_every_update(name, k, nm, n, staleness, slow):
    schedule = get_schedule(name)
    programs = [schedule.programs(k, n, nm, sync=WSP_SCHEME) for _ in range(2)]
    servers = ParameterServerModel(staleness, push_time=lambda a, i: 0.5, pull_time=lambda a, i: 0.5)

    def duration(agent, ins):
        return (slow if agent[0] else 1.0) * (2.0 if isinstance(ins, Backward) else 1.0)

    result = simulate_workers(programs, duration, parameter_servers=servers)  # raises ScheduleDeadlock if stuck
    for worker in range(2):
        for q in range(k):
            stage = [sp for sp in result.spans if sp.stage == (worker, q)]
            _check_compensation(q, stage, n, DEFAULT_VARIANCE_CONTROL)


def test_the_instruction_prints_like_a_call_and_lambda_is_the_seeds_unless_given():
    assert repr(CompensateGradient(3, variance_control=2.0)) == "CompensateGradient(3, variance_control=2)"
    assert DEFAULT_VARIANCE_CONTROL == 2.0  # seed 003, Appendix A, Tables A1-A3
    assert get_schedule("taylorpipe").variance_control == get_schedule("hetpipe-taylor").variance_control == 2.0
    mine = TaylorPipeSchedule(variance_control=0.5)
    task = mine.programs(2, 3, 2).programs[1].streams[0][0]
    assert CompensateGradient(1, variance_control=0.5) in task.instructions
    assert CompensateGradient in mine.instructions and CompensateGradient in HetPipeTaylorSchedule().instructions


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "two", None])
def test_a_lambda_that_is_not_a_finite_number_at_least_0_is_refused_saying_what_is_allowed(bad):
    for cls in (TaylorPipeSchedule, HetPipeTaylorSchedule):
        with pytest.raises(ValueError, match=r"finite number >= 0, got .*TaylorPipe uses 2"):
            cls(variance_control=bad)


def _charged(name):
    """What the cost model charges each of two stages (Nm = 3) under the schedule `name`."""
    cluster = load_cluster("local")
    f0, _, s0, _ = cluster.devices()
    model = CostModel(toy_profile(), cluster, links=LinkModel(intra_scale=1.0), schedule=get_schedule(name))
    return [stage.memory for stage in model.stages((0, 2), [f0, s0], num_in_flight=3)]


def test_the_planner_charges_the_seeds_replicas_for_taylorpipe_and_hetpipes_memory_for_hetpipe_taylor():
    taylor, pipedream = _charged("taylorpipe"), _charged("pipedream")
    # The first of two stages keeps 2·2 - 1 = 3 minibatches' activations (Figure 2), PipeDream's
    # min(Nm, k) = 2; versions (Nm) and the last stage's memory are the same.
    assert taylor[0]["activations"] == 3 * pipedream[0]["activations"] / 2
    assert taylor[0]["weights and versions"] == pipedream[0]["weights and versions"]
    assert taylor[1] == pipedream[1]
    assert _charged("hetpipe-taylor") == _charged("hetpipe")


@pytest.mark.parametrize("name,plain", [("taylorpipe", "pipedream"), ("hetpipe-taylor", "hetpipe")])
def test_the_planner_charges_each_compensation_an_updates_time(name, plain):
    # Nm = 2 on two stages: TaylorPipe's order is PipeDream's, HetPipe-Taylor's HetPipe's; only
    # the compensation before every update (an update's time each) makes them slower.
    taylor, uncompensated = (plan(toy_profile(), load_cluster("local"),
                                  PlanRequest(policy="ed", num_in_flight=2, schedule=get_schedule(s)))
                             for s in (name, plain))
    assert get_schedule(name).apply_like == {CompensateGradient}
    assert taylor.minibatches_per_s < uncompensated.minibatches_per_s


def test_both_work_with_wsp_and_alone():
    for name in TAYLOR:
        assert (name, "wsp") in combinations() and (name, "none") in combinations()
        assert check_combination(name, "wsp") == (get_schedule(name), WSP_SCHEME)
