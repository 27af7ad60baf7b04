"""A model compiled for the bundled digits in a HetPipeStrategy's scope, and a callback that
counts what Keras's fit calls."""
import keras

from hetpipe_tf.cli import models
from hetpipe_tf.data import datasets


def compiled_digits(strategy, name="mlp"):
    """The digits' shuffled train split and test split (batches of 16), and the zoo's model
    `name` compiled with SGD(0.05), all made in `strategy`'s scope."""
    with strategy.scope():
        train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=16, shuffle=True, seed=0)
        test = datasets.load_image_classification("hetpipe_digits", "test", batch_size=16)
        keras.utils.set_random_seed(0)
        model = models.build_model(name, tuple(train.element_spec[0].shape[1:]), 10)
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return train, test, model


class Counter(keras.callbacks.Callback):
    """Each epoch's logs and the number of minibatches fit reported."""

    def __init__(self):
        super().__init__()
        self.epochs, self.batches = [], 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
