"""Subclassed Keras models (``class M(keras.Model)`` with a ``call`` of their own) as users write
them, and their minibatches."""
import functools
import pathlib
import runpy

import keras
import numpy as np
from keras import ops

from tests.helpers.models import GPT2_LENGTH, GPT2_VOCABULARY


class ResidualMLP(keras.Model):
    """Layers made in __init__, a residual added with keras.ops."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inp = keras.layers.Dense(16, activation="relu", name="inp")
        self.hidden = keras.layers.Dense(16, activation="tanh", name="hidden")
        self.mix = keras.layers.Dense(16, name="mix")
        self.out = keras.layers.Dense(5, name="out")

    def call(self, x):
        h = self.inp(x)
        h = ops.add(h, self.mix(self.hidden(h)))
        return self.out(ops.relu(h))


class Block(keras.layers.Layer):
    """A user's own layer: a convolution and a residual, kept whole unless opened."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")

    def call(self, x):
        return x + self.conv(x)


class LoopCNN(keras.Model):
    """A ``for`` loop over a list of blocks."""

    def __init__(self, blocks=3, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Conv2D(4, 3, padding="same", name="stem")
        self.blocks = [Block(4, name=f"block{i}") for i in range(blocks)]
        self.pool = keras.layers.GlobalAveragePooling2D(name="pool")
        self.head = keras.layers.Dense(5, name="head")

    def call(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.pool(x))


def tiny_transformer() -> keras.Model:
    """examples/subclassed_model.py's TinyLM (causal self-attention with the mask from keras.ops, a
    loop over blocks), small."""
    return _example()["TinyLM"](vocabulary=GPT2_VOCABULARY, dim=16, blocks=2)


@functools.cache
def _example() -> dict:
    """The names examples/subclassed_model.py defines (its flags defined once)."""
    return runpy.run_path(str(pathlib.Path(__file__).parents[2] / "examples" / "subclassed_model.py"))


class HubClassifier(keras.Model):
    """A keras_hub GPT-2 backbone built from a config (random weights) under a pooled head."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from tests.helpers.models import gpt2_backbone

        self.backbone = gpt2_backbone()
        self.head = keras.layers.Dense(5, name="head")

    def call(self, inputs):
        h = self.backbone(inputs)
        return self.head(ops.mean(h, axis=1))


def image_batches(n, batch=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch, 8, 8, 3)).astype("float32"), rng.integers(0, 5, size=batch)) for _ in range(n)]


def vector_batches(n, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch, 12)).astype("float32"), rng.integers(0, 5, size=batch)) for _ in range(n)]


def token_batches(n, batch=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, GPT2_VOCABULARY, size=(batch, GPT2_LENGTH)).astype("int32"),
             rng.integers(0, GPT2_VOCABULARY, size=(batch, GPT2_LENGTH))) for _ in range(n)]


def hub_batches(n, batch=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, GPT2_VOCABULARY, size=(batch, GPT2_LENGTH)).astype("int32")
        out.append(({"token_ids": ids, "padding_mask": np.ones_like(ids)}, rng.integers(0, 5, size=batch)))
    return out
