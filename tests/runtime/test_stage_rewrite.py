import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.planning.model_graph import SharedLayerError
from hetpipe_tf.runtime.stage_rewrite import UnsupportedModelError, describe_model, split_model
from tests.cli import test_models

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(model, batch=6, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(batch,) + tuple(t.shape[1:])).astype("float32") for t in model.inputs]
    x = xs[0] if len(xs) == 1 else xs
    y = rng.integers(0, 5, size=batch)
    return x, y


def _objective(outputs, y):
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return tf.add_n([LOSS(y, o) * (i + 1) for i, o in enumerate(outputs)])


def _whole_model(model, x, y):
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    with tf.GradientTape() as tape:
        tape.watch(tv)
        out, _, losses = model.stateless_call(tv, ntv, x, training=True, return_losses=True)
        loss = _objective(out, y) + tf.add_n(losses or [tf.constant(0.0)])
    grads = tape.gradient(loss, tv)
    return float(loss), {v.path: g for v, g in zip(model.trainable_variables, grads)}


def _pipelined(staged, x, y):
    """Stage by stage: forward along the chain, then each stage's input gradient back."""
    loaded = staged.split_inputs(x)
    records, received = [], []
    for stage in staged.stages:
        entering = list(received) + loaded.get(stage.index, [])
        tv = [v.value for v in stage.trainable_variables]
        ntv = [v.value for v in stage.non_trainable_variables]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(entering + tv)
            sent, _, reg = stage.call(tv, ntv, entering, training=True)
            target = _objective(sent, y) + reg if stage is staged.stages[-1] else None
        records.append((stage, tape, entering, tv, sent, reg, target))
        received = sent
    grads, upstream, loss = {}, None, None
    for stage, tape, entering, tv, sent, reg, target in reversed(records):
        if target is not None:
            loss = float(target)
            g = tape.gradient(target, entering + tv)
        else:
            g = tape.gradient(sent + [reg], entering + tv, output_gradients=upstream + [tf.constant(1.0)])
        upstream = g[:len(stage.io.received)]
        grads.update({v.path: gv for v, gv in zip(stage.trainable_variables, g[len(entering):])})
    return loss, grads


@pytest.mark.parametrize("build,boundaries", [
    (test_models.mlp, (0, 2)),
    (test_models.mlp, (0, 1, 2, 3)),
    (test_models.cnn, (0, 2, 5)),
    (test_models.resnet_block, (0, 2, 5)),  # the shortcut from 'stem' crosses two cuts
    (test_models.resnet_block, (0, 6)),
    (test_models.two_inputs, (0, 2, 4)),  # 'aux' first used in the last stage
    (test_models.two_outputs, (0, 2, 3)),  # 'early' is made in stage 0, forwarded to the loss
])
def test_stagewise_loss_and_gradients_equal_whole_model(build, boundaries):
    keras.utils.set_random_seed(3)
    model = build()
    x, y = _data(model)
    staged = split_model(model, boundaries=boundaries)
    assert staged.num_stages == len(boundaries)
    want_loss, want = _whole_model(model, x, y)
    got_loss, got = _pipelined(staged, x, y)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    assert set(got) == set(want)
    for path, g in want.items():
        np.testing.assert_allclose(got[path], g, atol=1e-5, err_msg=path)


def test_skip_connection_is_forwarded_through_middle_stage():
    staged = split_model(test_models.resnet_block(), boundaries=(0, 2, 5))
    graph = staged.graph
    stem_out = graph.nodes[0].outputs[0]
    middle = staged.stages[1].io
    assert stem_out in middle.received and stem_out in middle.sent and stem_out not in middle.produced
    assert stem_out in staged.stages[2].io.consumed


