"""The HetPipe schedule of one virtual worker (§4), the first registration of the schedule seam.

Pure Python. Minibatch p uses weight version w_p, which holds exactly the local updates of
minibatches 1..p-Nm: every stage stashes w_1 = ... = w_Nm = w_0 in its prologue, and
stashes w_{p+Nm} right after applying update p. Forward(p) requires w_p, so minibatch p
starts only once update p-Nm is applied, and at most Nm versions are live per stage (w_p
is released before update p). The last stage runs forward and backward of a minibatch as
one task.

§4 sizes each stage's memory by its position: the first stage holds the activations of the
most minibatches, the last stage of one. This schedule makes that a rule: stage q holds at
most min(Nm, k - q) minibatches' activations (Forward(p) also waits for Backward(p - w) on
that stage), so the planner's memory per stage position is what the stage can ever need.

A synchronisation scheme (:class:`hetpipe_tf.pipeline.schedule.SyncScheme`) adds its
instructions after each update, the keys a forward pass waits for, and its own streams.

With a :class:`hetpipe_tf.pipeline.schedule.WorkerUpdate` (a clip by the norm of every stage's
gradient, a loss scale, tied weights), the first stage sends its update terms of minibatch p after
its backward pass, and each waiting stage's update of p (with what precedes it: a compensation,
the release of w_p) and the stash of w_{p+Nm} form a task of its own, in an ``update`` stream that
takes the terms first; its backward task ends with sending the gradient (and its tied replicas'
gradients to the first stage).
"""
from collections.abc import Collection, Sequence

from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, Forward, Instruction, LoadMinibatch, RecvActivation, RecvGradient, RecvInputs, RecvLabels,
    RecvTiedGradients, RecvUpdateTerms, ReleaseWeights, SendActivation, SendGradient, SendTiedGradients,
    SendUpdateTerms, SnapshotState, StashWeights, Task, TaskStream)
from hetpipe_tf.pipeline.schedule import (
    NO_SYNC, NO_WORKER_UPDATE, PipelineSchedule, Schedule, StageProgram, SyncScheme, WorkerUpdate, get_sync,
    register_schedule)
from hetpipe_tf.pipeline.stage_programs import after_update, check_run, entry


