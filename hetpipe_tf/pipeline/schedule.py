"""Pipeline schedules: for every stage, the program it runs (HetPipe §4).

Pure Python. A :class:`Schedule` holds one :class:`StageProgram` per stage: a
prologue run first, in order, then one or more task streams. A single stream
runs in its order. Several streams are merged by the rule of §4, written here
once in :func:`fifo_pick` and applied by both the executor and the simulator:

  1. a forward task for minibatch p runs after the forward task of every p' < p;
  2. a backward task for p runs after the backward task of every p' < p;
  3. among ready tasks, first ready, first run (FIFO); equal ready times go to
     the older minibatch.

Rules 1 and 2 are the order within each stream; rule 3 is the merge. It is the
one place where timing decides, for example when a middle stage has a forward
and a backward task ready, and the program says so: it lists both streams.
"""
from dataclasses import dataclass

from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, Forward, LoadMinibatch, MergePulled, PullWeights, PushUpdate, RecvActivation,
    RecvGradient, RecvInputs, RecvLabels, ReleaseWeights, SendActivation, SendGradient, SnapshotState,
    StashWeights, Task, TaskStream)


def fifo_pick(candidates):
    """§4 rule 3: the candidate that became ready first; ties go to the older minibatch.

    Args:
      candidates: (ready_time, minibatch, stream_index) tuples of ready tasks.
    Returns:
      The chosen tuple.
    """
    return min(candidates)


