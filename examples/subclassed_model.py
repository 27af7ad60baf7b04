"""A model written as a class (``class TinyLM(keras.Model)``) cut into two pipeline stages.

The stage rewrite traces the model's ``call`` on symbolic inputs into a layer graph: the ``for``
loop over blocks unrolls, ``keras.ops`` calls (the residual adds, the causal mask) become nodes of
their own, and the stages hold the model's own layers, so the trained weights end in the model
object, which Keras then evaluates itself.

    python examples/subclassed_model.py                                   # 3 epochs
    python examples/subclassed_model.py --epochs=2 --steps_per_epoch=4 --blocks=1   # as the tests run it
"""
import keras
from absl import app, flags
from keras import ops

flags.DEFINE_string("devices", "cpu,cpu", "The virtual worker's devices (hetpipe_tf.parse_devices).")
flags.DEFINE_integer("epochs", 3, "Epochs to train.")
flags.DEFINE_integer("steps_per_epoch", None, "Minibatches per epoch (None: the whole data set).")
flags.DEFINE_integer("blocks", 2, "Transformer blocks.")
FLAGS = flags.FLAGS

LENGTH, VOCABULARY = 16, 64


class TinyLM(keras.Model):
    """Token and position embeddings, blocks of causal self-attention and an MLP, a vocabulary head."""

    def __init__(self, vocabulary=VOCABULARY, dim=32, blocks=2, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, dim, name="tokens")
        self.positions = keras.layers.Embedding(256, dim, name="positions")
        self.attention = [keras.layers.MultiHeadAttention(4, dim // 4, name=f"attention{i}") for i in range(blocks)]
        self.norms = [keras.layers.LayerNormalization(name=f"norm{i}") for i in range(blocks)]
        self.mlps = [keras.layers.Dense(dim, activation="gelu", name=f"mlp{i}") for i in range(blocks)]
        self.head = keras.layers.Dense(vocabulary, name="head")

    def call(self, ids):
        length = ops.shape(ids)[1]
        positions = ops.cumsum(ops.ones_like(ids), axis=1) - 1  # from the inputs, so that it is traced
        h = self.tokens(ids) + self.positions(positions)
        causal = ops.tril(ops.ones((length, length), dtype="bool"))
        for attention, norm, mlp in zip(self.attention, self.norms, self.mlps):
            h = h + attention(h, h, attention_mask=causal)
            h = h + mlp(norm(h))
        return self.head(h)


def make_dataset(sequences=256, batch_size=16):
    """Sequences that count up modulo the vocabulary and their next tokens: a task the model learns.
    Every minibatch has the same size (`drop_remainder=True`): a pipeline's stages are traced for it."""
    import numpy as np
    import tensorflow as tf

    start = np.random.default_rng(0).integers(0, VOCABULARY, size=(sequences, 1))
    ids = (start + np.arange(LENGTH + 1)) % VOCABULARY
    pairs = tf.data.Dataset.from_tensor_slices((ids[:, :-1].astype("int32"), ids[:, 1:]))
    return pairs.batch(batch_size, drop_remainder=True)


def main(argv):
    del argv
    import hetpipe_tf

    devices = hetpipe_tf.parse_devices(FLAGS.devices)
    hetpipe_tf.configure_tensorflow_devices(devices)
    keras.utils.set_random_seed(0)
    model = TinyLM(blocks=FLAGS.blocks)
    # Token ids are integers: the spec says so (a model built on a batch would give its shape, as floats).
    hetpipe_tf.trace_model(model, input_spec=keras.Input((LENGTH,), dtype="int32"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    vw = hetpipe_tf.VirtualWorker(model, devices=devices, num_in_flight=2, loss=loss,
                                  optimizer=keras.optimizers.Adam(3e-3, global_clipnorm=1.0))
    print(vw.describe())
    history = vw.fit(make_dataset(), epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, verbose=0)
    print("loss per epoch:", [round(v, 3) for v in history.history["loss"]])
    # The trained weights are the model's own: Keras evaluates it on its own.
    model.compile(loss=loss)
    print("Keras's evaluate:", model.evaluate(make_dataset(), verbose=0, return_dict=True))


if __name__ == "__main__":
    app.run(main)
