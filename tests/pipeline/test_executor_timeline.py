"""The executor's device timeline (emulated devices) on stand-in stage runtimes: no TensorFlow."""
import contextlib
import time
from types import SimpleNamespace

import pytest

from hetpipe_tf.pipeline.emulation import Pacer
from hetpipe_tf.pipeline.executor import PipelineError, PipelineExecutor
from hetpipe_tf.pipeline.instructions import ApplyUpdate, Backward, RecvGradient, SendGradient, Task, TaskStream
from hetpipe_tf.pipeline.schedule import Schedule, StageProgram


class StandInRuntime:
    """What the executor asks of a stage runtime, doing nothing: its passes take no time on the host."""

    device_instructions = frozenset({Backward, ApplyUpdate})

    def __init__(self, stage, is_last):
        self.device = f"stand-in {stage}"
        self.is_last = is_last
        self.memory = SimpleNamespace(peak=0)
        self.stash = SimpleNamespace(stats=lambda: SimpleNamespace(num_versions=0, bytes=0))

    def execution_scope(self):
        return contextlib.nullcontext()

    def run(self, instructions):
        pass

    def input_gradients(self, p):
        return [f"gradient of {p}"]

    def check_applied(self, logs=None):
        pass

    def end_run(self):
        pass


def _schedule(*streams_per_stage, steps):
    """A Schedule whose stage s runs the tasks {kind: [[instruction, ...] per minibatch]} of streams_per_stage[s]."""
    programs = tuple(StageProgram(s, (), tuple(
        TaskStream(kind, len(tasks), lambda p, s=s, kind=kind, tasks=tasks: Task(s, kind, p, tuple(tasks[p - 1])))
        for kind, tasks in streams.items())) for s, streams in enumerate(streams_per_stage))
    return Schedule("stand-in", len(programs), steps, 1, programs)


def test_a_failed_delivery_names_the_stage_it_was_for_and_the_instruction_that_sent_it():
    # Stage 1's device computes minibatch 1's gradient for 0.2 s; the schedule sends it twice, so
    # the second delivery, when the pass ends, finds the first still in stage 0's mailbox (stage 0
    # also waits for minibatch 2's gradient, which never comes).
    schedule = _schedule({"backward": [[RecvGradient(1), RecvGradient(2)]]},
                         {"backward": [[Backward(1), SendGradient(1, to=0), SendGradient(1, to=0)]]}, steps=1)
    executor = PipelineExecutor(schedule, [StandInRuntime(0, False), StandInRuntime(1, True)], iter(()),
                                split_inputs=None, pacers=[None, Pacer(speed=1.0)],
                                references=[{}, {Backward: 0.2}], timeout_s=30)
    with pytest.raises(PipelineError, match=r"virtual worker 0: stage 0 failed receiving \('gradient', 1\) from "
                                            r"stage 1's SendGradient\(1, to=0\): DuplicateMessageError: "
                                            r"stage 0 \(stand-in 0\) received \('gradient', 1\) twice"):
        executor.run()


def test_an_emulated_first_stage_reports_a_minibatch_once_its_device_ended_the_update():
    pacer = Pacer(speed=1.0)
    reported = []

    def done(p, logs):
        reported.append((p, time.perf_counter() >= pacer.free_at))

    schedule = _schedule({"backward": [[Backward(p), ApplyUpdate(p)] for p in (1, 2, 3)]}, steps=3)
    PipelineExecutor(schedule, [StandInRuntime(0, True)], iter(()), split_inputs=None, pacers=[pacer],
                     references=[{Backward: 0.05}], timeout_s=30, on_minibatch_done=done).run()
    assert reported == [(1, True), (2, True), (3, True)]
