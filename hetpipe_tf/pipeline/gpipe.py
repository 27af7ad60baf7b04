"""GPipe's schedule (HetPipe §2.3; Huang et al., NeurIPS 2019): microbatches, one flush
per minibatch. A registration of the schedule seam, in two variants: "gpipe" keeps every
microbatch's activations until its backward pass, "gpipe-recompute" re-materialises them.

Pure Python. Here a minibatch of GPipe is Nm consecutive items of the input pipeline, its
microbatches: what the rest of hetpipe_tf calls minibatches p (one per ``LoadMinibatch``),
so that the data, ``steps`` and Keras's progress count them as they count HetPipe's. Every
stage runs, for each GPipe minibatch, the forward passes of its Nm microbatches, then their
backward passes in the same order (the last stage runs each microbatch's forward and backward
as one task), adds each microbatch's weight gradient to a sum, and at the flush, once the
last microbatch's backward pass is done, applies one update from the **mean** of the Nm
gradients. The microbatch losses are means over their samples, so the mean gradient is the
gradient of the mean loss over all Nm·B samples: one GPipe minibatch is one SGD step on the
concatenated batch, and the learning rate means what it means to Keras on that batch. Every
microbatch of a minibatch sees the same weights (no update happens between its forward and
backward passes), so no version is stashed: the passes use the live weights.

A minibatch is cut short where the run ends and at every snapshot (an epoch's end), which is
flushed: the state recorded at an epoch's end holds all of its microbatches.

Between virtual workers, a synchronisation scheme's instructions follow the flush (those of
every microbatch it applied), and the first forward pass of a minibatch waits for everything
any of its microbatches' forward passes waits for: what the scheme merges into the weights
comes in between minibatches. (One case escapes this: when an epoch's end cut the minibatch
before short, a merge that a later minibatch waits for may come in during this one.)

Recomputation (GPipe's re-materialisation): the stage runtime otherwise keeps a forward
pass's tape, i.e. its activations, until the backward pass (it does not recompute the
forward inside the backward's tape). With ``recompute``, a stage other than the last keeps
only each microbatch's inputs, and runs the forward pass again under a tape (with the same,
unchanged weights) right before the backward pass: one microbatch's activations at a time,
for one more forward pass per microbatch. Layers that draw random numbers (dropout) draw
them again, so their recomputed activations differ from the first pass's.
"""
from collections.abc import Callable, Collection, Iterable, Sequence

from hetpipe_tf.pipeline.instructions import (
    AccumulateGradient, ApplyAccumulated, Backward, Forward, Instruction, LoadMinibatch, Recompute, RecvActivation,
    RecvGradient, RecvInputs, RecvLabels, SendActivation, SendGradient, SnapshotState, Task, TaskStream)
from hetpipe_tf.pipeline.schedule import (
    NO_SYNC, NO_WORKER_UPDATE, PipelineSchedule, Schedule, StageProgram, SyncScheme, WorkerUpdate,
    check_worker_update, register_schedule)
from hetpipe_tf.pipeline.stage_programs import after_update, check_run, entry


def microbatch_groups(steps: int, num_in_flight: int, snapshot_after: Iterable[int] = ()) -> list[tuple[int, int]]:
    """GPipe's minibatches as (first, last) microbatch ids: Nm consecutive microbatches each,
    cut short at every snapshot in `snapshot_after` and at the run's end `steps`."""
    cuts = sorted({p for p in snapshot_after if 0 < p < steps} | {steps})
    groups: list[tuple[int, int]] = []
    first = 1
    for cut in cuts:
        while first <= cut:
            last = min(first + num_in_flight - 1, cut)
            groups.append((first, last))
            first = last + 1
    return groups


