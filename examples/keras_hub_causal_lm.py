"""A keras_hub causal language model (GPT-2's architecture) cut into stages: AdamW, a global clip
norm across the stages, and bfloat16 mixed precision.

The model is built from a configuration with random weights (no preset is downloaded) and learns
to continue counting sequences (3 4 5 6 ... modulo the vocabulary). GPT-2 uses its token
embedding again, reversed, for the logits: the stages that hold its two uses each keep a replica,
whose gradients are summed every minibatch, and the global clip norm is taken over every stage's
gradients, as Keras takes it over the whole model's.

    python examples/keras_hub_causal_lm.py                                  # 3 epochs
    python examples/keras_hub_causal_lm.py --epochs=1 --steps_per_epoch=4   # as the tests run it
"""
from absl import app, flags

flags.DEFINE_string("devices", "1@256M,0.5@256M", "The virtual worker's devices (hetpipe_tf.parse_devices).")
flags.DEFINE_integer("epochs", 3, "Epochs to train.")
flags.DEFINE_integer("steps_per_epoch", None, "Minibatches per epoch (None: the whole data set).")
FLAGS = flags.FLAGS
VOCABULARY, LENGTH = 64, 16


def counting_sequences(n, batch_size=16):
    """(inputs, next tokens): sequences that count up from a random start, modulo the vocabulary."""
    import numpy as np
    import tensorflow as tf

    starts = np.random.default_rng(0).integers(0, VOCABULARY, size=(n, 1))
    tokens = ((starts + np.arange(LENGTH + 1)) % VOCABULARY).astype("int32")
    inputs = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, LENGTH), "int32")}
    return tf.data.Dataset.from_tensor_slices((inputs, tokens[:, 1:])).batch(batch_size, drop_remainder=True)


def build_model():
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=64,
                                             intermediate_dim=128, max_sequence_length=LENGTH, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def main(argv):
    del argv
    import keras

    import hetpipe_tf

    devices = hetpipe_tf.parse_devices(FLAGS.devices)
    hetpipe_tf.configure_tensorflow_devices(devices)
    keras.config.set_dtype_policy("mixed_bfloat16")  # weights in float32, compute in bfloat16
    keras.utils.set_random_seed(0)
    train, test = counting_sequences(512), counting_sequences(64)
    vw = hetpipe_tf.VirtualWorker(build_model(), devices=devices, num_in_flight=2,
                                  optimizer=keras.optimizers.AdamW(3e-3, weight_decay=0.01, global_clipnorm=1.0),
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                  metrics=["sparse_categorical_accuracy"])
    print(vw.describe())
    vw.fit(train, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, validation_data=test)


if __name__ == "__main__":
    app.run(main)