@dataclass(frozen=True)
class StageProgram:
    """What one stage runs: `prologue` in order, then its `streams` merged FIFO."""
    stage: int
    prologue: tuple
    streams: tuple

    @property
    def num_tasks(self):
        return sum(len(s) for s in self.streams)

    def format(self, max_minibatches=6):
        merge = ("FIFO merge of the streams below (§4 rule 3: first ready, first run; "
                 "ties to the older minibatch)" if len(self.streams) > 1 else "in order")
        lines = [f"stage {self.stage}: prologue {list(self.prologue)}; then {merge}"]
        for stream in self.streams:
            shown = ", ".join(repr(t) for t in stream[:max_minibatches])
            more = f", ... ({len(stream)} tasks)" if len(stream) > max_minibatches else ""
            lines.append(f"  {stream.kind:>16}: {shown}{more}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Schedule:
    """Per-stage programs for `num_minibatches` minibatches with `num_in_flight` (Nm) in flight."""
    name: str
    num_stages: int
    num_minibatches: int
    num_in_flight: int
    programs: tuple

    def format(self, max_minibatches=6):
        head = (f"{self.name} schedule: {self.num_stages} stages, {self.num_minibatches} "
                f"minibatches, Nm={self.num_in_flight}")
        return "\n".join([head] + [p.format(max_minibatches) for p in self.programs])

    def __str__(self):
        return self.format()


def hetpipe_schedule(num_stages, num_minibatches, num_in_flight, input_stages=(0,),
                     snapshot_after=(), wsp=False):
    """The HetPipe schedule of one virtual worker (§4).

    Minibatch p uses weight version w_p, which holds exactly the local updates of
    minibatches 1..p-Nm: every stage stashes w_1 = ... = w_Nm = w_0 in its
    prologue, and stashes w_{p+Nm} right after applying update p. Forward(p)
    requires w_p, so minibatch p starts only once update p-Nm is applied, and at
    most Nm versions are live per stage (w_p is released before update p). The
    last stage runs forward and backward of a minibatch as one task.

    §4 sizes each stage's memory by its position: the first stage holds the
    activations of the most minibatches, the last stage of one. This schedule makes
    that a rule: stage q holds at most min(Nm, k - q) minibatches' activations
    (Forward(p) also waits for Backward(p - w) on that stage), so the planner's
    memory per stage position is what the stage can ever need.

    Args:
      num_stages: k.
      num_minibatches: how many minibatches the run trains.
      num_in_flight: Nm, the number of minibatches in the pipeline (s_local + 1).
      input_stages: the stages that consume model inputs (stage 0 loads them).
      snapshot_after: minibatch ids after whose update every stage records its state.
      wsp: this virtual worker is one of several synchronised by Wave Synchronous Parallel
        (§5). At the end of every wave c (after update (c+1)*Nm) each stage pushes the
        wave's aggregated update and asks for the global weights (PushUpdate, PullWeights);
        a third stream merges them when they arrive (MergePulled), and minibatch (c+2)*Nm,
        the first whose version must hold the global updates of wave c, waits for that
        merge. A last, partial wave is pushed too (no update is lost); pulls that no later
        minibatch needs are not made. For D = 0, Nm = 4 (seed 001): minibatch 8 waits for every worker's wave 0,
        while minibatches 5..7 of wave 1 are already in the pipeline.
    """
    k, n, nm = int(num_stages), int(num_minibatches), int(num_in_flight)
    if k < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n < 0:
        raise ValueError(f"num_minibatches must be >= 0, got {num_minibatches}")
    if nm < 1:
        raise ValueError(f"num_in_flight (Nm) must be >= 1, got {num_in_flight}")
    input_stages = tuple(sorted(set(input_stages)))
    if 0 not in input_stages or input_stages[-1] >= k:
        raise ValueError(f"input_stages must include 0 and lie in 0..{k - 1}, got {list(input_stages)}")
    snapshots = frozenset(snapshot_after)
    last = k - 1

    def entry(s, p):
        ins = []
        if s == 0:
            ins.append(LoadMinibatch(p, inputs_to=input_stages[1:], labels_to=last))
        elif s in input_stages:
            ins.append(RecvInputs(p))
        if s > 0:
            ins.append(RecvActivation(p))
        return ins

    def update(s, p):
        ins = [SendGradient(p, to=s - 1)] if s > 0 else []
        ins += [ReleaseWeights(p), ApplyUpdate(p)]
        if p + nm <= n:
            ins.append(StashWeights(p + nm))
        if wsp and (p % nm == 0 or p == n):
            wave = (p - 1) // nm
            ins.append(PushUpdate(p, wave=wave))
            if (wave + 2) * nm <= n:  # some later minibatch needs this wave's pull
                ins.append(PullWeights(p, wave=wave))
        if p in snapshots:
            ins.append(SnapshotState(p))
        return ins

    def gate(p):
        """The wave whose pull minibatch p's version needs (§5), or None."""
        return p // nm - 2 if wsp and p % nm == 0 and p > nm else None

    num_waves = n // nm if wsp else 0

    programs = []
    for s in range(k):
        prologue = tuple(StashWeights(p) for p in range(1, min(nm, n) + 1))
        if s < last:
            window = k - s if k - s < nm else 0  # only where it is tighter than Nm itself

            def forward(p, s=s, w=window):
                return Task(s, "forward", p, tuple(entry(s, p) + [Forward(p, window=w, merged=gate(p)),
                                                                  SendActivation(p, to=s + 1)]))

            def backward(p, s=s, w=window):
                return Task(s, "backward", p, tuple([RecvGradient(p), Backward(p, window=w)] + update(s, p)))

            streams = (TaskStream("forward", n, forward), TaskStream("backward", n, backward))
        else:
            def forward_backward(p, s=s):
                return Task(s, "forward_backward", p,
                            tuple(entry(s, p) + [RecvLabels(p), Forward(p, merged=gate(p)), Backward(p)]
                                  + update(s, p)))

            streams = (TaskStream("forward_backward", n, forward_backward),)
        if wsp:
            def merge(c, s=s):
                return Task(s, "merge", (c + 1) * nm, (MergePulled((c + 1) * nm, wave=c),))

            # Only merges that a later minibatch waits for: wave c gates minibatch (c+2)*Nm.
            streams += (TaskStream("merge", max(num_waves - 1, 0), lambda i, s=s: merge(i - 1, s)),)
        programs.append(StageProgram(stage=s, prologue=prologue, streams=streams))
    return Schedule(name="hetpipe", num_stages=k, num_minibatches=n, num_in_flight=nm,
                    programs=tuple(programs))
