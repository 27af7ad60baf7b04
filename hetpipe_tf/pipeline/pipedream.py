"""PipeDream's schedule (HetPipe §2.3; Narayanan et al., SOSP 2019): one-forward-one-backward
(1F1B) with weight stashing, and vertical sync as a second registration. A registration of the
schedule seam: "pipedream" and "pipedream-vsync".

Pure Python. Stage q of k admits w = min(Nm, k - q) minibatches (PipeDream's warm-up: the
first stage the most, the last one), then alternates strictly: the backward pass of the
oldest minibatch, the forward pass of the next (the order is one stream, run as written; the
last stage runs each minibatch's forward and backward as one task).

* **weight stashing** ("pipedream"): each stage stashes its live weights as they are when a
  minibatch's forward pass starts, and that minibatch's backward pass uses them; updates are
  applied to the live weights. Stages therefore use different versions for one minibatch
  (stage q's holds the local updates of minibatches 1..p - w).
* **vertical sync** ("pipedream-vsync"): every stage uses, for minibatch p, the version with
  the updates of minibatches 1..p - Nm, the one the input stage would use with Nm in flight:
  each stage stashes w_{p+Nm} right after applying update p (HetPipe's rule, §4, in 1F1B order).
"""
from collections.abc import Callable, Collection, Sequence

from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, Forward, Instruction, LoadMinibatch, RecvActivation, RecvGradient, RecvInputs, RecvLabels,
    ReleaseWeights, SendActivation, SendGradient, SnapshotState, StashWeights, Task, TaskStream)
from hetpipe_tf.pipeline.schedule import (
    NO_SYNC, NO_WORKER_UPDATE, PipelineSchedule, Schedule, StageProgram, SyncScheme, WorkerUpdate,
    check_worker_update, register_schedule)
from hetpipe_tf.pipeline.stage_programs import after_update, check_run, entry

#: What a 1F1B stage's task or prologue runs, by (stage, minibatch).
MakeInstructions = Callable[[int, int], list[Instruction]]
#: The minibatches a stage admits before its first backward pass, by (position, k, Nm).
Admitted = Callable[[int, int, int], int]


