"""A run that re-plans in this process (slow: each builds and traces its virtual workers two to four
times on the emulated ``local`` cluster, a minute or more on a loaded machine; CI's subset runs the
pure parts in test_replan_decide.py).

Covered here: a switch (a device 3x slower for good, found by the watch, decided by the planner and
simulator) of one virtual worker's run ends within 1e-6 of the same run checkpointed on disk at the
switch's drained point and resumed under the new plan (the in-memory state, the handed-over data
streams and the new plan's runner against Checkpoints and Dataset.skip); every worker's share of
every epoch trained once and every wave pushed once (the servers' clocks); Keras's callbacks see
one run of every batch and epoch; a trigger found at an epoch's end is decided before the next
epoch (after its callbacks and checkpoint); a re-plan that finds nothing better leaves the run on
its plan and is not decided again for the same slowdown."""
import dataclasses
import shutil
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.distributed.cluster_devices import ClusterDevices
from hetpipe_tf.pipeline.emulation import PersistentSlowdown, RunProgress
from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime import plan_assembly as assembly
from hetpipe_tf.runtime.checkpoint import Checkpoints, PlanCuts, epoch_shares
from hetpipe_tf.runtime.fit_loop import FitOptions, fit
from hetpipe_tf.runtime.replan.decide import SwitchRule, nominal_devices
from hetpipe_tf.runtime.replan.runner import ReplanningRunner, ReplanOptions
from hetpipe_tf.runtime.replan.watch import WatchRule
from hetpipe_tf.runtime.worker_data import worker_shards
from hetpipe_tf.runtime.wsp_runner import WSPRunner
from tests.helpers.replan import given_profile as _given_profile

BATCH, STEPS, EPOCHS, SLOWED = 32, 56, 2, "host-F:1"
#: With tanh layers at this rate the run does not amplify rounding: its weights move by about 1e-7
#: when the initial weights are scaled by 1 + 1e-7 (relu layers at 0.05 moved by 0.07), while one
#: minibatch's update more or less moves them by 1e-4 or more.
LR = 0.01


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(512, activation="tanh") for _ in range(6)]
                            + [keras.layers.Dense(4)])


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype("float32")
    y = rng.integers(0, 4, STEPS * BATCH)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True).repeat()


@pytest.fixture(scope="module")
def setup():
    return _setup(None)


@pytest.fixture(scope="module")
def one_worker():
    """One virtual worker of the four devices: its run does not depend on when another worker's
    pushes land (with two, a pull of wave c may hold the other's wave c + 1, as timing decides).
    Its run is still the same only up to rounding: a merge of pulled weights (§5) comes when the
    pull is answered, after as many of the stage's local updates as timing allows, so two runs
    equal in exact arithmetic round apart, which the model and rate here keep below 1e-6 (`LR`)."""
    return _setup(4)


def _setup(vw_size):
    cluster = load_cluster("local")
    devices = ClusterDevices(cluster, "in_process")
    model = _model()
    training = assembly.Training(keras.optimizers.SGD(LR, momentum=0.9),
                                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    profile = _given_profile(model)
    request = PlanRequest(policy="ed", vw_size=vw_size, staleness_bound=0, dilation=1.0)
    plan = assembly.assemble_plan(cluster, request, training.optimizer, profile)
    return model, [v.numpy() for v in model.variables], devices, request, plan, training


def _factory(model, devices, slowdowns):
    def make(plan, config):
        specs = []
        for w in range(len(plan.workers)):
            own = nominal_devices(plan, w)
            spec, _ = devices.worker(w, own, plan.node_boundaries(w), plan.host_pass_seconds(w))
            specs.append(dataclasses.replace(spec, slowdown=PersistentSlowdown.for_devices(slowdowns,
                                                                                         [d.name for d in own])))
        return WSPRunner(model, specs, config, devices.ps)
    return make


def _train_chunks(runner, chunks):
    """Trains `runner` on each chunk (minibatches of each worker) of the fit's data in turn, drained
    after each, as a re-planning run trains its chunks."""
    for chunk in chunks:
        runner.train(runner.fit_data(), list(chunk))
        runner.drain()


def _config(request, plan, training):
    return assembly.resolved_config(request, plan, PlanCuts.of_plan(plan), dataclasses.replace(
        training, optimizer=keras.optimizers.SGD(LR, momentum=0.9), timeout_s=120))


def _replanning(setup, factor, after, options):
    model, initial, devices, request, plan, training = setup
    for v, value in zip(model.variables, initial):
        v.assign(value)
    progress = RunProgress()
    slow = [PersistentSlowdown(SLOWED, factor, progress, after_minibatches=after)]
    runner = ReplanningRunner(plan, request, _config(request, plan, training), _factory(model, devices, slow),
                              options, progress=progress)
    runner.set_fit_length(STEPS * EPOCHS)
    return runner, slow


class _Seen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches, self.epochs = 0, []

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)


