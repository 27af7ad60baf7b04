"""What the programs of every schedule share: the checks of a run's shape, the instructions
that bring a minibatch's inputs to a stage, and what follows a minibatch's update.

Pure Python. HetPipe's schedule (§4) wrote these first; the classic schedules
(:mod:`hetpipe_tf.pipeline.gpipe`, :mod:`hetpipe_tf.pipeline.pipedream`,
:mod:`hetpipe_tf.pipeline.naivepipe`) build their programs from them.
"""
from collections.abc import Collection, Iterable, Sequence

from hetpipe_tf.pipeline.instructions import Instruction, LoadMinibatch, RecvActivation, RecvInputs, SnapshotState
from hetpipe_tf.pipeline.schedule import SyncScheme


def check_run(num_stages: int, steps: int, num_in_flight: int, input_stages: Iterable[int]
              ) -> tuple[int, int, int, tuple[int, ...]]:
    """(k, n, Nm, input stages sorted) of a run, or a ValueError saying which one is wrong."""
    k, n, nm = int(num_stages), int(steps), int(num_in_flight)
    if k < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if nm < 1:
        raise ValueError(f"num_in_flight (Nm) must be >= 1, got {num_in_flight}")
    stages = tuple(sorted(set(input_stages)))
    if 0 not in stages or stages[-1] >= k:
        raise ValueError(f"input_stages must include 0 and lie in 0..{k - 1}, got {list(stages)}")
    return k, n, nm, stages


def entry(stage: int, minibatch: int, input_stages: tuple[int, ...], last: int) -> list[Instruction]:
    """The instructions that bring minibatch p's inputs to `stage`: stage 0 loads it and routes
    the model inputs other stages consume and the labels (to the `last` stage); an input stage
    takes its model inputs; every stage but 0 takes the previous stage's activations."""
    ins: list[Instruction] = []
    if stage == 0:
        ins.append(LoadMinibatch(minibatch, inputs_to=input_stages[1:], labels_to=last))
    elif stage in input_stages:
        ins.append(RecvInputs(minibatch))
    if stage > 0:
        ins.append(RecvActivation(minibatch))
    return ins


def after_update(sync: SyncScheme, minibatches: Sequence[int], steps: int, num_in_flight: int,
                 snapshots: Collection[int]) -> list[Instruction]:
    """What a stage runs right after the update of `minibatches` is in its weights: the
    synchronisation scheme's instructions for each, then the state recorded if the last one
    is in `snapshots`."""
    ins = [i for p in minibatches for i in sync.after_update(p, steps, num_in_flight)]
    if minibatches[-1] in snapshots:
        ins.append(SnapshotState(minibatches[-1]))
    return ins
