"""Random runs of a schedule in the simulator (hypothesis), and the rules of HetPipe's schedule
(§4) that a stage's run keeps, read back from the simulator's spans (tests/pipeline/test_schedule_properties.py
says them). Task times are drawn as quarters (frequent ties) or as any float; compute times are
positive, so a message always arrives after its sender started."""
from dataclasses import dataclass

from hypothesis import note
from hypothesis import strategies as st

from hetpipe_tf.pipeline.hetpipe import HETPIPE
from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, Forward, LoadMinibatch, Recompute, ReleaseWeights, SendActivation, SendGradient,
    StashWeights)
from hetpipe_tf.pipeline.schedule import get_schedule
from hetpipe_tf.pipeline.simulator import simulate

QUARTERS = st.integers(1, 16).map(lambda i: i / 4)
TIMES = st.one_of(QUARTERS, st.floats(0.01, 4.0, allow_nan=False, allow_infinity=False))
SMALL = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0, allow_nan=False))


@dataclass(frozen=True)
class Run:
    """One drawn case: k stages, Nm in flight, n minibatches, per-stage times, link delays."""
    k: int
    nm: int
    n: int
    forward: tuple
    backward: tuple
    apply: tuple
    links: tuple  # delay of activations and gradients between stage q and q + 1
    labels: float  # delay of the labels from stage 0 to the last stage

    def duration(self, stage, ins):
        if isinstance(ins, Forward):
            return self.forward[stage]
        if isinstance(ins, Backward):
            return self.backward[stage]
        if isinstance(ins, ApplyUpdate):
            return self.apply[stage]
        return 0.0

    def transfer(self, src, dst, ins):
        if isinstance(ins, (SendActivation, SendGradient)):
            return self.links[min(src, dst)]
        assert isinstance(ins, LoadMinibatch), ins
        return self.labels


@st.composite
def runs(draw):
    k = draw(st.integers(1, 5))
    per_stage = dict(min_size=k, max_size=k)
    return Run(k=k, nm=draw(st.integers(1, 6)), n=draw(st.integers(1, 20)),
               forward=tuple(draw(st.lists(TIMES, **per_stage))), backward=tuple(draw(st.lists(TIMES, **per_stage))),
               apply=tuple(draw(st.lists(SMALL, **per_stage))),
               links=tuple(draw(st.lists(SMALL, min_size=k - 1, max_size=k - 1))), labels=draw(SMALL))


def simulate_schedule(name, run, snapshots=()):
    """Runs the registered schedule `name` on `run` in the simulator (a recomputation takes a
    forward pass's time); returns the schedule and {stage: its spans in the order they ran}."""
    schedule = get_schedule(name)
    programs = schedule.programs(run.k, run.n, run.nm, snapshot_after=snapshots)
    note(programs.format(8))

    def duration(stage, ins):
        return run.duration(stage, Forward(0) if isinstance(ins, Recompute) else ins)

    result = simulate(programs, duration, run.transfer)
    return schedule, {q: sorted((s for s in result.spans if s.stage == q), key=lambda s: (s.start, s.end))
                      for q in range(run.k)}


def check_stage(run, stage, spans):
    """Exactly once, rules 1 and 2 on the stage, weight stashing, versions, in flight, activations."""
    n, nm, k = run.n, run.nm, run.k
    minibatches = list(range(1, n + 1))
    for kind in (Forward, Backward, ApplyUpdate, ReleaseWeights):
        order = [sp.instruction.minibatch for sp in spans if type(sp.instruction) is kind]
        assert order == minibatches, f"stage {stage}: {kind.__name__} ran for {order}"  # once each, in order
    stashed = [sp.instruction.minibatch for sp in spans if isinstance(sp.instruction, StashWeights)]
    assert stashed == minibatches, f"stage {stage}: stashed {stashed}"
    applied, live, in_flight, held = set(), set(), set(), set()
    most_live = most_held = 0
    for sp in spans:  # in run order
        ins, p = sp.instruction, sp.instruction.minibatch
        if isinstance(ins, StashWeights):
            assert applied == set(range(1, p - nm + 1)), (  # w_p holds the local updates 1..p-Nm
                f"stage {stage}: w_{p} stashed after the updates {sorted(applied)}")
            live.add(p)
        elif isinstance(ins, ReleaseWeights):
            live.remove(p)
        elif isinstance(ins, Forward):
            assert p in live, f"stage {stage}: Forward({p}) without w_{p}"
            in_flight.add(p)
            held.add(p)
            assert len(in_flight) <= nm, f"stage {stage}: minibatches {sorted(in_flight)} in flight, Nm={nm}"
        elif isinstance(ins, Backward):
            assert p in live and p in held, f"stage {stage}: Backward({p}) without w_{p} or its forward"
            held.remove(p)
        elif isinstance(ins, ApplyUpdate):
            in_flight.remove(p)
            applied.add(p)
        most_live, most_held = max(most_live, len(live)), max(most_held, len(held))
    assert most_live <= nm and most_live == min(nm, n) and not live, (
        f"stage {stage}: at most {most_live} weight versions live, {sorted(live)} left at the end, Nm={nm}")
    assert most_live <= HETPIPE.weight_versions(nm)
    assert most_held <= min(nm, k - stage) and most_held <= HETPIPE.activations_held(stage, k, nm), (
        f"stage {stage}: activations of {most_held} minibatches held, min(Nm, k - q) = {min(nm, k - stage)}")


def check_across_stages(run, result):
    """A minibatch's forward on q + 1 after its forward on q; its backward on q after its
    backward on q + 1 and after its own forward on q."""
    def times(kind):
        return {(sp.stage, sp.instruction.minibatch): sp for sp in result.spans if type(sp.instruction) is kind}

    fwd, bwd = times(Forward), times(Backward)
    for p in range(1, run.n + 1):
        for q in range(run.k):
            assert bwd[(q, p)].start >= fwd[(q, p)].end, f"Backward({p}) on stage {q} before its forward"
            if q + 1 < run.k:
                assert fwd[(q + 1, p)].start >= fwd[(q, p)].end, f"Forward({p}) on stage {q + 1} before stage {q}"
                assert bwd[(q, p)].start >= bwd[(q + 1, p)].end, f"Backward({p}) on stage {q} before stage {q + 1}"
