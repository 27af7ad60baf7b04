"""What a profile's apply cost is measured on and cached by (hetpipe_tf.runtime.profiler): weights
shaped and named like the model's, so that an optimizer takes the paths it takes on a stage's
(Muon's Newton-Schulz on matrices but not on embeddings, Adafactor's factored moments); and the
optimizer's class and settings, not only its class."""
import keras
import numpy as np
import pytest

from hetpipe_tf.runtime import profiler


def _model():
    """An embedding (Muon updates it with AdamW, by its path), a matrix, vectors."""
    ids = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(50, 16, name="token_embedding")(ids)
    h = keras.layers.Dense(32, name="dense")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(ids, keras.layers.Dense(5, name="logits")(h), name="m")


def _slots(optimizer, weights):
    """The variables `optimizer` builds on `weights`: (name, rank) each."""
    optimizer.build(weights)
    return [(v.name, len(v.shape)) for v in optimizer.variables]


@pytest.mark.parametrize("elements", [profiler.APPLY_ELEMENTS, 1000])
def test_applies_are_timed_on_weights_shaped_and_named_like_the_models(elements):
    model = _model()
    weights = model.trainable_variables
    total = sum(int(np.prod(v.shape)) for v in weights)
    stand_ins = profiler._stand_ins(model, elements)
    assert [v.path for v in stand_ins] == [v.path for v in weights]
    assert [len(v.shape) for v in stand_ins] == [len(v.shape) for v in weights]
    if total <= elements:
        assert [v.shape for v in stand_ins] == [v.shape for v in weights]
    else:  # shrunk to the budget by one factor
        assert total > 1000 and sum(int(np.prod(v.shape)) for v in stand_ins) <= elements
        assert all(0 < s <= d for v, w in zip(stand_ins, weights) for s, d in zip(v.shape, w.shape))
    # The same slots as on the model's weights: Muon orthogonalises the matrices but updates the
    # embedding (by its path) and the vectors with AdamW; Adafactor factors the matrices' moments.
    for make in (keras.optimizers.Muon, keras.optimizers.Adafactor, keras.optimizers.Adam):
        assert _slots(make(), stand_ins) == _slots(make(), weights), make.__name__
    muon = [name for name, _ in _slots(keras.optimizers.Muon(), stand_ins)]
    assert "token_embedding_embeddings_velocity" in muon and "dense_kernel_velocity" not in muon


def test_a_cached_profile_is_the_optimizers_of_the_same_class_and_settings_whatever_the_learning_rate():
    key = profiler._optimizer_key
    sgd = key(keras.optimizers.SGD(0.1))
    assert sgd.startswith("SGD-")
    assert key(keras.optimizers.SGD(0.5, name="another")) == sgd
    assert key(keras.optimizers.SGD(0.1, momentum=0.9)) != sgd
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    assert key(keras.optimizers.AdamW(schedule)) == key(keras.optimizers.AdamW(0.01))
    assert key(keras.optimizers.AdamW(0.01, weight_decay=0.1)) != key(keras.optimizers.AdamW(0.01))
    assert key(keras.optimizers.Adam(0.01)) != key(keras.optimizers.Adam(0.01, amsgrad=True))
