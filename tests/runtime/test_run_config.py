"""A RunConfig reaches a worker's process pickled: its optimizer as Keras serializes it, a name as it is."""
import pickle

import keras

from hetpipe_tf.runtime.run_config import RunConfig


def test_an_optimizer_reaches_a_worker_process_as_keras_serializes_it():
    config = RunConfig(optimizer=keras.optimizers.Adam(0.003, beta_1=0.8, global_clipnorm=1.0))
    back = pickle.loads(pickle.dumps(config))
    assert isinstance(back.optimizer, keras.optimizers.Adam) and back.optimizer is not config.optimizer
    assert keras.optimizers.serialize(back.optimizer) == keras.optimizers.serialize(config.optimizer)


def test_an_optimizers_name_reaches_a_worker_process_as_the_name():
    back = pickle.loads(pickle.dumps(RunConfig(optimizer="adam")))
    assert back.optimizer == "adam"