def one_f_one_b(admitted: int, steps: int, i: int) -> tuple[str, int]:
    """The i-th task (1-based) of a 1F1B stage that admits `admitted` minibatches before its
    first backward pass: ("forward" or "backward", minibatch)."""
    w = min(admitted, steps)
    if i <= w:
        return "forward", i
    j, paired = i - w, steps - w  # after the warm-up: B(1), F(w + 1), B(2), F(w + 2), ...
    if j <= 2 * paired:
        return ("backward", (j + 1) // 2) if j % 2 else ("forward", w + j // 2)
    return "backward", j - paired


def one_f_one_b_programs(name: str, num_stages: int, steps: int, num_in_flight: int, input_stages: Sequence[int],
                         prologue: Callable[[int, int, int], list[Instruction]], forward: MakeInstructions,
                         backward: MakeInstructions, forward_backward: MakeInstructions, sync: SyncScheme,
                         admitted: Admitted | None = None) -> Schedule:
    """The :class:`Schedule` whose stage q runs 1F1B with `admitted(q, k, Nm)` admitted minibatches
    (default PipeDream's min(Nm, k - q); a count that never grows from one stage to the next
    cannot deadlock: stage q's backward pass j follows its forward pass w_q + j - 1).

    `forward(s, p)`, `backward(s, p)` and `forward_backward(s, p)` (the last stage) give a
    task's instructions after its entry (inputs, activations) and before its update's followers;
    `prologue(s)` what a stage runs first."""
    k, n, nm, inputs = check_run(num_stages, steps, num_in_flight, input_stages)
    last = k - 1
    admit: Admitted = admitted or (lambda q, k, nm: min(nm, k - q))
    make: dict[str, MakeInstructions] = {
        "forward": lambda s, p: entry(s, p, inputs, last) + forward(s, p),
        "backward": lambda s, p: [RecvGradient(p)] + backward(s, p),
        "forward_backward": lambda s, p: entry(s, p, inputs, last) + [RecvLabels(p)] + forward_backward(s, p),
    }
    programs: list[StageProgram] = []
    for s in range(k):
        if s == last:
            def whole(p: int, s: int = s) -> Task:
                return Task(s, "forward_backward", p, tuple(make["forward_backward"](s, p)))

            stream = TaskStream("1f1b", n, whole)
        else:
            def task(i: int, s: int = s, w: int = admit(s, k, nm)) -> Task:
                kind, p = one_f_one_b(w, n, i)
                return Task(s, kind, p, tuple(make[kind](s, p)))

            stream = TaskStream("1f1b", 2 * n, task)
        programs.append(StageProgram(stage=s, prologue=tuple(prologue(s, n, nm)),
                                     streams=(stream,) + sync.streams(s, n, nm)))
    return Schedule(name=name, num_stages=k, steps=n, num_in_flight=nm, programs=tuple(programs))


class PipeDreamSchedule(PipelineSchedule):
    """1F1B with weight stashing; with `vertical_sync`, one version per minibatch on every stage."""

    def __init__(self, vertical_sync: bool) -> None:
        self.vertical_sync = bool(vertical_sync)
        self.name = "pipedream-vsync" if vertical_sync else "pipedream"
        self.instructions = frozenset({
            LoadMinibatch, RecvInputs, RecvLabels, RecvActivation, SendActivation, RecvGradient, SendGradient,
            Forward, Backward, ApplyUpdate, StashWeights, ReleaseWeights, SnapshotState})

    def admitted(self, position: int, num_stages: int, num_in_flight: int) -> int:
        """min(Nm, k - q): the minibatches stage q admits before its first backward pass."""
        return max(1, min(num_in_flight, num_stages - position))

    def activations_held(self, position: int, num_stages: int, num_in_flight: int) -> int:
        """What the stage admits (:meth:`admitted`) before its first backward pass."""
        return self.admitted(position, num_stages, num_in_flight)

    def weight_versions(self, num_in_flight: int) -> int:
        """Nm: weight stashing holds one per admitted minibatch (min(Nm, k - q) <= Nm); vertical
        sync stashes w_{p+Nm} after update p, as HetPipe does."""
        return num_in_flight

    def programs(self, num_stages: int, steps: int, num_in_flight: int, input_stages: Sequence[int] = (0,),
                 snapshot_after: Collection[int] = (), sync: SyncScheme = NO_SYNC,
                 worker_update: WorkerUpdate = NO_WORKER_UPDATE) -> Schedule:
        check_worker_update(self, worker_update, "a worker update (global_clipnorm, a loss scale, tied weights)")

        snapshots, vsync = frozenset(snapshot_after), self.vertical_sync
        n, nm = int(steps), int(num_in_flight)

        def prologue(s: int, n: int, nm: int) -> list[Instruction]:
            return [StashWeights(p) for p in range(1, min(nm, n) + 1)] if vsync else []

        def forward(s: int, p: int) -> list[Instruction]:
            stash: list[Instruction] = [] if vsync else [StashWeights(p)]  # weight stashing: the live weights now
            return stash + [Forward(p, waits=sync.forward_waits(p, nm)), SendActivation(p, to=s + 1)]

        def update(s: int, p: int) -> list[Instruction]:
            ins: list[Instruction] = [SendGradient(p, to=s - 1)] if s > 0 else []
            ins += [*self.before_update(p), ReleaseWeights(p), ApplyUpdate(p)]
            if vsync and p + nm <= n:
                ins.append(StashWeights(p + nm))
            return ins + after_update(sync, (p,), n, nm, snapshots)

        def forward_backward(s: int, p: int) -> list[Instruction]:
            stash: list[Instruction] = [] if vsync else [StashWeights(p)]
            return stash + [Forward(p, waits=sync.forward_waits(p, nm)), Backward(p)] + update(s, p)

        return one_f_one_b_programs(self.name, num_stages, steps, num_in_flight, input_stages, prologue, forward,
                                    lambda s, p: [Backward(p)] + update(s, p), forward_backward, sync,
                                    admitted=self.admitted)


PIPEDREAM = register_schedule(PipeDreamSchedule(vertical_sync=False))
PIPEDREAM_VSYNC = register_schedule(PipeDreamSchedule(vertical_sync=True))
