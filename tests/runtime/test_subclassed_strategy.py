"""A subclassed Keras model made in HetPipeStrategy's scope: traced on the data's inputs, profiled,
planned, trained in process, checkpointed and resumed."""
import functools

import keras
import numpy as np
import tensorflow as tf

from hetpipe_tf.api.strategy import HetPipeStrategy
from tests.helpers import subclassed
from tests.helpers.checkpoints import stopped_and_resumed
from tests.helpers.models import LOSS


def _one_worker(directory, resume=False, built=None):
    """One virtual worker of 4 host-CPU stages at Nm = 2; the model is not built: fit traces it on
    the data's element spec. `built` gets each (strategy, model)."""
    strategy = HetPipeStrategy(cluster="local_cpu", policy="ed", vw_size=4, num_in_flight=2, staleness_bound=0,
                               launch="in_process", dilation=1, checkpoint_dir=directory, resume=resume)
    with strategy.scope():
        x, y = (np.concatenate(part) for part in zip(*subclassed.vector_batches(16)))
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
        keras.utils.set_random_seed(0)
        model = subclassed.ResidualMLP()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    if built is not None:
        built.append((strategy, model))
    return strategy, model, data


def test_fit_plans_trains_checkpoints_and_resumes_a_subclassed_model(tmp_path):
    built = []
    diff, got, _ = stopped_and_resumed(functools.partial(_one_worker, built=built), tmp_path, epochs=2, stop_at=1,
                                       steps_per_epoch=8)
    assert diff <= 1e-6, diff
    strategy, model = built[-1]  # the resumed run's
    assert strategy.plan.profile.layer_names[:3] == ("inp", "hidden", "mix")  # then add, relu (keras.ops), out
    assert len(strategy.plan.profile.layer_names) == 6
    assert len(strategy.runner.vws) == 1 and strategy.runner.vws[0].staged.num_stages == 4
    for v in model.trainable_variables:  # the user's model holds the global weights
        np.testing.assert_array_equal(v.numpy(), strategy.runner.servers.variables[v.path].numpy())
    keras.utils.set_random_seed(0)
    initial = subclassed.ResidualMLP()
    initial(np.zeros((1, 12), "float32"))
    assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(got, initial.get_weights()))  # it trained
