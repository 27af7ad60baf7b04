"""Models the training binary can build by name.

``mlp`` and ``cnn`` are small enough for the bundled 8x8 digits on a laptop CPU;
``vgg16``, ``vgg19``, ``resnet50``, ``resnet101`` and ``resnet152`` are the
``keras.applications`` models (``weights=None``: nothing is downloaded) that the
HetPipe paper trains, which need images of at least 32x32 with 3 channels.
``gpt`` is a small decoder-only transformer for token sequences (such as the
generated ``hetpipe_addition``): it predicts every position's next token.
All models output logits. Keras is imported when a model is built, so that the
binaries' flags (which list the names) parse without loading it.
"""
from typing import Any

from hetpipe_tf.errors import HetPipeUsageError

_APPLICATIONS = {"vgg16": "VGG16", "vgg19": "VGG19", "resnet50": "ResNet50", "resnet101": "ResNet101",
                 "resnet152": "ResNet152"}  # keras.applications names
_APPLICATIONS_INPUT = (32, 3)  # the least image side and the channels keras.applications take
SEQUENCE_MODELS = ("gpt",)  # take token sequences, not images
MODELS = ("mlp", "cnn") + tuple(_APPLICATIONS) + SEQUENCE_MODELS


class ModelInputError(HetPipeUsageError, ValueError):
    """A model of the zoo cannot take the data it was asked to build for."""


def input_requirements(name: str) -> tuple[int | None, int | None]:
    """(minimum image side, channels) the model needs, or (None, None) for any."""
    return _APPLICATIONS_INPUT if name in _APPLICATIONS else (None, None)


def gpt(sequence_length: int, vocabulary_size: int, width: int = 64, heads: int = 4, blocks: int = 2) -> Any:
    """A decoder-only transformer (GPT-2's pre-norm blocks, learned positions, an untied head)
    over token ids of (sequence_length,), with logits of (sequence_length, vocabulary_size).

    The token and position embeddings start with unit variance, the scale of the residual
    stream the blocks add to (GPT-2 starts them at 0.02), so that attention tells positions
    apart from the first step: a model that must first find which operand digits each answer
    digit depends on leaves the plateau where it predicts only the digits' frequencies sooner,
    which matters most under HetPipe's stale weights (§4: with Nm minibatches in flight each
    gradient is Nm - 1 updates old).

    Built from Keras layers rather than keras_hub's: it needs no optional package, and every
    block is several layer calls (layer norms, causal attention, the two Dense of the MLP, the
    residual adds) between which stages may be cut, where keras_hub's TransformerDecoder is
    one subclassed layer that no cut enters.

    Args:
        sequence_length: the tokens of one sequence.
        vocabulary_size: the distinct tokens.
        width: the residual stream's width.
        heads: the attention heads of every block.
        blocks: the transformer blocks.

    Returns:
        The Keras model, named ``"gpt"``.
    """
    import keras  # late: defers TensorFlow
    try:
        from keras import ops  # late: defers TensorFlow
    except ImportError:  # Keras 2 (the Horovod baseline's venv): TensorFlow's ops of the same names
        import tensorflow as ops  # late: defers TensorFlow

    ids = keras.Input((sequence_length,), dtype="int32", name="token_ids")
    unit = keras.initializers.RandomNormal(stddev=1.0)
    positions = ops.cumsum(ops.ones_like(ids), axis=-1) - 1
    h = keras.layers.Add(name="embeddings")([
        keras.layers.Embedding(vocabulary_size, width, embeddings_initializer=unit, name="token_embedding")(ids),
        keras.layers.Embedding(sequence_length, width, embeddings_initializer=unit,
                               name="position_embedding")(positions)])
    for b in range(blocks):
        z = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{b}_attention_norm")(h)
        z = keras.layers.MultiHeadAttention(heads, width // heads, name=f"block{b}_attention")(
            z, z, use_causal_mask=True)
        h = keras.layers.Add(name=f"block{b}_attention_add")([h, z])
        z = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{b}_mlp_norm")(h)
        z = keras.layers.Dense(4 * width, activation="gelu", name=f"block{b}_mlp_in")(z)
        z = keras.layers.Dense(width, name=f"block{b}_mlp_out")(z)
        h = keras.layers.Add(name=f"block{b}_mlp_add")([h, z])
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(h)
    return keras.Model(ids, keras.layers.Dense(vocabulary_size, name="logits")(h), name="gpt")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """A Keras model of `hetpipe-train`'s zoo, with random weights.

    Args:
        name: the model: one of MODELS (``"cnn"``, ``"mlp"``, ``"gpt"``, or a Keras application).
        input_shape: the shape of one input: (H, W, C) for images, (length,) for the token
            sequences of a model of SEQUENCE_MODELS.
        num_classes: the classes (for a model of SEQUENCE_MODELS, the tokens).

    Returns:
        The Keras model, named `name`.

    Raises:
        ModelInputError: the model cannot take inputs of `input_shape` (images for a sequence
            model or the other way round, or images too small for a Keras application).
        ValueError: `name` is not a known model.
    """
    import keras  # late: defers TensorFlow

    if (name in SEQUENCE_MODELS) != (len(input_shape) == 1):
        raise ModelInputError(f"{name} takes {'token sequences' if name in SEQUENCE_MODELS else 'images'}, "
                              f"not inputs of shape {tuple(input_shape)}: models for token sequences are "
                              f"{', '.join(SEQUENCE_MODELS)}, the others take images")
    if name == "gpt":
        return gpt(input_shape[0], num_classes)

    if name == "mlp":
        return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten()]
                                + [keras.layers.Dense(256, activation="relu") for _ in range(3)]
                                + [keras.layers.Dense(num_classes)], name="mlp")
    if name == "cnn":
        # Six equal convolution blocks, so that stages can be cut finely.
        i = keras.Input(input_shape)
        x = i
        for block in range(6):
            x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
            if block == 1 and x.shape[1] >= 16:  # larger images: halve once
                x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        x = keras.layers.Dense(128, activation="relu")(x)
        x = keras.layers.Dropout(0.2)(x)
        return keras.Model(i, keras.layers.Dense(num_classes)(x), name="cnn")
    if name in _APPLICATIONS:
        side, channels = _APPLICATIONS_INPUT
        if min(input_shape[:2]) < side or input_shape[2] != channels:
            raise ModelInputError(f"{name} needs images of at least {side}x{side}x{channels}, got "
                             f"{tuple(input_shape)}; pass --image_size={side} (the binary converts channels)")
        return getattr(keras.applications, _APPLICATIONS[name])(weights=None, input_shape=tuple(input_shape), classes=num_classes,
                                   classifier_activation=None)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