OPTIONS = ReplanOptions(watch=WatchRule(window_waves=2, baseline_waves=1), switch=SwitchRule(min_gain=0.0, payback=0.0),
                        chunk_minibatches=4)


@pytest.mark.slow
def test_a_switch_ends_as_a_checkpoint_resumed_under_the_new_plan_and_applies_each_update_once(one_worker, tmp_path):
    model, initial, devices, request, plan, training = one_worker
    runner, _ = _replanning(one_worker, 3.0, 14, OPTIONS)
    workers = len(plan.workers)
    seen = _Seen()
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss=training.loss)
    history = fit(runner, _data(), FitOptions(epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0, callbacks=[seen]))
    [switch] = runner.switches
    assert runner.decisions[0]["switch"] and runner.decisions[0]["slowed"][0]["device"] == SLOWED
    assert set(switch) >= {"drain_s", "plan_s", "state_s", "rebuild_s"}
    new_plan = runner.plan
    assert PlanCuts.of_plan(new_plan) != PlanCuts.of_plan(plan)
    # Keras saw one run; every worker trained its share of every epoch, no more, no less
    assert seen.batches == STEPS * EPOCHS and seen.epochs == list(range(EPOCHS)) and len(history.epoch) == EPOCHS
    assert runner.positions == epoch_shares(EPOCHS, STEPS, workers)
    # each wave's update pushed once: every worker's clock is its chunks' waves under their plans' Nm
    waves = [sum(-(-n[w] // nm) for nm, n in runner.chunk_log) for w in range(workers)]
    assert list(runner.runner.servers.clock.clocks()[0]) == waves
    before, after = runner.chunk_log[:switch["after_chunks"]], runner.chunk_log[switch["after_chunks"]:]
    assert [sum(n[w] for _, n in before) for w in range(workers)] == switch["positions"]
    assert {nm for nm, _ in after} == {new_plan.num_in_flight}
    switched = [v.numpy() for v in model.variables]

    # The same run, checkpointed on disk at the switch's drained point and resumed under the new plan
    for v, value in zip(model.variables, initial):
        v.assign(value)
    progress = RunProgress()
    slow = [PersistentSlowdown(SLOWED, 3.0, progress, after_minibatches=14)]
    make = _factory(model, devices, slow)
    shards = worker_shards(_data(), workers)
    first = make(plan, _config(request, plan, training))
    first.begin_fit(shards, [0] * workers)
    _train_chunks(first, [chunk for _, chunk in before])
    done = switch["positions"]
    saved = Checkpoints(tmp_path)
    saved.save(first.run_state(0, done, PlanCuts.of_plan(plan)))
    state = saved.restore_model(model)
    config = runner.config
    second = make(new_plan, config)
    second.begin_fit(shards, state.positions)
    second.resume(state)
    _train_chunks(second, [chunk for _, chunk in after])
    for a, b in zip(switched, [v.numpy() for v in model.variables]):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_replan_that_finds_nothing_better_leaves_the_run_as_it_was(setup):
    model, initial, devices, request, plan, training = setup
    # nothing is twice as fast: one of a worker's two devices at half speed gains a re-plan under 1.5x
    options = dataclasses.replace(OPTIONS, switch=SwitchRule(min_gain=1.0))
    runner, _ = _replanning(setup, 2.0, 14, options)
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss=training.loss)
    fit(runner, _data(), FitOptions(epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0))
    assert runner.decisions and not any(d["switch"] for d in runner.decisions)
    assert len(runner.decisions) == 1  # the same slowdown is decided once (the watch knows it)
    assert runner.switches == [] and runner.plan is plan and runner.positions == epoch_shares(EPOCHS, STEPS, 2)
    assert runner.stats()[0]["replan_decisions"] == runner.decisions



class _SavedBeforeTheSwitch(Checkpoints):
    """Checkpoints that record, at the start and the end of each save, how many switches the run had
    made, and take their time over it (a slow disk): a switch during a save would show."""

    def __init__(self, directory, runner):
        super().__init__(directory)
        self.runner, self.during = runner, []

    def save(self, state):
        before = len(self.runner.switches)
        time.sleep(0.5)
        path = super().save(state)
        self.during.append((before, len(self.runner.switches), state.plan))
        if state.epoch == 1:  # the directory as a run stopped after the first epoch leaves it
            shutil.copytree(self.directory, f"{self.directory}-epoch1")
        return path


@pytest.mark.slow
def test_a_trigger_at_an_epochs_end_waits_for_its_checkpoint_which_resumes_exactly(one_worker, tmp_path):
    """One chunk per epoch: the slowdown found in the first epoch is decided at its end, after its
    callbacks (Keras's ModelCheckpoint) and its checkpoint are saved from the drained state under the
    first plan; that checkpoint, resumed under the new plan, ends as the switched run."""
    model, initial, devices, request, plan, training = one_worker
    workers = len(plan.workers)
    runner, _ = _replanning(one_worker, 3.0, 14, dataclasses.replace(OPTIONS, chunk_minibatches=STEPS))
    saved = _SavedBeforeTheSwitch(tmp_path / "run", runner)
    keras_saved = keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.weights.h5"), save_weights_only=True)
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss=training.loss)
    fit(runner, _data(), FitOptions(epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0, callbacks=[keras_saved],
                                    checkpoints=saved, plan=PlanCuts.of_plan(plan)))
    [switch] = runner.switches
    assert switch["positions"] == epoch_shares(1, STEPS, workers) and switch["after_chunks"] == 1
    # the first epoch's save ran whole before the switch, of the first plan's state; the second's after it
    assert [(a, b) for a, b, _ in saved.during] == [(0, 0), (1, 1)]
    assert saved.during[0][2] == PlanCuts.of_plan(plan) and saved.during[1][2] == PlanCuts.of_plan(runner.plan)
    assert list(runner.runner.servers.clock.clocks()[0]) == [
        sum(-(-n[w] // nm) for nm, n in runner.chunk_log) for w in range(workers)]
    switched = [v.numpy() for v in model.variables]

    # The first epoch's checkpoint (the one Keras's callback saw too), resumed under the new plan
    state = Checkpoints(tmp_path / "run-epoch1").restore_model(model)
    assert state.epoch == 1 and state.positions == switch["positions"]
    keras_model = _model()
    keras_model.load_weights(str(tmp_path / "epoch1.weights.h5"))
    for a, b in zip(keras_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    progress = RunProgress()
    make = _factory(model, devices, [PersistentSlowdown(SLOWED, 3.0, progress, after_minibatches=0)])
    second = make(runner.plan, runner.config)
    second.begin_fit(worker_shards(_data(), workers), state.positions)
    second.resume(state)
    _train_chunks(second, [chunk for _, chunk in runner.chunk_log[1:]])
    for a, b in zip(switched, [v.numpy() for v in model.variables]):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_switch_keeps_a_worker_whose_cuts_stay_and_ends_as_a_checkpoint_resumed(one_worker, tmp_path):
    """A worker whose devices and cuts stay goes on under the new Nm with its stages as built (their
    state and traced calls), and ends as a checkpoint at the same point resumed by a worker built anew;
    a worker whose cuts change is built anew."""
    model, initial, devices, request, plan, training = one_worker
    for v, value in zip(model.variables, initial):
        v.assign(value)
    make = _factory(model, devices, [])
    config = _config(request, plan, training)
    first = make(plan, config)
    first.begin_fit(worker_shards(_data(), 1), [0])
    _train_chunks(first, [[8]] * 2)
    state = first.run_state(0, [16], PlanCuts.of_plan(plan))
    Checkpoints(tmp_path).save(state)

    fewer = config.replace(num_in_flight=2)
    kept = make(plan, fewer)
    assert kept.keep_workers(first) == [0] and kept.vws[0] is first.vws[0] and kept.vws[0].num_in_flight == 2
    kept.continue_fit(first.fit_data())
    kept.resume(state)
    _train_chunks(kept, [[8]] * 3)
    kept_weights = [v.numpy() for v in model.variables]
    # a worker of other cuts, or of more minibatches in flight than its stashes hold, is built anew
    spec = kept.vws[0].spec
    cut = list(spec.boundaries)
    moved = next(i for i in range(1, len(cut) - 1) if cut[i] - 1 > cut[i - 1])
    cut[moved] -= 1
    recut = WSPRunner(model, [dataclasses.replace(spec, boundaries=tuple(cut))], fewer, devices.ps)
    assert recut.keep_workers(kept) == []
    assert make(plan, config.replace(num_in_flight=8)).keep_workers(kept) == []

    state = Checkpoints(tmp_path).restore_model(model)
    built = make(plan, fewer)
    built.begin_fit(worker_shards(_data(), 1), state.positions)
    built.resume(state)
    _train_chunks(built, [[8]] * 3)
    for a, b in zip(kept_weights, [v.numpy() for v in model.variables]):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
