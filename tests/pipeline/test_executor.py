"""The pipeline executor running a virtual worker's stages: Keras's and stale SGD's results, weight
versions, stashes, stalls, failures, emulated memory and time. Emulated devices run at dilation 1
(no calibration probes) where a test is not about the emulation's timing."""
import json
import threading

import keras
import numpy as np
import pytest

from hetpipe_tf.pipeline import executor as executor_module
from hetpipe_tf.pipeline.emulation import DeviceOutOfMemoryError
from hetpipe_tf.pipeline.executor import PipelineError, PipelineExecutor, UnknownInstructionError
from hetpipe_tf.pipeline.instructions import Instruction, SendActivation, Task, TaskStream
from hetpipe_tf.pipeline.schedule import Schedule, StageProgram
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from tests.helpers import models
from tests.helpers.data import random_batches
from tests.helpers.models import LOSS
from tests.helpers.references import clone, stale_sgd_reference


def _optimizer(name):
    return {"sgd": lambda: keras.optimizers.SGD(0.1),
            "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
            "adam": lambda: keras.optimizers.Adam(0.01),
            "rmsprop": lambda: keras.optimizers.RMSprop(0.01)}[name]()


@pytest.mark.parametrize("build,devices,opt", [
    (models.mlp, "1,1,1", "sgd"),
    (models.mlp, "1,1", "momentum"),
    (models.cnn, "1,1", "momentum"),  # BatchNorm and Dropout
    (models.resnet_block, "1,1,1", "adam"),
    (models.two_inputs, "1,1", "rmsprop"),
])
def test_nm1_equals_plain_keras_training_after_20_steps(build, devices, opt):
    keras.utils.set_random_seed(7)
    model = build()
    ref = clone(model)
    ref.compile(optimizer=_optimizer(opt), loss=LOSS, jit_compile=False)
    batches = random_batches(model, 20)
    for x, y in batches:
        ref.train_on_batch(x, y)
    vw = VirtualWorker(model, devices, num_in_flight=1, optimizer=_optimizer(opt), loss=LOSS, dilation=1.0,
                       timeout_s=60)
    vw.train(iter(batches), 20)
    for got, want, v in zip(model.weights, ref.weights, model.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, err_msg=v.path)


@pytest.mark.parametrize("devices,nm", [("1,1,1", 3), ("1,0.3,1", 2), ("0.5,1,1,0.25", 4), ("1,1", 5)])
def test_nm_gt1_equals_stale_sgd_and_pairs_every_loss_with_its_labels(devices, nm):
    # Uneven emulated speeds make the FIFO order of forward and backward tasks vary.
    keras.utils.set_random_seed(11)
    model = models.mlp()
    batches = random_batches(model, 24)
    want_weights, want_losses = stale_sgd_reference(model, batches, nm, keras.optimizers.SGD(0.1, momentum=0.5))
    logs = {}
    vw = VirtualWorker(model, devices, num_in_flight=nm, optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
                       loss=LOSS, dilation=1.0, timeout_s=60)
    vw.train(iter(batches), 24, on_minibatch_done=lambda p, l: logs.__setitem__(p, float(l["loss"])))
    assert sorted(logs) == list(range(1, 25))
    # Each minibatch's loss was computed with its own labels and its own weight version.
    np.testing.assert_allclose([logs[p] for p in range(1, 25)], want_losses, atol=1e-5)
    for got, want in zip(model.trainable_variables, want_weights):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-5)


