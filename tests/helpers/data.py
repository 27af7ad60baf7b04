"""Random minibatches for the models of tests/helpers/models.py."""
import numpy as np
import tensorflow as tf

from tests.helpers.models import GPT2_LENGTH, GPT2_VOCABULARY


def random_batches(model, n, batch=8, seed=0):
    """`n` minibatches (x, labels of five classes), x shaped as `model`'s inputs (a tuple of
    them for a model of several)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        xs = [rng.normal(size=(batch,) + tuple(t.shape[1:])).astype("float32") for t in model.inputs]
        out.append((xs[0] if len(xs) == 1 else tuple(xs), rng.integers(0, 5, size=batch)))
    return out


def gpt2_batches(n, batch=4, seed=0):
    """`n` minibatches ({token_ids, padding_mask}, next tokens) for the GPT-2 models."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, GPT2_VOCABULARY, size=(batch, GPT2_LENGTH)).astype("int32")
        out.append(({"token_ids": ids, "padding_mask": np.ones_like(ids)},
                    rng.integers(0, GPT2_VOCABULARY, size=(batch, GPT2_LENGTH))))
    return out


def mlp_dataset(n_batches, batch=8, seed=0):
    """A tf.data.Dataset of `n_batches` minibatches (x of 12 features, labels of five classes) for
    the mlp of tests/helpers/models.py."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_batches * batch, 12)).astype("float32")
    y = rng.integers(0, 5, size=n_batches * batch)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