class GPipeSchedule(PipelineSchedule):
    """Nm microbatches forward, then backward, one update at the flush (HetPipe §2.3)."""

    def __init__(self, recompute: bool) -> None:
        self.recompute = bool(recompute)
        self.name = "gpipe-recompute" if recompute else "gpipe"
        self.instructions = frozenset({
            LoadMinibatch, RecvInputs, RecvLabels, RecvActivation, SendActivation, RecvGradient, SendGradient,
            Forward, Backward, AccumulateGradient, ApplyAccumulated, SnapshotState}
            | ({Recompute} if recompute else set()))

    def activations_held(self, position: int, num_stages: int, num_in_flight: int) -> int:
        """Nm on every stage but the last, which holds one; with recomputation one everywhere
        (the inputs kept for the other Nm - 1 microbatches are not counted)."""
        return 1 if self.recompute or position == num_stages - 1 else num_in_flight

    def weight_versions(self, num_in_flight: int) -> int:
        """None: every microbatch of a minibatch uses the live weights, unchanged until the flush."""
        return 0

    def programs(self, num_stages: int, steps: int, num_in_flight: int, input_stages: Sequence[int] = (0,),
                 snapshot_after: Collection[int] = (), sync: SyncScheme = NO_SYNC,
                 worker_update: WorkerUpdate = NO_WORKER_UPDATE) -> Schedule:
        """Every stage's program: per GPipe minibatch of Nm microbatches (see
        :func:`microbatch_groups`), the forward tasks, then the backward tasks, the last with the flush."""
        check_worker_update(self, worker_update, "a worker update (global_clipnorm, a loss scale, tied weights)")
        k, n, nm, inputs = check_run(num_stages, steps, num_in_flight, input_stages)
        groups = microbatch_groups(n, nm, snapshot_after)
        snapshots = frozenset(snapshot_after)
        last = k - 1
        first_of = {b: a for a, b in groups}
        # The first forward pass of a minibatch waits for what any of its microbatches' would.
        waits = {a: tuple(dict.fromkeys(key for q in range(a, b + 1) for key in sync.forward_waits(q, nm)))
                 for a, b in groups}

        def finish(s: int, p: int) -> list[Instruction]:
            """What follows microbatch p's backward pass on stage s: its gradient into the sum,
            and at the end of its minibatch the flush."""
            ins: list[Instruction] = [SendGradient(p, to=s - 1)] if s > 0 else []
            ins.append(AccumulateGradient(p))
            if p in first_of:
                ins.append(ApplyAccumulated(p, first=first_of[p]))
                ins += after_update(sync, range(first_of[p], p + 1), n, nm, snapshots)
            return ins

        def forward(s: int, p: int) -> Task:
            if s == last:
                return Task(s, "forward_backward", p, tuple(
                    entry(s, p, inputs, last) + [RecvLabels(p), Forward(p, live=True, waits=waits.get(p, ())),
                                                       Backward(p)] + finish(s, p)))
            return Task(s, "forward", p, tuple(entry(s, p, inputs, last) + [
                Forward(p, live=True, recompute=self.recompute, waits=waits.get(p, ())),
                SendActivation(p, to=s + 1)]))

        def backward(s: int, p: int) -> Task:
            rebuild: list[Instruction] = [Recompute(p)] if self.recompute else []
            return Task(s, "backward", p, tuple([RecvGradient(p)] + rebuild + [Backward(p)] + finish(s, p)))

        programs = []
        for s in range(k):
            passes: tuple[Callable[[int, int], Task], ...] = (forward,) if s == last else (forward, backward)
            order = [(make, p) for a, b in groups for make in passes for p in range(a, b + 1)]

            def task(i: int, s: int = s, order: list[tuple[Callable[[int, int], Task], int]] = order) -> Task:
                return order[i - 1][0](s, order[i - 1][1])

            stream = TaskStream("gpipe", len(order), task)
            programs.append(StageProgram(stage=s, prologue=(), streams=(stream,) + sync.streams(s, n, nm)))
        return Schedule(name=self.name, num_stages=k, steps=n, num_in_flight=nm, programs=tuple(programs))


GPIPE = register_schedule(GPipeSchedule(recompute=False))
GPIPE_RECOMPUTE = register_schedule(GPipeSchedule(recompute=True))
