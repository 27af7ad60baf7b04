"""Several virtual workers under Wave Synchronous Parallel, saved at every epoch's end and resumed.

``HetPipeStrategy`` plans the run on the ``local`` cluster description (four emulated devices on
two nodes: two virtual workers of two stages each under the ED policy), starts its tasks and a
process per virtual worker, and trains with staleness bound D = 1. With ``--checkpoint_dir`` the
run is saved at every epoch's end; ``--resume`` continues the newest checkpoint (the global
weights, every stage's optimizer state, the clocks and each worker's position in the data).

    python examples/wsp_checkpoint_resume.py --checkpoint_dir=/tmp/run --epochs=2
    python examples/wsp_checkpoint_resume.py --checkpoint_dir=/tmp/run --epochs=4 --resume   # epochs 3 and 4

``--launch=in_process`` runs every worker and server as threads of this process (quicker, for a
try-out; the tests run it so).
"""
from absl import app, flags

flags.DEFINE_string("checkpoint_dir", None, "Where the run is saved.", required=True)
flags.DEFINE_bool("resume", False, "Continue the newest checkpoint in --checkpoint_dir.")
flags.DEFINE_integer("epochs", 2, "The epoch to train up to (Keras's `epochs`).")
flags.DEFINE_integer("steps_per_epoch", None, "Minibatches per epoch (None: the whole data set).")
flags.DEFINE_enum("launch", "processes", ["processes", "in_process"], "Where the tasks run.")
flags.DEFINE_float("dilation", None, "Of the emulated devices (None: calibrated by probe runs before training).")
FLAGS = flags.FLAGS


def build_model():
    import keras

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="digits_cnn")


def main(argv):
    del argv
    import keras

    import hetpipe_tf
    from hetpipe_tf.data.datasets import load_image_classification  # the handwritten digits bundled

    strategy = hetpipe_tf.HetPipeStrategy(cluster="local", policy="ed", staleness_bound=1, launch=FLAGS.launch,
                                          dilation=FLAGS.dilation, checkpoint_dir=FLAGS.checkpoint_dir,
                                          resume=FLAGS.resume)
    with strategy.scope():  # the data and the model are made inside it
        train = load_image_classification("hetpipe_digits", "train", batch_size=32)
        test = load_image_classification("hetpipe_digits", "test", batch_size=32)
        keras.utils.set_random_seed(0)
        model = build_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, validation_data=test)
    print(strategy.describe())
    print("epochs trained in this call:", [e + 1 for e in history.epoch])


if __name__ == "__main__":
    app.run(main)
