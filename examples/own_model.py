"""Your own functional Keras model on your own tf.data pipeline, cut into two stages.

One virtual worker of two emulated devices (the second at half the host's speed) trains a small
classifier of made-up data with Nm = 2 minibatches in flight, through Keras's own ``fit``; the
trained weights end in the Keras model, which Keras then evaluates itself.

    python examples/own_model.py                                  # 5 epochs
    python examples/own_model.py --epochs=1 --steps_per_epoch=4   # as the tests run it

Real GPUs are ``--devices=gpu:0,gpu:1``.
"""
from absl import app, flags

flags.DEFINE_string("devices", "1@64M,0.5@64M", "The virtual worker's devices (hetpipe_tf.parse_devices).")
flags.DEFINE_integer("epochs", 5, "Epochs to train.")
flags.DEFINE_integer("steps_per_epoch", None, "Minibatches per epoch (None: the whole data set).")
FLAGS = flags.FLAGS


def make_datasets(batch_size=32):
    """Two classes of 16 features: the label says whether a weighted sum of the features is positive.
    Every minibatch has the same size (`drop_remainder=True`): a pipeline's stages are traced for it."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 16)).astype("float32")
    y = (x @ rng.normal(size=16) > 0).astype("int32")
    train = tf.data.Dataset.from_tensor_slices((x[:1792], y[:1792])).shuffle(1792, seed=0)
    test = tf.data.Dataset.from_tensor_slices((x[1792:], y[1792:]))
    return train.batch(batch_size, drop_remainder=True), test.batch(batch_size, drop_remainder=True)


def build_model():
    import keras

    inputs = keras.Input((16,), name="features")
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = keras.layers.Dense(64, activation="relu")(h)
    h = keras.layers.Dropout(0.1)(h)
    outputs = keras.layers.Dense(2, name="logits")(h)
    return keras.Model(inputs, outputs, name="own_model")


def main(argv):
    del argv
    import keras

    import hetpipe_tf

    # The devices first: each emulated device then gets a TensorFlow device of its own.
    devices = hetpipe_tf.parse_devices(FLAGS.devices)
    hetpipe_tf.configure_tensorflow_devices(devices)
    train, test = make_datasets()
    model = build_model()
    vw = hetpipe_tf.VirtualWorker(model, devices=devices, num_in_flight=2,
                                  optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    print(vw.describe())
    vw.fit(train, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, validation_data=test)
    # The trained weights are back in `model`: Keras evaluates it on its own.
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    print("Keras's evaluate:", model.evaluate(test, verbose=0, return_dict=True))


if __name__ == "__main__":
    app.run(main)