@pytest.mark.parametrize("nm", [2, 3])
def test_the_first_stage_runs_a_backward_task_and_the_forward_task_it_makes_ready_in_one_call(nm):
    # On devices that are not emulated, Backward(p) with the stash of w_{p+Nm} and Forward(p+Nm) run as
    # one call of the first stage; the results are stale SGD's, every loss paired with its labels.
    keras.utils.set_random_seed(11)
    model = models.mlp()
    batches = random_batches(model, 12)
    want_weights, want_losses = stale_sgd_reference(model, batches, nm, keras.optimizers.SGD(0.1, momentum=0.5))
    logs = {}
    vw = VirtualWorker(model, "cpu,cpu,cpu", num_in_flight=nm, optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
                       loss=LOSS, record_provenance=True, timeout_s=60)
    report = vw.train(iter(batches), 12, on_minibatch_done=lambda p, l: logs.__setitem__(p, float(l["loss"])))
    np.testing.assert_allclose([logs[p] for p in range(1, 13)], want_losses, atol=1e-5)
    for got, want in zip(model.trainable_variables, want_weights):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
    first = report.stages[0]
    assert first.tasks == 24  # a forward and a backward task per minibatch
    # the prologue's stashes, Forward(1..Nm) alone, Backward(p) with Forward(p + Nm), the last Nm backward alone
    assert first.device_calls == 1 + nm + (12 - nm) + nm
    assert [s.device_calls for s in report.stages[1:]] == [1 + 24, 1 + 12]  # nothing joined where a task sends
    for rt in vw.runtimes:
        for p, updates in rt.provenance.used_versions.items():
            assert updates == tuple(range(1, max(p - nm, 0) + 1)), (rt.index, p, updates)
        assert rt.applied == list(range(1, 13))


@pytest.mark.parametrize("nm", [1, 2, 3, 5])
def test_weight_version_of_minibatch_p_holds_exactly_updates_1_to_p_minus_nm(nm):
    model = models.mlp()
    vw = VirtualWorker(model, "1,0.5,1", num_in_flight=nm, optimizer="sgd", loss=LOSS,
                       record_provenance=True, dilation=1.0, timeout_s=60)
    report = vw.train(iter(random_batches(model, 16)), 16)
    for rt in vw.runtimes:
        assert sorted(rt.provenance.used_versions) == list(range(1, 17))
        for p, updates in rt.provenance.used_versions.items():
            assert updates == tuple(range(1, max(p - nm, 0) + 1)), (rt.index, p, updates)
        assert rt.applied == list(range(1, 17))
        assert rt.stash.stats().num_versions == 0
    assert [s.stash_peak_versions for s in report.stages] == [min(nm, 16)] * 3


def test_a_stage_without_weights_trains():
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(8), keras.layers.ReLU(),
                              keras.layers.Dense(5)])
    batches = random_batches(model, 6)
    want, _ = stale_sgd_reference(model, batches, 2, keras.optimizers.SGD(0.1))
    vw = VirtualWorker(model, "1,1,1", num_in_flight=2, boundaries=(0, 1, 2), optimizer=keras.optimizers.SGD(0.1),
                       loss=LOSS, dilation=1.0, timeout_s=60)
    vw.train(iter(batches), 6)
    assert vw.runtimes[1].trainable == []
    for got, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), w, atol=1e-5)


def test_stash_reports_bytes_of_nm_versions():
    model = models.mlp()
    vw = VirtualWorker(model, "1,1", num_in_flight=3, optimizer="sgd", loss=LOSS, dilation=1.0, timeout_s=60)
    report = vw.train(iter(random_batches(model, 8)), 8)
    for rt, stage in zip(vw.runtimes, report.stages):
        assert stage.stash_bytes_peak == 3 * rt.version_bytes > 0


def test_stalled_stage_times_out_naming_what_it_waits_for():
    model = models.mlp()
    vw = VirtualWorker(model, "1,1", num_in_flight=2, optimizer="sgd", loss=LOSS, dilation=1.0, timeout_s=1.5)
    batches = random_batches(model, 6)
    vw.train(iter(batches[:1]), 1)  # builds and times the stages
    good = vw.schedule(6)

    def drop_send(task):  # stage 0 never sends minibatch 3's activations
        if task.minibatch == 3:
            return Task(task.stage, task.kind, 3, tuple(i for i in task.instructions
                                                          if not isinstance(i, SendActivation)))
        return task

    prog0 = good.programs[0]
    broken = Schedule("broken", 2, 6, 2, (
        StageProgram(0, prog0.prologue, (TaskStream("forward", 6, lambda p: drop_send(prog0.streams[0][p - 1])),
                                         prog0.streams[1])),
        good.programs[1]))
    executor = PipelineExecutor(broken, vw.runtimes, iter(batches), vw.staged.split_inputs, timeout_s=1.5)
    # Both stages wait; whichever times out first, the error says what every stage lacks.
    with pytest.raises(PipelineError, match=r"waited 1.5 s with no task ready: stage 0: .*lacks \[\('gradient', 3\)\]"
                                            r".* \| stage 1: .*lacks \[\('activation', 3\)\]"):
        executor.run()


