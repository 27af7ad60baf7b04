"""The two seams: a schedule and a synchronisation scheme are registered objects.

Both toys live in this file only: adding them touches no package file. The toy schedule
runs one minibatch at a time (no pipelining); the toy scheme pushes every wave's update
and waits for every worker's, then merges, before the next wave starts (plain averaging
every wave). They train through VirtualWorker and WSPRunner, the same classes HetPipe and
WSP use.
"""
from dataclasses import dataclass, field

import keras
import numpy as np
import pytest

from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, Forward, Instruction, LoadMinibatch, RecvActivation, RecvGradient, RecvLabels,
    ReleaseWeights, SendActivation, SendGradient, StashWeights, Task, TaskStream)
from hetpipe_tf.pipeline.schedule import (
    NO_SYNC, PipelineSchedule, Schedule, StageProgram, SyncScheme, check_combination, combinations, get_schedule,
    get_sync, register_schedule, register_sync)
from hetpipe_tf.pipeline.simulator import simulate
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from hetpipe_tf.sync.wsp import PushBase
from tests.helpers import models
from tests.helpers.data import random_batches
from tests.helpers.models import LOSS, constant_gradient_model, mean_output
from tests.helpers.references import clone, exact_sgd_case
from tests.helpers.runners import wsp_runner


class OneAtATime(PipelineSchedule):
    """Minibatch p+1 starts only once every stage applied p: naive model parallelism."""

    name = "toy-one-at-a-time"
    instructions = frozenset({LoadMinibatch, RecvActivation, SendActivation, RecvLabels, RecvGradient,
                              SendGradient, Forward, Backward, ApplyUpdate, StashWeights, ReleaseWeights})

    def activations_held(self, position, num_stages, num_in_flight):
        return 1

    def weight_versions(self, num_in_flight):
        return 1

    def programs(self, num_stages, steps, num_in_flight, input_stages=(0,), snapshot_after=(),
                 sync=NO_SYNC):
        k, n, last = num_stages, steps, num_stages - 1

        def update(s, p):
            return ([SendGradient(p, to=s - 1)] if s else []) + [ReleaseWeights(p), ApplyUpdate(p)] + (
                [StashWeights(p + 1)] if p < n else []) + list(sync.after_update(p, n, 1))

        def entry(s, p):
            return [LoadMinibatch(p, labels_to=last)] if s == 0 else [RecvActivation(p)]

        programs = []
        for s in range(k):
            if s < last:
                streams = (
                    TaskStream("forward", n, lambda p, s=s: Task(s, "forward", p, tuple(
                        entry(s, p) + [Forward(p, waits=sync.forward_waits(p, 1)), SendActivation(p, to=s + 1)]))),
                    TaskStream("backward", n, lambda p, s=s: Task(s, "backward", p, tuple(
                        [RecvGradient(p), Backward(p)] + update(s, p)))))
            else:
                streams = (TaskStream("forward_backward", n, lambda p, s=s: Task(s, "forward_backward", p, tuple(
                    entry(s, p) + [RecvLabels(p), Forward(p, waits=sync.forward_waits(p, 1)), Backward(p)]
                    + update(s, p)))),)
            programs.append(StageProgram(s, (StashWeights(1),), streams + sync.streams(s, n, 1)))
        return Schedule(self.name, k, n, 1, tuple(programs))


@dataclass(frozen=True, repr=False)
class PushPullMerge(Instruction):
    """Pushes the wave's update, waits for every worker's, and merges: all in one."""

    def provides(self, stage):
        return ((stage, ("averaged", self.minibatch)),)


@dataclass(frozen=True)
class Binding:
    scheme: object
    worker: int
    servers: object
    timeout_s: float
    pull_waits: list = field(default_factory=list)


