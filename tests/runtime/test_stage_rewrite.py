import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.runtime.stage_rewrite import UnsupportedModelError, describe_model, split_model
from hetpipe_tf.runtime.subclass_trace import UntraceableModelError
from tests.helpers import models
from tests.helpers.data import gpt2_batches
from tests.helpers.models import LOSS


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
    return float(loss), {v.path: tf.convert_to_tensor(g) for v, g in zip(model.trainable_variables, grads)}


def _pipelined(staged, x, y):
    """Stage by stage: forward along the chain, then each stage's input gradient back. The
    gradients of a variable's replicas (a layer called in several stages) are summed."""
    loaded = staged.split_inputs(x)
    records, received = [], []
    for stage in staged.stages:
        entering = list(received) + loaded.get(stage.index, [])
        tv = [v.value for v in stage.trainable_variables]
        ntv = [v.value for v in stage.non_trainable_variables]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([t for t in entering + tv if t.dtype.is_floating])
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
        for v, gv in zip(stage.trainable_variables, g[len(entering):]):
            grads[v.path] = grads.get(v.path, 0.0) + tf.convert_to_tensor(gv)
    return loss, grads


def _assert_stages_equal_the_model(staged, model, x, y):
    """The stages, one after another, give the model's loss and gradients (a replicated
    variable's gradient: the sum of its replicas')."""
    want_loss, want = _whole_model(model, x, y)
    got_loss, got = _pipelined(staged, x, y)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    assert set(got) == set(want)
    for path, g in want.items():
        np.testing.assert_allclose(got[path], g, atol=1e-5, err_msg=path)


@pytest.mark.parametrize("build,boundaries", [
    (models.mlp, (0, 2)),
    (models.mlp, (0, 1, 2, 3)),
    (models.cnn, (0, 2, 5)),
    (models.resnet_block, (0, 2, 5)),  # the shortcut from 'stem' crosses two cuts
    (models.resnet_block, (0, 6)),
    (models.two_inputs, (0, 2, 4)),  # 'aux' first used in the last stage
    (models.two_outputs, (0, 2, 3)),  # 'early' is made in stage 0, forwarded to the loss
])
def test_stagewise_loss_and_gradients_equal_whole_model(build, boundaries):
    keras.utils.set_random_seed(3)
    model = build()
    x, y = _data(model)
    staged = split_model(model, boundaries=boundaries)
    assert staged.num_stages == len(boundaries)
    _assert_stages_equal_the_model(staged, model, x, y)


def test_skip_connection_is_forwarded_through_middle_stage():
    staged = split_model(models.resnet_block(), boundaries=(0, 2, 5))
    graph = staged.graph
    stem_out = graph.nodes[0].outputs[0]
    middle = staged.stages[1].io
    assert stem_out in middle.received and stem_out in middle.sent and stem_out not in middle.produced
    assert stem_out in staged.stages[2].io.consumed


def test_batchnorm_state_updates_in_its_own_stage():
    model = models.cnn()
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


def _tied_model():
    shared = keras.layers.Dense(8, name="tied")
    i = keras.Input((8,))
    h = shared(i)
    h = keras.layers.Dense(8, name="middle")(h)
    return keras.Model(i, shared(h))


def test_a_shared_layer_is_kept_in_one_stage_when_a_cut_allows_else_replicated():
    model = _tied_model()
    # No cut keeps both calls of 'tied' in one stage, so two stages need a replica of it.
    assert describe_model(model).graph.allowed_cuts() == ()
    staged = split_model(model, num_stages=2)
    assert len(staged.stages) == 2 and [t.path for t in staged.tied] == [
        v.path for v in model.get_layer("tied").trainable_variables]
    assert split_model(model, boundaries=(0,)).tied == ()


def test_shared_layer_cut_apart_is_replicated_and_its_gradients_sum_to_the_models():
    keras.utils.set_random_seed(2)
    model = _tied_model()
    staged = split_model(model, boundaries=(0, 1, 2))
    tied_kernel, tied_bias = model.get_layer("tied").trainable_variables
    assert [(t.path, t.trainable, t.replicas) for t in staged.tied] == [
        (tied_kernel.path, True, ((0, 0), (2, 0))), (tied_bias.path, True, ((0, 1), (2, 1)))]
    for t, v in zip(staged.tied, (tied_kernel, tied_bias)):
        for stage, position in t.replicas:
            assert staged.stages[stage].trainable_variables[position] is v
    x, y = np.ones((3, 8), "float32"), np.array([0, 1, 2])
    _assert_stages_equal_the_model(staged, model, x, y)


def test_shared_layer_within_one_stage_is_fine():
    shared = keras.layers.Dense(8, name="tied")
    i = keras.Input((8,))
    h = keras.layers.Dense(8, name="first")(i)
    h = shared(shared(h))
    model = keras.Model(i, keras.layers.Dense(3, name="out")(h))
    staged = split_model(model, boundaries=(0, 1, 3))
    assert [n.layer for n in staged.graph.nodes] == ["first", "tied", "tied", "out"]
    assert staged.tied == ()
    _assert_stages_equal_the_model(staged, model, np.ones((2, 8), "float32"), np.array([0, 1]))


