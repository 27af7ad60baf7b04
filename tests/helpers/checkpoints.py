"""Runs of HetPipeStrategy that checkpoint every epoch: two virtual workers whose result does
not depend on the threads' timing, and a run stopped and resumed beside one never stopped."""
import keras
import numpy as np
import tensorflow as tf

from hetpipe_tf.api.strategy import HetPipeStrategy
from tests.helpers.models import constant_gradient_model, mean_output
from tests.helpers.references import max_difference


def two_workers(directory, resume=False, **plan):
    """2 virtual workers of 2 host-CPU stages (no pacing), D = 0, Adam on a model whose gradients depend on
    the data only, so that the result does not depend on the threads' timing (nor on Nm or the cuts);
    `plan` overrides the plan's arguments."""
    strategy = HetPipeStrategy(**dict(dict(cluster="local_cpu", policy="np", vw_size=2, staleness_bound=0,
                                           num_in_flight=2, launch="in_process", dilation=1,
                                           checkpoint_dir=directory, resume=resume), **plan))
    with strategy.scope():
        x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
        data = tf.data.Dataset.from_tensor_slices((x, np.zeros(64, "int64"))).batch(4, drop_remainder=True)
        model = constant_gradient_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=mean_output)
    return strategy, model, data


def stopped_and_resumed(build, tmp_path, epochs, stop_at, steps_per_epoch):
    """`build`'s run (strategy, model, data) trained `epochs` epochs in one go, and again stopped
    after `stop_at` and resumed by a new strategy and model: the most the two runs' weights differ
    by, the resumed run's weights and the whole run's."""
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
    return max_difference(got, expected), got, expected