class EveryWave(SyncScheme):
    """Plain averaging: after each wave, push, wait for every worker's wave, merge."""

    name = "toy-every-wave"
    schedules = frozenset({"toy-one-at-a-time", "hetpipe"})
    instructions = frozenset({PushPullMerge})
    weight_copies = 1

    def after_update(self, minibatch, steps, num_in_flight):
        return (PushPullMerge(minibatch),)  # one minibatch per wave in this toy

    def forward_waits(self, minibatch, num_in_flight):
        return (("averaged", minibatch - 1),) if minibatch > 1 else ()

    def stage_state(self, runtime):
        return PushBase(runtime)  # the weights at the last push, as WSP keeps them

    def bind(self, worker, servers, staleness_bound, timeout_s):
        return Binding(self, worker, servers, timeout_s)

    def handlers(self, binding):
        def push_pull_merge(ex, s, ins):
            base, wave = ex.runtimes[s].sync_state, ins.minibatch - 1
            binding.servers.push(binding.worker, s, wave, base.paths, base.wave_update())
            values, clocks = binding.servers.pull(base.paths, wave, binding.timeout_s)
            base.merge(values, clocks, first_minibatch=ins.minibatch + 1)

        return {PushPullMerge: push_pull_merge}


TOY_SCHEDULE = register_schedule(OneAtATime())
TOY_SYNC = register_sync(EveryWave())


def test_registered_by_name_and_unknown_names_say_what_exists():
    assert get_schedule("toy-one-at-a-time") is TOY_SCHEDULE and get_sync("toy-every-wave") is TOY_SYNC
    with pytest.raises(ValueError, match="unknown schedule 'gpipe-typo'; the registered ones are: .*hetpipe"):
        get_schedule("gpipe-typo")


def test_a_scheme_names_the_schedules_it_works_with_and_other_pairs_get_the_list_of_those_that_exist():
    assert check_combination("toy-one-at-a-time", "toy-every-wave") == (TOY_SCHEDULE, TOY_SYNC)
    assert ("hetpipe", "wsp") in combinations() and ("toy-one-at-a-time", "none") in combinations()
    pairs = {(a, b) for a, b in combinations() if b == "toy-every-wave"}
    assert pairs == {("toy-one-at-a-time", "toy-every-wave"), ("hetpipe", "toy-every-wave")}

    class OtherSchedule(OneAtATime):
        name = "toy-other"

    register_schedule(OtherSchedule())
    with pytest.raises(ValueError, match=r"'toy-every-wave' does not work with the schedule 'toy-other'; "
                                         r"the combinations that exist \(schedule\+sync\): .*hetpipe\+wsp"):
        check_combination("toy-other", "toy-every-wave")
    with pytest.raises(ValueError, match="unknown sync 'bsp-typo'"):
        check_combination("hetpipe", "bsp-typo")


def test_the_toy_schedule_runs_in_the_simulator_one_minibatch_at_a_time():
    result = simulate(TOY_SCHEDULE.programs(3, 4, 1), lambda s, ins: 1.0 if isinstance(ins, (Forward, Backward)) else 0)
    assert result.makespan == pytest.approx(4 * 6)  # 3 forwards and 3 backwards per minibatch, none overlapping


def test_a_virtual_worker_trains_with_the_toy_schedule_like_keras():
    keras.utils.set_random_seed(7)
    model = models.mlp()
    ref = clone(model)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, jit_compile=False)
    batches = random_batches(model, 10)
    for x, y in batches:
        ref.train_on_batch(x, y)
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=60, schedule="toy-one-at-a-time")
    assert "toy-one-at-a-time schedule" in vw.schedule(10).format()
    vw.train(iter(batches), 10)
    for got, want in zip(model.weights, ref.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)


def test_virtual_workers_train_with_the_toy_schedule_and_the_toy_scheme_exactly():
    # Data-only gradients: whatever the order, the servers must end with w0 - lr * every gradient.
    model = constant_gradient_model()
    n = 6
    data, expected = exact_sgd_case(model, n)
    runner = wsp_runner(model, ("1,1", "1,1"), 1, 0, loss=mean_output, sync="toy-every-wave",
                        schedule=TOY_SCHEDULE)
    runner.train(data, n)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)
    assert runner.servers.clock.clocks()[0] == (n, n)
