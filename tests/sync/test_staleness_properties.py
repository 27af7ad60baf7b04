"""Property tests of Wave Synchronous Parallel's staleness bounds (§4, §5) in the simulator.

Pure Python (hypothesis). 2..4 virtual workers of k stages each run HetPipe's schedule
with WSP (:data:`hetpipe_tf.sync.wsp.WSP_SCHEME`) in :func:`simulate_workers`, the
servers played by :class:`hetpipe_tf.sync.wsp.ParameterServerModel`, with random worker
speeds (and random slow waves), Nm, D, push and pull times. From the simulated run each
minibatch's weight version is read back as the runtime records it with
``record_provenance=True``:

* local: the stage's own updates applied before w_p was stashed;
* global: the (worker, wave) pushes the servers held when they answered each pull whose
  merge changed w_p (merge c changes the versions of minibatches >= (c+2)·Nm, §5);

and :func:`hetpipe_tf.sync.staleness.check` asserts the local bound (updates 1..p-Nm) and
the global bound (s_global = (D+1)(s_local+1) + s_local - 1). Besides:

* no deadlock, every minibatch of every worker trained, every wave pushed once per stage;
* a merge never changes a version a forward pass already used;
* WSP's clock rule: a worker starts minibatch (c+2)·Nm, the first that needs the pull at the
  end of its clock c, only when its clock (c+1) is at most D ahead of the global clock (the
  slowest stage of the slowest worker); so, counting pushed full waves, no worker is ever more
  than D+1 clocks ahead of the slowest (it may push the wave it is in before the slowest
  pushes its next).
"""
from dataclasses import dataclass

from hypothesis import given, note, settings
from hypothesis import strategies as st

from hetpipe_tf.pipeline.hetpipe import hetpipe_schedule
from hetpipe_tf.pipeline.instructions import ApplyUpdate, Backward, Forward, StashWeights
from hetpipe_tf.pipeline.simulator import simulate_workers
from hetpipe_tf.sync.staleness import check
from hetpipe_tf.sync.wsp import PULLED, WSP_SCHEME, MergePulled, ParameterServerModel, PushUpdate

EPS = 1e-9
SPEEDS = st.one_of(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), st.floats(0.25, 4.0, allow_nan=False))
TIMES = st.one_of(st.integers(1, 8).map(lambda i: i / 4), st.floats(0.05, 2.0, allow_nan=False))
TRANSFERS = st.sampled_from([0.0, 0.1, 0.5, 2.0])


@dataclass(frozen=True)
class Cluster:
    """One drawn case: workers of k stages, Nm, D, n minibatches per worker and the times."""
    k: int
    nm: int
    d: int
    n: int
    speeds: tuple  # per worker: a factor on every compute time
    slow_waves: tuple  # per worker: a factor per wave (transient stragglers)
    forward: tuple  # per stage
    backward: tuple
    apply: float
    push: tuple  # per worker: a push's transfer to the servers
    pull: tuple  # per worker: a pull's transfer from the servers

    @property
    def workers(self):
        return len(self.speeds)

    def duration(self, agent, ins):
        w, s = agent
        factor = self.speeds[w] * self.slow_waves[w][(ins.minibatch - 1) // self.nm]
        if isinstance(ins, Forward):
            return factor * self.forward[s]
        if isinstance(ins, Backward):
            return factor * self.backward[s]
        if isinstance(ins, (ApplyUpdate, MergePulled)):
            return self.apply
        return 0.0


@st.composite
def clusters(draw):
    workers, k, nm, d = draw(st.integers(2, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(0, 4))
    n = draw(st.integers(1, min(36, (d + 4) * nm)))  # long enough for the global bound to bind
    waves = (n - 1) // nm + 1
    per_worker = dict(min_size=workers, max_size=workers)
    return Cluster(
        k=k, nm=nm, d=d, n=n, speeds=tuple(draw(st.lists(SPEEDS, **per_worker))),
        slow_waves=tuple(tuple(draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 4.0]), min_size=waves, max_size=waves)))
                         for _ in range(workers)),
        forward=tuple(draw(st.lists(TIMES, min_size=k, max_size=k))),
        backward=tuple(draw(st.lists(TIMES, min_size=k, max_size=k))), apply=draw(st.sampled_from([0.0, 0.05, 0.3])),
        push=tuple(draw(st.lists(TRANSFERS, **per_worker))), pull=tuple(draw(st.lists(TRANSFERS, **per_worker))))


def _run(c):
    schedules = [hetpipe_schedule(c.k, c.n, c.nm, sync=WSP_SCHEME) for _ in range(c.workers)]
    servers = ParameterServerModel(c.d, push_time=lambda agent, ins: c.push[agent[0]],
                                   pull_time=lambda agent, ins: c.pull[agent[0]])
    return simulate_workers(schedules, c.duration, parameter_servers=servers)  # raises ScheduleDeadlock if stuck


