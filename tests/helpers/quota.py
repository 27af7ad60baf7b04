"""CPU-quota nodes' tests: whether this machine can make cgroups (the tests that need them are
marked `needs_cgroups` and skipped, with the reason, only where it cannot), and the model whose
passes they time."""
import keras
import numpy as np
import pytest

from hetpipe_tf.distributed.cgroups import CgroupError, find_cpu_controller


def _why_not():
    try:
        find_cpu_controller()
    except CgroupError as e:
        return str(e)
    return None


NO_CGROUPS = _why_not()
needs_cgroups = pytest.mark.skipif(NO_CGROUPS is not None, reason=f"cgroups cannot be written here: {NO_CGROUPS}")


def mlp():
    inputs = keras.Input((128,))
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(512, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))


def minibatch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(128, 128)).astype("float32"), rng.integers(0, 10, 128)
