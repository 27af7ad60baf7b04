"""Small Keras models the tests cut into stages (not a test module itself)."""
import keras


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
