"""NaivePipe (TaylorPipe's term, its §2 and Tables 2-3): pipelined SGD without weight stashing.
A registration of the schedule seam: "naivepipe".

Pure Python. The order is PipeDream's 1F1B (:mod:`hetpipe_tf.pipeline.pipedream`), as the
TaylorPipe paper runs all its pipelines, but a stage keeps no weight versions: a minibatch's forward pass
uses the stage's live weights, and its backward pass uses the live weights as they are then,
whatever updates the stage applied in between (TaylorPipe's weight inconsistency). TensorFlow
differentiates a pass at the weights it ran with, so a stage other than the last keeps the
minibatch's inputs and runs its forward pass again with the live weights right before the
backward pass (:class:`hetpipe_tf.pipeline.instructions.Recompute`): the gradient is the
stage's at (its inputs, the live weights), the gradient it sends back too. That costs one
forward pass per backward pass more than a NaivePipe that reads overwritten buffers would.
The last stage runs forward and backward as one task, with nothing applied in between.
"""
from collections.abc import Collection, Sequence

from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, Forward, Instruction, LoadMinibatch, Recompute, RecvActivation, RecvGradient,
    RecvInputs, RecvLabels, SendActivation, SendGradient, SnapshotState)
from hetpipe_tf.pipeline.pipedream import one_f_one_b_programs
from hetpipe_tf.pipeline.schedule import (
    NO_SYNC, NO_WORKER_UPDATE, PipelineSchedule, Schedule, SyncScheme, WorkerUpdate, check_worker_update,
    register_schedule)
from hetpipe_tf.pipeline.stage_programs import after_update


class NaivePipeSchedule(PipelineSchedule):
    """1F1B, no stashed versions: backward passes use the live weights (TaylorPipe, §2)."""

    name = "naivepipe"
    instructions = frozenset({LoadMinibatch, RecvInputs, RecvLabels, RecvActivation, SendActivation, RecvGradient,
                              SendGradient, Forward, Recompute, Backward, ApplyUpdate, SnapshotState})

    def activations_held(self, position: int, num_stages: int, num_in_flight: int) -> int:
        """One: a backward pass's recomputed activations (the inputs kept for the other
        min(Nm, k - q) - 1 admitted minibatches are not counted)."""
        return 1

    def weight_versions(self, num_in_flight: int) -> int:
        """None: only the live weights."""
        return 0

    def programs(self, num_stages: int, steps: int, num_in_flight: int, input_stages: Sequence[int] = (0,),
                 snapshot_after: Collection[int] = (), sync: SyncScheme = NO_SYNC,
                 worker_update: WorkerUpdate = NO_WORKER_UPDATE) -> Schedule:
        """1F1B on the live weights, each backward pass after a recomputed forward one."""
        check_worker_update(self, worker_update, "a worker update (global_clipnorm, a loss scale, tied weights)")

        snapshots, n, nm = frozenset(snapshot_after), int(steps), int(num_in_flight)

        def update(s: int, p: int) -> list[Instruction]:
            ins: list[Instruction] = [SendGradient(p, to=s - 1)] if s > 0 else []
            return ins + [ApplyUpdate(p)] + after_update(sync, (p,), n, nm, snapshots)

        return one_f_one_b_programs(
            self.name, num_stages, steps, num_in_flight, input_stages, prologue=lambda s, n, nm: [],
            forward=lambda s, p: [Forward(p, live=True, recompute=True, waits=sync.forward_waits(p, nm)),
                                  SendActivation(p, to=s + 1)],
            backward=lambda s, p: [Recompute(p), Backward(p)] + update(s, p),
            forward_backward=lambda s, p: [Forward(p, live=True, waits=sync.forward_waits(p, nm)), Backward(p)]
            + update(s, p), sync=sync)


NAIVEPIPE = register_schedule(NaivePipeSchedule())