def test_a_stage_stuck_in_a_device_call_is_named_with_where_it_is(monkeypatch):
    model = models.mlp()
    vw = VirtualWorker(model, "1,1", num_in_flight=2, optimizer="sgd", loss=LOSS, dilation=1.0, timeout_s=1.0)
    batches = random_batches(model, 4)
    vw.train(iter(batches[:1]), 1)  # builds and times the stages
    released = threading.Event()

    def call_that_never_returns(instructions):  # as a TensorFlow call that waits for ever would
        released.wait(30)

    monkeypatch.setattr(vw.runtimes[1], "run", call_that_never_returns)
    monkeypatch.setattr(executor_module, "_STOP_GRACE_S", 0.2)
    executor = PipelineExecutor(vw.schedule(4), vw.runtimes, iter(batches), vw.staged.split_inputs, timeout_s=1.0)
    try:
        with pytest.raises(PipelineError, match=r"(?s)stage 1: running \[StashWeights.*hetpipe-stage-1 did not stop; "
                                                r"it is in .*in call_that_never_returns"):
            executor.run()
    finally:
        released.set()


def test_failing_input_pipeline_stops_every_stage_with_a_clear_error():
    model = models.mlp()
    vw = VirtualWorker(model, "1,1,1", num_in_flight=3, optimizer="sgd", loss=LOSS, dilation=1.0, timeout_s=30)
    batches = random_batches(model, 10)

    def data():
        yield from batches[:4]
        raise OSError("disk went away")

    # The first minibatch is read once for calibration and then trained on: four are good.
    with pytest.raises(PipelineError, match=r"stage 0 failed at LoadMinibatch\(5\): OSError: disk went away"):
        vw.train(data(), 10)


def test_emulated_memory_capacity_fails_like_an_out_of_memory():
    model = models.cnn()
    with pytest.raises(DeviceOutOfMemoryError, match=r"out of memory on stage 0 .*capacity 1.0 KiB"):
        VirtualWorker(model, "1@1K,1", num_in_flight=2, optimizer="sgd", loss=LOSS, dilation=1.0).train(
            iter(random_batches(model, 2)), 2)
    # Enough for weights, slots and Nm versions, but not for Nm minibatches' activations.
    probe = VirtualWorker(model, "1,1", num_in_flight=3, optimizer="sgd", loss=LOSS, dilation=1.0)
    probe.train(iter(random_batches(model, 3)), 3)
    held = probe.runtimes[0].memory
    fixed = held.peak - 3 * probe.runtimes[0].activation_bytes
    capacity = fixed + 2 * probe.runtimes[0].activation_bytes
    vw = VirtualWorker(model, f"1@{capacity},1", num_in_flight=3, optimizer="sgd", loss=LOSS, dilation=1.0,
                       timeout_s=30)
    with pytest.raises(PipelineError, match=r"DeviceOutOfMemoryError: out of memory on stage 0.*activations"):
        vw.train(iter(random_batches(model, 6)), 6)


def test_unknown_instruction_is_refused_before_running():
    class Teleport(Instruction):
        pass

    model = models.mlp()
    vw = VirtualWorker(model, "1", num_in_flight=1, optimizer="sgd", loss=LOSS, dilation=1.0)
    vw.train(iter(random_batches(model, 1)), 1)
    bad = Schedule("bad", 1, 1, 1, (StageProgram(0, (Teleport(1),), ()),))
    with pytest.raises(UnknownInstructionError, match=r"Teleport\(1\).*it knows: .*ApplyUpdate"):
        PipelineExecutor(bad, vw.runtimes, iter([]), vw.staged.split_inputs)


