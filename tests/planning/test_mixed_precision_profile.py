"""The planner counts what a mixed-precision model moves and keeps in its compute dtype: the
activations a stage holds and the bytes a cut sends are half a float32 model's in bfloat16 or
float16, the weights (float32 variables) the same."""
import keras
import pytest

from hetpipe_tf.planning.profile import static_profile
from hetpipe_tf.runtime.stage_rewrite import describe_model


def _profile(policy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        i = keras.Input((64,))
        h = keras.layers.Dense(256, activation="relu", name="a")(i)
        h = keras.layers.Dense(256, name="b")(h)
        model = keras.Model(i, keras.layers.Dense(10, name="c")(h))
        return static_profile(describe_model(model).graph, batch_size=32)
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_activations_and_cut_bytes_are_counted_in_the_compute_dtype(policy):
    full, mixed = _profile("float32"), _profile(policy)
    assert mixed.cut_bytes[1:] == tuple(b // 2 for b in full.cut_bytes[1:]) and full.cut_bytes[1] > 0
    # Layer outputs are in the compute dtype; the model's float32 input stays float32.
    assert all(m < f for m, f in zip(mixed.activation_bytes, full.activation_bytes))
    assert mixed.weight_bytes == full.weight_bytes