def test_num_stages_balances_and_layers_without_weights_are_nodes():
    model = models.cnn()
    staged = split_model(model, num_stages=3)
    assert staged.num_stages == 3 and staged.boundaries[0] == 0
    kinds = [n.kind for n in staged.graph.nodes]
    assert "MaxPooling2D" in kinds and "Flatten" in kinds


def test_unbuilt_models_get_clear_errors():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(UntraceableModelError, match=r"'sub' \(Sub\) is subclassed and not built, and no input spec "
                                                    r"was given: call it once on a batch, or call model.build"):
        split_model(Sub(), num_stages=1)
    with pytest.raises(UnsupportedModelError, match="not built"):
        split_model(keras.Sequential([keras.layers.Dense(2)]), num_stages=1)


def test_bad_boundaries_are_refused():
    model = models.mlp()
    for bad in [(1, 2), (0, 2, 2), (0, 9)]:
        with pytest.raises(ValueError, match="boundaries"):
            split_model(model, boundaries=bad)


def _stages_holding(staged, prefix):
    """The stages that hold a layer call of the nested model named `prefix`."""
    return {s.index for s in staged.stages for i in s.io.nodes if staged.graph.nodes[i].layer.startswith(prefix)}


@pytest.mark.parametrize("build,boundaries,nested", [
    (models.model_of_models, (0, 1, 3), "middle/inner/"),  # cut inside a model inside a model
    (models.model_of_models, (0, 2, 4), "middle/"),
    (models.vgg_features, (0, 5, 12), "vgg16/"),  # keras.applications as a feature extractor
])
def test_nested_models_are_cut_inside_and_equal_the_model(build, boundaries, nested):
    keras.utils.set_random_seed(4)
    model = build()
    staged = split_model(model, boundaries=boundaries)
    assert len(_stages_holding(staged, nested)) >= 2
    x, y = _data(model)
    _assert_stages_equal_the_model(staged, model, x, y)


def test_nested_layer_calls_are_named_after_the_models_that_hold_them():
    graph = describe_model(models.model_of_models()).graph
    assert [(n.layer, n.kind) for n in graph.nodes] == [
        ("middle/inner/inner_a", "Dense"), ("middle/inner/inner_bn", "BatchNormalization"),
        ("middle/inner/inner_b", "Dense"), ("middle/middle_dense", "Dense"), ("head", "Dense")]


def test_gpt2_backbone_called_as_a_layer_is_cut_inside():
    keras.utils.set_random_seed(5)
    model = models.gpt2_backbone_as_layer()
    staged = split_model(model, num_stages=3)
    assert staged.keras_graph.model.output_names == model.output_names
    backbone = next(layer for layer in model.layers if isinstance(layer, keras.Model))  # gpt2_backbone_N after others
    assert len(_stages_holding(staged, backbone.name + "/")) == 3
    assert any("transformer_layer_1" in n.layer for n in staged.graph.nodes)
    (x, y), = gpt2_batches(1)
    _assert_stages_equal_the_model(staged, model, x, y)


def test_gpt2_causal_lm_cut_across_its_tied_embedding():
    keras.utils.set_random_seed(6)
    model = models.gpt2_causal_lm()
    staged = split_model(model, num_stages=3)
    embeddings = model.backbone.token_embedding.embeddings
    first, last = staged.stages[0], staged.stages[-1]
    assert [(t.path, t.trainable, [stage for stage, _ in t.replicas]) for t in staged.tied] == [
        (embeddings.path, True, [0, 2])]
    (_, p0), (_, p2) = staged.tied[0].replicas
    assert first.trainable_variables[p0] is embeddings and last.trainable_variables[p2] is embeddings
    (x, y), = gpt2_batches(1)
    _assert_stages_equal_the_model(staged, model, x, y)


def test_a_subclassed_model_inside_stays_one_node():
    class Block(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a = keras.layers.Dense(8)
            self.b = keras.layers.Dense(8)

        def call(self, x):
            return self.b(self.a(x))

    x = keras.Input((4,))
    model = keras.Model(x, keras.layers.Dense(3, name="head")(Block(name="block")(x)))
    graph = describe_model(model).graph
    assert [(n.layer, n.kind) for n in graph.nodes] == [("block", "Block"), ("head", "Dense")]
    with pytest.raises(ValueError, match="cannot cut 2 layer calls into 3 stages"):
        split_model(model, num_stages=3)


@pytest.mark.parametrize("build,boundaries", [
    (models.two_inputs, (0, 2, 4)),  # the model input 'aux' enters the last stage
    (models.model_of_models, (0, 1, 3)),
])
def test_the_model_still_saves_after_it_is_cut(build, boundaries, tmp_path):
    model = build()
    split_model(model, boundaries=boundaries)
    model.save(tmp_path / "model.keras")
    x, _ = _data(model)
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "model.keras")(x), model(x), atol=1e-6)
