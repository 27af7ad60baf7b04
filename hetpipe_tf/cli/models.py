"""Models the training binary can build by name.

``mlp`` and ``cnn`` are small enough for the bundled 8x8 digits on a laptop CPU;
``vgg16``, ``vgg19``, ``resnet50``, ``resnet101`` and ``resnet152`` are the
``keras.applications`` models (``weights=None``: nothing is downloaded) that the
HetPipe paper trains, which need images of at least 32x32 with 3 channels.
All models output logits. Keras is imported when a model is built, so that the
binaries' flags (which list the names) parse without loading it.
"""
_APPLICATIONS = {"vgg16": "VGG16", "vgg19": "VGG19", "resnet50": "ResNet50", "resnet101": "ResNet101",
                 "resnet152": "ResNet152"}  # keras.applications names
MODELS = ("mlp", "cnn") + tuple(_APPLICATIONS)


class ModelInputError(ValueError):
    """A model of the zoo cannot take the images it was asked to build for."""


def input_requirements(name):
    """(minimum image side, channels) the model needs, or (None, None) for any."""
    return (32, 3) if name in _APPLICATIONS else (None, None)


def build_model(name, input_shape, num_classes):
    """A Keras model `name` for images of `input_shape` and `num_classes` classes."""
    import keras

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
        side, channels = input_requirements(name)
        if min(input_shape[:2]) < side or input_shape[2] != channels:
            raise ModelInputError(f"{name} needs images of at least {side}x{side}x{channels}, got "
                             f"{tuple(input_shape)}; pass --image_size={side} (the binary converts channels)")
        return getattr(keras.applications, _APPLICATIONS[name])(weights=None, input_shape=tuple(input_shape), classes=num_classes,
                                   classifier_activation=None)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