class HetPipeSchedule(PipelineSchedule):
    """HetPipe's pipelining with weight stashing and Nm minibatches in flight (§4)."""

    name = "hetpipe"
    instructions = frozenset({LoadMinibatch, RecvInputs, RecvLabels, RecvActivation, SendActivation,
                              RecvGradient, SendGradient, Forward, Backward, ApplyUpdate, StashWeights,
                              ReleaseWeights, SnapshotState, SendUpdateTerms, RecvUpdateTerms, SendTiedGradients,
                              RecvTiedGradients})
    worker_update = True

    def activations_held(self, position: int, num_stages: int, num_in_flight: int) -> int:
        """min(Nm, k - q) (§4)."""
        return max(1, min(num_in_flight, num_stages - position))

    def weight_versions(self, num_in_flight: int) -> int:
        """Nm: w_p is released before update p, and w_{p+Nm} stashed after it."""
        return num_in_flight

    def programs(self, num_stages: int, steps: int, num_in_flight: int, input_stages: Sequence[int] = (0,),
                 snapshot_after: Collection[int] = (), sync: SyncScheme = NO_SYNC,
                 worker_update: WorkerUpdate = NO_WORKER_UPDATE) -> Schedule:
        """Args:
          num_stages: k.
          steps: how many minibatches the run trains.
          num_in_flight: Nm, the number of minibatches in the pipeline (s_local + 1).
          input_stages: the stages that consume model inputs (stage 0 loads them).
          snapshot_after: minibatch ids after whose update every stage records its state.
          sync: the synchronisation scheme between virtual workers (default: none).
          worker_update: the update terms the stages share (see the module docstring).

        Returns:
          The per-stage programs.
        """
        k, n, nm, inputs = check_run(num_stages, steps, num_in_flight, input_stages)
        snapshots = frozenset(snapshot_after)
        last = k - 1
        waiting = frozenset(worker_update.waiting)

        def sent(s: int, p: int) -> list[Instruction]:  # what a stage's backward pass hands on
            ins: list[Instruction] = [SendGradient(p, to=s - 1)] if s > 0 else []
            return ins + ([SendTiedGradients(p, to=0)] if s in worker_update.tied else [])

        def received(s: int, p: int) -> list[Instruction]:  # what stage 0's backward pass takes besides the gradient
            return [RecvTiedGradients(p, source=t) for t in worker_update.tied] if s == 0 else []

        def update(s: int, p: int) -> list[Instruction]:  # the update of p and what follows it
            ins: list[Instruction] = [*self.before_update(p), ReleaseWeights(p), ApplyUpdate(p)]
            if p + nm <= n:
                ins.append(StashWeights(p + nm))
            return ins + after_update(sync, (p,), n, nm, snapshots)

        def backward_end(s: int, p: int) -> list[Instruction]:
            if s in waiting:
                return sent(s, p)
            terms: list[Instruction] = [SendUpdateTerms(p, to=tuple(sorted(waiting)))] if s == 0 and waiting else []
            return sent(s, p) + terms + update(s, p)

        programs: list[StageProgram] = []
        for s in range(k):
            prologue = tuple(StashWeights(p) for p in range(1, min(nm, n) + 1))
            if s < last:
                window = k - s if k - s < nm else 0  # only where it is tighter than Nm itself

                def forward(p: int, s: int = s, w: int = window) -> Task:
                    return Task(s, "forward", p, tuple(entry(s, p, inputs, last) + [
                        Forward(p, window=w, waits=sync.forward_waits(p, nm)), SendActivation(p, to=s + 1)]))

                def backward(p: int, s: int = s, w: int = window) -> Task:
                    return Task(s, "backward", p, tuple([RecvGradient(p)] + received(s, p) + [Backward(p, window=w)]
                                                        + backward_end(s, p)))

                streams: tuple[TaskStream, ...] = (TaskStream("forward", n, forward),
                                                   TaskStream("backward", n, backward))
            else:
                def forward_backward(p: int, s: int = s) -> Task:
                    return Task(s, "forward_backward", p, tuple(
                        entry(s, p, inputs, last) + [RecvLabels(p), Forward(p, waits=sync.forward_waits(p, nm)),
                                                          Backward(p)] + backward_end(s, p)))

                streams = (TaskStream("forward_backward", n, forward_backward),)
            if s in waiting:
                def apply(p: int, s: int = s) -> Task:
                    return Task(s, "update", p, tuple([RecvUpdateTerms(p)] + update(s, p)))

                streams += (TaskStream("update", n, apply),)
            streams += sync.streams(s, n, nm)
            programs.append(StageProgram(stage=s, prologue=prologue, streams=streams))
        return Schedule(name=self.name, num_stages=k, steps=n, num_in_flight=nm,
                        programs=tuple(programs))


HETPIPE = register_schedule(HetPipeSchedule())


def hetpipe_schedule(num_stages: int, steps: int, num_in_flight: int, input_stages: Sequence[int] = (0,),
                     snapshot_after: Collection[int] = (), sync: str | SyncScheme | None = None) -> Schedule:
    """HetPipe's :class:`Schedule` (see :meth:`HetPipeSchedule.programs`).

    Args:
        num_stages: k, the number of stages.
        steps: how many minibatches the run trains.
        num_in_flight: Nm, the number of minibatches in the pipeline (s_local + 1).
        input_stages: the stages that consume model inputs (stage 0 loads them).
        snapshot_after: minibatch ids after whose update every stage records its state.
        sync: the synchronisation scheme between virtual workers: a
            :class:`hetpipe_tf.pipeline.schedule.SyncScheme`, its registered name, or None (none).

    Returns:
        The per-stage programs.
    """
    return HETPIPE.programs(num_stages, steps, num_in_flight, input_stages=input_stages,
                            snapshot_after=snapshot_after, sync=get_sync(sync))