def test_emulated_tasks_take_their_target_time_and_trace_says_emulated(tmp_path):
    model = models.mlp()
    vw = VirtualWorker(model, "1,0.2", num_in_flight=2, optimizer="sgd", loss=LOSS, timeout_s=60)
    vw.train(iter(random_batches(model, 10)), 10, trace=True)
    path = tmp_path / "trace.json"
    vw.trace.write(str(path))
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    slow_forward = [e["dur"] for e in spans if e["tid"] == 1 and e["name"].startswith("Forward(")]
    target_us = 1e6 * vw.references[1][type(vw.schedule(1).programs[1].streams[0][0].instructions[2])] / 0.2
    assert len(slow_forward) == 10 and min(slow_forward) >= 0.99 * target_us
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any("emulated device (speed 0.2" in n for n in names)
    assert "EMULATED" in trace["otherData"]["emulation"]
    assert {e["tid"] for e in spans} == {0, 1}
    report = vw.report.emulation
    assert report.tasks == 4 * 10 and 0.0 <= report.overrun_fraction <= 1.0


def test_an_emulated_device_hands_on_its_results_when_its_pass_ends_and_its_host_goes_on_meanwhile(tmp_path):
    model = models.mlp()
    vw = VirtualWorker(model, "0.2,0.2", num_in_flight=2, optimizer="sgd", loss=LOSS, dilation=4.0, timeout_s=60)
    vw.train(iter(random_batches(model, 8)), 8, trace=True)
    path = tmp_path / "trace.json"
    vw.trace.write(str(path))
    spans = {}
    for e in json.loads(path.read_text())["traceEvents"]:
        if e["ph"] == "X":
            spans[(e["tid"], e["name"])] = (e["ts"], e["ts"] + e["dur"])
    for p in range(1, 9):
        # Stage 1's pass of p starts on its device after stage 0's pass of p ended on its own, and
        # stage 0's backward pass after stage 1's (the activation and the gradient went on then).
        assert spans[(1, f"Forward({p})")][0] >= spans[(0, f"Forward({p})")][1]
        assert spans[(0, f"Backward({p})")][0] >= spans[(1, f"Backward({p})")][1]
    # The host issued stage 0's update while its device still ran the backward pass.
    overlapped = [p for p in range(1, 9) if spans[(0, f"ApplyUpdate({p})")][0] < spans[(0, f"Backward({p})")][1]]
    assert len(overlapped) >= 6


def test_stage_state_lives_on_its_device_apart_from_the_keras_model():
    model = models.cnn()
    before = [v.numpy() for v in model.weights]
    vw = VirtualWorker(model, "1,1,1", num_in_flight=2, optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                       loss=LOSS, dilation=1.0)
    vw._build(batch_size=4)
    for rt, device in zip(vw.runtimes, vw.device_names):
        owned = rt.trainable + rt.non_trainable + list(rt.optimizer.variables)
        assert owned and all(v.value.device.endswith(device[len("/device:"):]) for v in owned)
        model_vars = {id(v.value) for v in rt.stage.trainable_variables + rt.stage.non_trainable_variables}
        assert not model_vars & {id(v.value) for v in owned}
    vw.train(iter(random_batches(model, 3)), 3)
    # Training changed the model's weights only through the final write-back.
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_weights))


def test_single_threaded_stages_train_the_same_and_need_one_device():
    keras.utils.set_random_seed(5)
    model = models.mlp()
    batches = random_batches(model, 12)
    want, _ = stale_sgd_reference(model, batches, 2, keras.optimizers.SGD(0.1))
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=2, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       single_threaded_stages=True, timeout_s=60)
    vw.train(iter(batches), 12)
    for got, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), w, atol=1e-5)
    with pytest.raises(ValueError, match="single_threaded_stages needs every stage on one device"):
        VirtualWorker(model, "1,1", optimizer="sgd", loss=LOSS, single_threaded_stages=True)