def _pushes(c, result):
    """(worker, stage, wave) -> when that push reached the servers."""
    out = {}
    for sp in result.spans:
        if isinstance(sp.instruction, PushUpdate):
            w, s = sp.stage
            assert (w, s, sp.instruction.wave) not in out, f"worker {w} stage {s} pushed wave {sp.instruction.wave} twice"
            out[(w, s, sp.instruction.wave)] = sp.end + c.push[w]
    return out


def _provenance(c, result, pushes, stage):
    """{(worker, minibatch): (local updates, {(worker, wave)})} of `stage`'s weight versions, as
    :meth:`hetpipe_tf.runtime.wsp_runner.WSPRunner.provenance` records them in a real run."""
    answered = {(w, s, key[1]): arrival - c.pull[w] for w, s, key, asked, arrival in result.pulls}
    records = {}
    for w in range(c.workers):
        spans = [sp for sp in result.spans if sp.stage == (w, stage)]  # in run order
        merges = [(sp.instruction.wave, sp.end,
                   frozenset((other, wave) for (other, s, wave), t in pushes.items()
                             if s == stage and t <= answered[(w, stage, sp.instruction.wave)] + EPS))
                  for sp in spans if isinstance(sp.instruction, MergePulled)]
        applied, local = set(), {}
        for sp in spans:
            ins = sp.instruction
            if isinstance(ins, ApplyUpdate):
                applied.add(ins.minibatch)
            elif isinstance(ins, StashWeights):
                local[ins.minibatch] = frozenset(applied)
            elif isinstance(ins, Forward):
                p, pulled = ins.minibatch, set()
                for wave, end, held in merges:
                    if p >= (wave + 2) * c.nm:  # merge c changes the versions of (c+2)·Nm onwards ...
                        assert end <= sp.start + EPS, (  # ... so it must come before their forward passes
                            f"worker {w} stage {stage}: the merge of clock {wave} ended at {end}, after "
                            f"Forward({p}) began at {sp.start}")
                        pulled |= held
                records[(w, p)] = (local[p], pulled)
    return records


def _clock(pushes, who, stages, t, full_waves):
    """Full waves that every stage of the workers `who` had pushed by time t (the slowest's)."""
    return min(sum(1 for wave in range(full_waves) if pushes.get((w, s, wave), float("inf")) <= t + EPS)
               for w in who for s in range(stages))


@settings(max_examples=120, deadline=None, print_blob=True)
@given(clusters())
def test_wsp_keeps_the_staleness_bounds(c):
    result = _run(c)
    note(f"pulls (worker, stage, key, asked, answered): {result.pulls}")
    full_waves, waves = c.n // c.nm, (c.n - 1) // c.nm + 1
    merged = max(c.n // c.nm - 1, 0)  # clocks whose pull a later minibatch waits for
    for agent in result.agents:  # every minibatch trained; every merge that a minibatch needs ran
        kinds = [kind for kind, _ in result.task_order[agent]]
        assert kinds.count("merge") == merged
        assert len(kinds) - merged == (c.n if agent[1] == c.k - 1 else 2 * c.n)
    pushes = _pushes(c, result)
    assert sorted(pushes) == sorted((w, s, wave) for w in range(c.workers) for s in range(c.k) for wave in range(waves))
    assert sorted((w, s, key[1]) for w, s, key, _, _ in result.pulls) == sorted(
        (w, s, wave) for w in range(c.workers) for s in range(c.k) for wave in range(merged))
    assert all(key[0] == PULLED for _, _, key, _, _ in result.pulls)

    for stage in range(c.k):  # the local and global bounds of every minibatch's weights
        records = _provenance(c, result, pushes, stage)
        assert check(records, c.nm, c.d, c.workers) == c.n * c.workers

    everyone = range(c.workers)
    for sp in result.spans:  # the clock rule where a worker goes past the end of its clock c
        ins = sp.instruction
        if isinstance(ins, Forward) and ins.minibatch % c.nm == 0 and ins.minibatch > c.nm:
            clock = ins.minibatch // c.nm - 1  # (c+2)·Nm: its worker has pushed waves 0..c, clock c+1
            slowest = _clock(pushes, everyone, c.k, sp.start, waves)
            assert clock - slowest <= c.d, (
                f"worker {sp.stage[0]} stage {sp.stage[1]} began Forward({ins.minibatch}) at {sp.start} "
                f"at clock {clock} while the global clock was {slowest} (D={c.d})")
    for t in sorted(set(pushes.values())):  # whenever a clock moves: fastest - slowest <= D + 1
        clocks = [_clock(pushes, [w], c.k, t, full_waves) for w in everyone]
        assert max(clocks) - min(clocks) <= c.d + 1, f"clocks {clocks} at {t} (D={c.d})"
