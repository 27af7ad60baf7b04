"""A virtual worker's process switching plans (hetpipe_tf.distributed.protocol.Rebuild), its side run
in this process over a pipe: the orders a run that re-plans sends (Job, Train, Drain,
GetOptimizerState; new servers; Rebuild; Train) end within 1e-6 of the same run switched in one
process (a new WSPRunner resumed from the drained state), the worker keeping its data stream where
it stood and each update reported with its minibatch and its stages' compute, which a run that does
not re-plan is not sent. The whole switch with a process per worker is
tests/runtime/test_replan_processes.py (slow)."""
import multiprocessing

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.distributed import protocol
from hetpipe_tf.distributed.dataset_transfer import dataset_to_bytes
from hetpipe_tf.distributed.worker_process import _Worker
from hetpipe_tf.runtime.checkpoint import PlanCuts
from hetpipe_tf.runtime.model_transport import pack_model
from hetpipe_tf.runtime.replan.runner import rebuilt_in_process
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.stage_rewrite import split_model
from hetpipe_tf.runtime.virtual_worker import Dilation
from hetpipe_tf.runtime.wsp_runner import WSPRunner, server_layout

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
FIRST, SECOND = ((0, 2), 1), ((0, 1, 2), 2)  # (cut, Nm) of the plan before and after the switch
SAME = ((0, 2), 1)  # a plan after the switch whose worker is kept: the same cut, an Nm its stashes hold
BEFORE, AFTER = 4, 6  # minibatches trained under each


def _model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _data():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((40, 6)).astype("float32"), rng.integers(0, 3, 40)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True)


def _plan(cut_nm):
    cut, nm = cut_nm
    spec = WorkerSpec(",".join(["cpu"] * len(cut)), tuple("/device:CPU:0" for _ in cut), boundaries=cut,
                      references=((1.0, 1.0),) * len(cut))
    return spec, RunConfig(num_in_flight=nm, optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS,
                           dilation=1, timeout_s=60)


def _in_one_process(second):
    model = _model()
    spec, config = _plan(FIRST)
    first = WSPRunner(model, [spec], config, ["/device:CPU:0"])
    first.begin_fit([_data()], [0])
    first.train_fit([BEFORE])
    first.drain()
    state = first.run_state(0, [BEFORE], PlanCuts(FIRST[1], (FIRST[0],)))
    spec, config = _plan(second)
    runner = rebuilt_in_process(lambda plan, c: WSPRunner(model, [spec], c, ["/device:CPU:0"]))(
        first, None, config, state)
    runner.train_fit([AFTER])
    return [v.numpy() for v in model.variables], list(runner.servers.clock.clocks()[0])


def _servers(model, cut_nm):
    spec, config = _plan(cut_nm)
    staged = split_model(model, boundaries=spec.boundaries, num_stages=len(spec.boundaries))
    return spec, config, server_layout(staged, spec, config, ["/device:CPU:0"], [len(spec.boundaries)]).servers(model)


def _train(chief, worker, order):
    """Trains by `order` in the worker; returns its Done messages."""
    worker.serve(order)
    done = []
    while True:
        message = chief.recv()
        if isinstance(message, protocol.Done):
            done.append(message)
        elif isinstance(message, protocol.Finished):
            return done
        elif not isinstance(message, protocol.Started):
            raise AssertionError(f"the worker sent {message!r}")


def _ask(chief, worker, order):
    worker.serve(order)
    answer = chief.recv()
    assert isinstance(answer, order.answer), answer
    return answer


@pytest.mark.parametrize("second, keep", [(SECOND, False), (SAME, True)], ids=["rebuilt", "kept"])
def test_a_worker_process_rebuilds_under_a_new_plan_as_a_new_runner_in_one_process(second, keep):
    """Rebuilt under other cuts, or kept as built (its stages and their traced calls) under the same."""
    expected, clocks = _in_one_process(second)

    model = _model()
    chief, end = multiprocessing.Pipe()
    worker = _Worker(end)
    spec, config, servers = _servers(model, FIRST)
    _ask(chief, worker, protocol.Job(0, spec, config, pack_model(model), model.get_weights(), servers.layout(),
                                     dataset_to_bytes(_data()), stage_compute=True))
    done = _train(chief, worker, protocol.Train(dataset_to_bytes(_data()), BEFORE, Dilation(1.0), False))
    assert [d.minibatch for d in done] == list(range(1, BEFORE + 1)) and all(len(d.compute) == 2 for d in done)
    _ask(chief, worker, protocol.Drain())
    optimizer = _ask(chief, worker, protocol.GetOptimizerState()).state
    servers.write_to(model)
    spec, config, new_servers = _servers(model, second)
    new_servers.advance_clocks(servers.clock.clocks()[0])
    built = worker.runner.vws[0]
    _ask(chief, worker, protocol.Rebuild(spec, config, model.get_weights(), new_servers.layout(), optimizer, keep))
    assert (worker.runner.vws[0] is built) == keep and worker.runner.vws[0].config == config
    done = _train(chief, worker, protocol.Train(None, AFTER, Dilation(1.0), False))  # its data where it stood
    assert len(done) == AFTER and all(len(d.compute) == len(second[0]) for d in done)
    new_servers.write_to(model)
    assert list(new_servers.clock.clocks()[0]) == clocks
    for a, b in zip(expected, [v.numpy() for v in model.variables]):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_a_worker_of_a_run_that_does_not_replan_reports_its_updates_without_stage_compute():
    model = _model()
    chief, end = multiprocessing.Pipe()
    worker = _Worker(end)
    spec, config, servers = _servers(model, FIRST)
    _ask(chief, worker, protocol.Job(0, spec, config, pack_model(model), model.get_weights(), servers.layout(),
                                     dataset_to_bytes(_data())))
    done = _train(chief, worker, protocol.Train(dataset_to_bytes(_data()), BEFORE, Dilation(1.0), False))
    assert [d.minibatch for d in done] == list(range(1, BEFORE + 1)) and all(d.compute == () for d in done)
