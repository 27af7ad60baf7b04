"""The classic schedules (GPipe, PipeDream, NaivePipe) in the simulator, and what the planner
charges for them: random k, Nm, run length and task times (hypothesis), read back from the
simulator's spans per stage.

* no deadlock; every minibatch forwarded and backwarded once per stage, its update applied once;
* weight versions held at once <= the schedule's ``weight_versions(Nm)``, activations (taped
  passes not yet backwarded) <= ``activations_held(q, k, Nm)``;
* GPipe: no update between a microbatch's forward and backward passes, one update per
  minibatch of at most Nm microbatches, a flush at every snapshot;
* PipeDream: stage q runs 1F1B after admitting min(Nm, k - q); weight stashing stashes right
  before each forward pass; vertical sync stashes w_{p+Nm} after update p;
* NaivePipe: no version at all, and every backward pass of a stage but the last recomputes.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe_tf.pipeline.gpipe import microbatch_groups
from hetpipe_tf.pipeline.instructions import (
    AccumulateGradient, Backward, Forward, Recompute, ReleaseWeights, StashWeights)
from hetpipe_tf.pipeline.pipedream import one_f_one_b
from hetpipe_tf.pipeline.schedule import WorkerUpdate, check_combination, combinations, get_schedule
from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.planning.cost_model import CostModel, LinkModel
from hetpipe_tf.sync.wsp import WSP_SCHEME
from tests.helpers.schedule_runs import runs, simulate_schedule
from tests.helpers.profiles import toy_profile

CLASSIC = ("gpipe", "gpipe-recompute", "pipedream", "pipedream-vsync", "naivepipe")


@settings(max_examples=60, deadline=None)
@given(run=runs(), name=st.sampled_from(CLASSIC), snapshot=st.integers(1, 20))
def test_every_minibatch_once_and_what_a_stage_holds_within_the_schedules_numbers(run, name, snapshot):
    schedule, spans = simulate_schedule(name, run, snapshots=(snapshot,))
    for q, stage in spans.items():
        for kind in (Forward, Backward):
            assert sorted(s.instruction.minibatch for s in stage if type(s.instruction) is kind) == \
                list(range(1, run.n + 1)), (q, kind)
        assert sorted(p for s in stage for p in s.instruction.applies()) == list(range(1, run.n + 1)), q
        versions, held, taped = set(), set(), 0
        for s in stage:
            ins = s.instruction
            if isinstance(ins, StashWeights):
                versions.add(ins.minibatch)
            elif isinstance(ins, ReleaseWeights):
                versions.remove(ins.minibatch)
            elif isinstance(ins, Forward) and not ins.recompute or isinstance(ins, Recompute):
                held.add(ins.minibatch)
            elif isinstance(ins, Backward):
                held.remove(ins.minibatch)
            taped = max(taped, len(held))
            assert len(versions) <= schedule.weight_versions(run.nm), (q, ins)
        assert taped <= schedule.activations_held(q, run.k, run.nm), q
        assert not versions and not held


@settings(max_examples=40, deadline=None)
@given(run=runs(), recompute=st.booleans(), snapshot=st.integers(1, 20))
def test_gpipe_applies_one_update_per_minibatch_and_none_inside_one(run, recompute, snapshot):
    groups = microbatch_groups(run.n, run.nm, (snapshot,))
    assert all(b - a < run.nm for a, b in groups) and (snapshot >= run.n or any(b == snapshot for _, b in groups))
    _, spans = simulate_schedule("gpipe-recompute" if recompute else "gpipe", run, snapshots=(snapshot,))
    for q, stage in spans.items():
        flushes = [s.instruction for s in stage if s.instruction.applies()]
        assert [(ins.first, ins.minibatch) for ins in flushes] == groups
        forward_at = {s.instruction.minibatch: s.end for s in stage if type(s.instruction) is Forward}
        for s in stage:
            if isinstance(s.instruction, Backward):  # no flush between a microbatch's passes
                p = s.instruction.minibatch
                assert not [f for f in stage if f.instruction.applies() and forward_at[p] <= f.start < s.start]
        recomputed = {s.instruction.minibatch for s in stage if isinstance(s.instruction, Recompute)}
        assert recomputed == (set(range(1, run.n + 1)) if recompute and q < run.k - 1 else set())
        assert sum(isinstance(s.instruction, AccumulateGradient) for s in stage) == run.n


@settings(max_examples=40, deadline=None)
@given(run=runs(), name=st.sampled_from(["pipedream", "pipedream-vsync", "naivepipe"]))
def test_pipedream_and_naivepipe_run_1f1b_with_their_own_weights(run, name):
    _, spans = simulate_schedule(name, run)
    for q, stage in spans.items():
        passes = [("backward" if isinstance(s.instruction, Backward) else "forward", s.instruction.minibatch)
                  for s in stage if type(s.instruction) in (Forward, Backward)]
        if q < run.k - 1:
            assert passes == [one_f_one_b(min(run.nm, run.k - q), run.n, i) for i in range(1, 2 * run.n + 1)]
        stashes = [(i, s.instruction.minibatch) for i, s in enumerate(stage) if isinstance(s.instruction, StashWeights)]
        if name == "naivepipe":
            assert not stashes
        elif name == "pipedream":  # the live weights, right before the forward pass that uses them
            assert all(type(stage[i + 1].instruction) is Forward and stage[i + 1].instruction.minibatch == p
                       for i, p in stashes)
        else:  # w_{p+Nm} right after update p: every stage uses updates 1..p-Nm for minibatch p
            after = {p: i for i, s in enumerate(stage) for p in s.instruction.applies()}
            assert all(i == after[p - run.nm] + 1 for i, p in stashes if p > run.nm)


@pytest.mark.parametrize("name", CLASSIC + ("hetpipe",))
def test_the_planner_charges_each_schedules_own_memory(name):
    schedule = get_schedule(name)
    cluster = load_cluster("local")
    f0, _, s0, _ = cluster.devices()
    model = CostModel(toy_profile(), cluster, links=LinkModel(intra_scale=1.0), schedule=schedule)
    first, last = model.stages((0, 2), [f0, s0], num_in_flight=3)
    assert first.memory["weights and versions"] == 200 * (1 + schedule.weight_versions(3))
    assert first.memory["activations"] == schedule.activations_held(0, 2, 3) * 2000
    assert last.memory["activations"] == schedule.activations_held(1, 2, 3) * (500 + 2000)
    expected = {"gpipe": (3, 0), "gpipe-recompute": (1, 0), "pipedream": (2, 3), "pipedream-vsync": (2, 3),
                "naivepipe": (1, 0), "hetpipe": (2, 3)}[name]
    assert (schedule.activations_held(0, 2, 3), schedule.weight_versions(3)) == expected


def test_every_classic_schedule_works_with_wsp_and_alone():
    for name in CLASSIC:
        assert (name, "wsp") in combinations() and (name, "none") in combinations()
        assert check_combination(name, "wsp") == (get_schedule(name), WSP_SCHEME)


@pytest.mark.parametrize("name", ["gpipe", "pipedream", "naivepipe"])
def test_a_schedule_that_cannot_wait_for_update_terms_refuses_them(name):
    with pytest.raises(ValueError, match=f"the schedule '{name}' cannot wait for; the schedules that can: .*hetpipe"):
        get_schedule(name).programs(2, 4, 2, worker_update=WorkerUpdate(waiting=(1,)))