def test_batchnorm_state_updates_in_its_own_stage():
    model = test_models.cnn()
    staged = split_model(model, boundaries=(0, 2))
    bn_stage = staged.stages[0]
    assert any("moving_mean" in v.path for v in bn_stage.non_trainable_variables)
    assert not any("moving_mean" in v.path for v in staged.stages[1].non_trainable_variables)
    x, _ = _data(model)
    tv = [v.value for v in bn_stage.trainable_variables]
    ntv = [v.value for v in bn_stage.non_trainable_variables]
    _, new_state, _ = bn_stage.call(tv, ntv, [tf.constant(x)], training=True)
    moved = [not np.allclose(a, b) for a, b, v in zip(new_state, ntv, bn_stage.non_trainable_variables)
             if "moving_mean" in v.path]
    assert moved == [True]
    _, frozen, _ = bn_stage.call(tv, ntv, [tf.constant(x)], training=False)
    for a, b in zip(frozen, ntv):
        np.testing.assert_array_equal(a, b)


def test_dropout_depends_on_training_flag():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dropout(0.5), keras.layers.Dense(3)])
    stage = split_model(model, boundaries=(0,)).stages[0]
    tv = [v.value for v in stage.trainable_variables]
    ntv = [v.value for v in stage.non_trainable_variables]
    x = tf.ones((4, 32))
    train_out = stage.call(tv, ntv, [x], training=True)[0][0]
    infer_out = stage.call(tv, ntv, [x], training=False)[0][0]
    np.testing.assert_allclose(infer_out, model(x, training=False), atol=1e-6)
    assert not np.allclose(train_out, infer_out)


def test_shared_layer_across_stages_is_refused_naming_the_layer():
    shared = keras.layers.Dense(8, name="tied")
    i = keras.Input((8,))
    h = shared(i)
    h = keras.layers.Dense(8, name="middle")(h)
    model = keras.Model(i, shared(h))
    with pytest.raises(SharedLayerError, match=r"layer 'tied' is called in stages \[0, 1\]"):
        split_model(model, boundaries=(0, 2))
    # The automatic cut keeps the calls of a shared layer together.
    assert describe_model(model).graph.allowed_cuts() == ()
    split_model(model, boundaries=(0,))


def test_shared_layer_within_one_stage_is_fine():
    shared = keras.layers.Dense(8, name="tied")
    i = keras.Input((8,))
    h = keras.layers.Dense(8, name="first")(i)
    h = shared(shared(h))
    model = keras.Model(i, keras.layers.Dense(3, name="out")(h))
    staged = split_model(model, boundaries=(0, 1, 3))
    assert [n.layer for n in staged.graph.nodes] == ["first", "tied", "tied", "out"]
    x, y = np.ones((2, 8), "float32"), np.array([0, 1])
    want_loss, want = _whole_model(model, x, y)
    got_loss, got = _pipelined(staged, x, y)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)


def test_num_stages_balances_and_layers_without_weights_are_nodes():
    model = test_models.cnn()
    staged = split_model(model, num_stages=3)
    assert staged.num_stages == 3 and staged.boundaries[0] == 0
    kinds = [n.kind for n in staged.graph.nodes]
    assert "MaxPooling2D" in kinds and "Flatten" in kinds


def test_subclassed_and_unbuilt_models_get_clear_errors():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    sub(np.ones((1, 3), "float32"))
    with pytest.raises(UnsupportedModelError, match="only Sequential and functional"):
        split_model(sub, num_stages=1)
    with pytest.raises(UnsupportedModelError, match="not built"):
        split_model(keras.Sequential([keras.layers.Dense(2)]), num_stages=1)


def test_bad_boundaries_are_refused():
    model = test_models.mlp()
    for bad in [(1, 2), (0, 2, 2), (0, 9)]:
        with pytest.raises(ValueError, match="boundaries"):
            split_model(model, boundaries=bad)


def test_the_model_still_saves_after_it_is_cut(tmp_path):
    model = test_models.two_inputs()
    split_model(model, boundaries=(0, 2, 4))  # the model input 'aux' enters the last stage
    model.save(tmp_path / "model.keras")
    x, _ = _data(model)
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "model.keras")(x), model(x), atol=1e-6)
