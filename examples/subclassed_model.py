"""A subclassed Keras model (``class TinyLM(keras.Model)``) cut into pipeline stages.

HetPipe's stage rewrite traces the model's ``call`` on symbolic inputs into a layer graph: the
``for`` loop over blocks unrolls, ``keras.ops`` calls become nodes of their own, and the stages hold
the model's own layers, so the trained weights land in the model object. Run:

    python examples/subclassed_model.py --stages 2 --epochs 3
"""
import argparse

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import hetpipe_tf


class TinyLM(keras.Model):
    """Token and position embeddings, blocks of causal self-attention and an MLP, a vocabulary head."""

    def __init__(self, vocabulary=64, dim=32, blocks=2, **kwargs):
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


def dataset(n: int, batch: int, length: int, vocabulary: int) -> tf.data.Dataset:
    """Sequences that count up modulo the vocabulary and their next tokens (a task the model learns),
    `n` minibatches of `batch`."""
    start = np.random.default_rng(0).integers(0, vocabulary, size=(n * batch, 1))
    ids = (start + np.arange(length + 1)) % vocabulary
    pairs = tf.data.Dataset.from_tensor_slices((ids[:, :-1].astype("int32"), ids[:, 1:]))
    return pairs.batch(batch, drop_remainder=True)


def main(stages: int = 2, epochs: int = 3, blocks: int = 2, length: int = 16, vocabulary: int = 64) -> list[float]:
    """Trains TinyLM cut into `stages` on this host's CPU for `epochs` of 16 minibatches; returns
    each epoch's loss."""
    keras.utils.set_random_seed(0)
    model = TinyLM(vocabulary=vocabulary, blocks=blocks)
    hetpipe_tf.trace_model(model, input_spec=keras.Input((length,), dtype="int32"))  # token ids, not floats
    vw = hetpipe_tf.VirtualWorker(model, ",".join(["cpu"] * stages), num_in_flight=stages,
                                  optimizer=keras.optimizers.Adam(3e-3, global_clipnorm=1.0),
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    print(vw.describe())
    losses = vw.fit(dataset(16, 8, length, vocabulary), epochs=epochs, verbose=0).history["loss"]
    print(f"loss per epoch {[round(v, 3) for v in losses]}; the trained weights are the model's own "
          f"({model.head.kernel.path}, {tuple(model.head.kernel.shape)})")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    main(args.stages, args.epochs, args.blocks)
