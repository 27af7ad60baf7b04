"""Small Keras models the tests cut into stages, and the losses they train them with."""
import keras
import tensorflow as tf

#: The loss of the classifiers below (five classes, logits).
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mean_output(y_true, y_pred):
    """A loss that is the mean of the outputs: with :func:`constant_gradient_model`, every
    gradient depends on the inputs only."""
    del y_true
    return tf.reduce_mean(y_pred)


def mlp():
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8),
                             keras.layers.Dense(5)], name="mlp")


def cnn():
    i = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same", activation="relu")(i)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.Dropout(0.25)(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(i, keras.layers.Dense(5)(x), name="cnn")


def resnet_block():
    """A residual block whose shortcut spans the stage boundaries used in the tests."""
    i = keras.Input((8, 8, 3))
    a = keras.layers.Conv2D(4, 3, padding="same", name="stem")(i)
    b = keras.layers.BatchNormalization(name="bn1")(a)
    c = keras.layers.ReLU(name="relu1")(b)
    d = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv2")(c)  # BN follows
    e = keras.layers.BatchNormalization(name="bn2")(d)
    f = keras.layers.Add(name="add")([a, e])
    g = keras.layers.ReLU(name="relu2")(f)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(g)
    return keras.Model(i, keras.layers.Dense(5, name="head")(h), name="resnet_block")


def two_inputs():
    img = keras.Input((8, 8, 3), name="image")
    aux = keras.Input((4,), name="aux")
    x = keras.layers.Conv2D(4, 3, activation="relu")(img)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Concatenate()([x, aux])
    x = keras.layers.Dense(8, activation="relu")(x)
    return keras.Model([img, aux], keras.layers.Dense(5)(x), name="two_inputs")


def two_outputs():
    i = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu", name="h1")(i)
    early = keras.layers.Dense(5, name="early")(h)
    h = keras.layers.Dense(16, activation="relu", name="h2")(h)
    h = keras.layers.Dense(16, activation="relu", name="h3")(h)
    return keras.Model(i, [early, keras.layers.Dense(5, name="late")(h)], name="two_outputs")


def model_of_models():
    """A model of a model of layers: the Sequential 'inner' (with BatchNormalization, called with
    training=False) inside the functional 'middle' inside the model."""
    inner = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu", name="inner_a"),
                              keras.layers.BatchNormalization(name="inner_bn"),
                              keras.layers.Dense(16, activation="tanh", name="inner_b")], name="inner")
    i = keras.Input((12,))
    middle = keras.Model(i, keras.layers.Dense(16, name="middle_dense")(inner(i, training=False)), name="middle")
    x = keras.Input((12,))
    return keras.Model(x, keras.layers.Dense(5, name="head")(middle(x)), name="model_of_models")


def vgg_features():
    """keras.applications' VGG16 (random weights) as a feature extractor under a new head."""
    base = keras.applications.VGG16(include_top=False, weights=None, input_shape=(32, 32, 3))
    x = keras.Input((32, 32, 3))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(base(x, training=False))
    return keras.Model(x, keras.layers.Dense(5, name="head")(h), name="vgg_features")


GPT2_VOCABULARY = 24
GPT2_LENGTH = 8


def gpt2_backbone():
    """A tiny keras_hub GPT-2 backbone, random weights, no dropout."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(vocabulary_size=GPT2_VOCABULARY, num_layers=2, num_heads=2, hidden_dim=32,
                                         intermediate_dim=64, max_sequence_length=GPT2_LENGTH, dropout=0.0)


def gpt2_backbone_as_layer():
    """The GPT-2 backbone called as a layer on dict inputs, as keras_hub's tasks and transfer
    learning build models, under an untied Dense head."""
    inputs = {"token_ids": keras.Input((GPT2_LENGTH,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((GPT2_LENGTH,), dtype="int32", name="padding_mask")}
    h = gpt2_backbone()(inputs)
    return keras.Model(inputs, keras.layers.Dense(GPT2_VOCABULARY, name="lm_head")(h), name="gpt2_as_layer")


def gpt2_causal_lm():
    """keras_hub's GPT2CausalLM: the backbone nested, its token embedding used again, reversed,
    for the logits (tied input and output embeddings)."""
    import keras_hub

    return keras_hub.models.GPT2CausalLM(backbone=gpt2_backbone(), preprocessor=None)


class AddBias(keras.layers.Layer):
    def build(self, input_shape):
        self.bias = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="bias")

    def call(self, x):
        return x + self.bias


def constant_gradient_model():
    """Every trainable weight's gradient depends on the data only (the Dense layer after the
    first is frozen), so SGD's result does not depend on which weights a minibatch saw. Named,
    so that a strategy measures its profile once (the cache is keyed by the model's name)."""
    keras.utils.set_random_seed(3)
    x = keras.Input((6,))
    h = keras.layers.Dense(5, name="first")(x)
    frozen = keras.layers.Dense(4, name="frozen", trainable=False)
    h = frozen(h)
    y = AddBias(name="bias")(h)
    return keras.Model(x, y, name="constant_gradient")


def scalar_chain():
    """x -> a·x -> b·(a·x) on stage 0, -> c·(b·a·x) on stage 1: scalar weights, no biases, whose
    gradients depend on the other weights of the chain (dL/da = c·b·mean(x), ...)."""
    layers = [keras.layers.Dense(1, use_bias=False, name=n, kernel_initializer=keras.initializers.Constant(v))
              for n, v in (("a", 0.8), ("b", 1.2), ("c", -0.7))]
    return keras.Sequential([keras.Input((1,))] + layers)
