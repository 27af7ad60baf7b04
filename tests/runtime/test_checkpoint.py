"""Checkpoint and resume of a run of virtual workers (hetpipe_tf.runtime.checkpoint): a run
stopped after some epochs and resumed by a new strategy and model ends with the weights of
a run that was never stopped (issue 12, items 1 and 3)."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.cli import models
from hetpipe_tf.data import datasets
from hetpipe_tf.runtime.checkpoint import Checkpoints, RunState
from tests.runtime.test_wsp_runner import constant_gradient_model, mean_output


def _two_workers(directory, resume=False):
    """2 virtual workers (ED on the local cluster), D = 0, Adam on a model whose gradients depend on
    the data only, so that the result does not depend on the threads' timing."""
    strategy = HetPipeStrategy(cluster="local", policy="ed", staleness_bound=0, num_in_flight=2,
                               launch="in_process", dilation=1, checkpoint_dir=directory, resume=resume)
    with strategy.scope():
        x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
        data = tf.data.Dataset.from_tensor_slices((x, np.zeros(64, "int64"))).batch(4, drop_remainder=True)
        model = constant_gradient_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=mean_output)
    return strategy, model, data


def _one_worker(directory, resume=False):
    """One virtual worker of 4 stages at Nm = 2, SGD with momentum on the digits, no shuffling."""
    strategy = HetPipeStrategy(cluster="local", policy="ed", vw_size=4, num_in_flight=2, staleness_bound=0,
                               launch="in_process", dilation=1, checkpoint_dir=directory, resume=resume)
    with strategy.scope():
        data = datasets.load_image_classification("hetpipe_digits", "train", batch_size=16, shuffle=False)
        keras.utils.set_random_seed(0)
        model = models.build_model("mlp", tuple(data.element_spec[0].shape[1:]), 10)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return strategy, model, data


def _stopped_and_resumed(build, tmp_path, epochs, stop_at, steps_per_epoch):
    whole, model, data = build(str(tmp_path / "whole"))
    model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    expected = [v.numpy() for v in model.variables]
    _, model, data = build(str(tmp_path / "stopped"))
    model.fit(data, epochs=stop_at, steps_per_epoch=steps_per_epoch, verbose=0)
    resumed, model, data = build(str(tmp_path / "stopped"), resume=True)
    history = model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    assert len(history.history["loss"]) == epochs - stop_at  # Keras's initial_epoch: epochs stop_at..epochs-1
    assert resumed.runner.servers.clock.clocks() == whole.runner.servers.clock.clocks()
    got = [v.numpy() for v in model.variables]
    return max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected)), got, expected


def test_two_workers_resumed_end_with_the_weights_of_an_uninterrupted_run(tmp_path):
    diff, got, expected = _stopped_and_resumed(_two_workers, tmp_path, epochs=4, stop_at=2, steps_per_epoch=16)
    assert diff <= 1e-6, diff
    assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(got, _two_workers(None)[1].get_weights()))  # it trained
    saved = sorted(os.listdir(tmp_path / "whole"))
    assert saved == ["checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index", "ckpt-4.data-00000-of-00001",
                     "ckpt-4.index"], saved  # every epoch, the newest two kept
    state = Checkpoints(str(tmp_path / "whole")).latest()
    assert state.epoch == 4 and state.positions == [32, 32] and state.clocks == [16, 16]
    assert len(state.optimizers) == 2 and all(len(w) == 2 for w in state.optimizers)


@pytest.mark.slow
def test_one_worker_at_nm_2_resumed_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    diff, _, _ = _stopped_and_resumed(_one_worker, tmp_path, epochs=3, stop_at=1, steps_per_epoch=10)
    assert diff <= 1e-6, diff
