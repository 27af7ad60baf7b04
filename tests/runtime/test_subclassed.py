"""Subclassed Keras models traced into layer graphs (hetpipe_tf.runtime.subclass_trace), cut into
stages and trained as Keras trains the same object."""
import warnings

import keras
import numpy as np
import pytest

from hetpipe_tf.runtime.stage_rewrite import describe_model, split_model
from hetpipe_tf.runtime.subclass_trace import trace_model
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from tests.helpers import subclassed
from tests.helpers.models import GPT2_LENGTH
from tests.helpers.references import stale_sgd_run

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS = 5
TOKENS = keras.Input((GPT2_LENGTH,), dtype="int32")
HUB = {"token_ids": keras.Input((GPT2_LENGTH,), dtype="int32"),
       "padding_mask": keras.Input((GPT2_LENGTH,), dtype="int32")}

#: name -> (the model's class or maker, minibatches, input spec (None: the built model's), stages)
CASES = {
    "residual_mlp": (subclassed.ResidualMLP, subclassed.vector_batches, None, 2),
    "loop_cnn": (subclassed.LoopCNN, subclassed.image_batches, None, 3),
    "transformer": (subclassed.tiny_transformer, subclassed.token_batches, TOKENS, 2),
    "hub_backbone": (subclassed.HubClassifier, subclassed.hub_batches, HUB, 3),
}


def _built(name, scale=1.0):
    """The case's model, seeded, built on its first minibatch, every weight multiplied by `scale`."""
    cls, batches, _, _ = CASES[name]
    keras.utils.set_random_seed(5)
    model = cls()
    model(batches(1)[0][0])
    for v in model.weights:
        v.assign(v.numpy() * scale)
    return model


def _keras_fit(name, scale=1.0):
    """The case's weights after Keras's own fit, one step per minibatch."""
    model = _built(name, scale)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, jit_compile=False)
    for x, y in CASES[name][1](STEPS):
        model.train_on_batch(x, y)
    return [v.numpy() for v in model.weights]


def _max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def _pipeline(name, nm):
    _, batches, spec, k = CASES[name]
    model = _built(name)
    if spec is not None:
        trace_model(model, input_spec=spec)
    vw = VirtualWorker(model, ",".join(["cpu"] * k), num_in_flight=nm, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=60, references=[(1.0, 1.0)] * k)
    vw.train(iter(batches(STEPS)), STEPS)
    return model, vw


@pytest.mark.parametrize("name", list(CASES))
def test_traced_model_cut_into_stages_trains_as_keras_fit_at_nm1(name):
    want = _keras_fit(name)
    tolerance = max(1e-5, 10 * _max_difference(want, _keras_fit(name, scale=1 + 1e-7)))
    model, vw = _pipeline(name, 1)
    assert vw.staged.num_stages == CASES[name][3]
    assert _max_difference([v.numpy() for v in model.weights], want) < tolerance
    assert _max_difference(want, [v.numpy() for v in _built(name).weights]) > 10 * tolerance  # it trained


@pytest.mark.parametrize("name", ["residual_mlp", "transformer"])
def test_traced_model_at_nm_k_is_stale_sgd(name):
    k = CASES[name][3]
    model, _ = _pipeline(name, k)
    reference = _built(name)
    graph = trace_model(reference, input_spec=CASES[name][2])  # the model's call takes no `training`
    want, _ = stale_sgd_run(graph, CASES[name][1](STEPS), k, keras.optimizers.SGD(0.1))
    position = {id(v): i for i, v in enumerate(reference.trainable_variables)}
    got = [model.trainable_variables[position[id(v)]].numpy() for v in graph.trainable_variables]
    assert _max_difference(got, want) < 1e-5


def test_loops_unroll_keras_ops_are_nodes_and_own_layers_stay_whole_unless_opened():
    model = _built("loop_cnn")
    kinds = [(n.layer, n.kind) for n in describe_model(model).graph.nodes]
    assert kinds == [("stem", "Conv2D"), ("block0", "Block"), ("block1", "Block"), ("block2", "Block"),
                     ("pool", "GlobalAveragePooling2D"), ("head", "Dense")]
    trace_model(model, open_layers=["block1"])
    kinds = [n.kind for n in describe_model(model).graph.nodes]
    assert kinds == ["Conv2D", "Block", "Conv2D", "Add", "Block", "GlobalAveragePooling2D", "Dense"]
    staged = split_model(model, boundaries=(0, 3))  # inside block1: after its convolution
    assert staged.stages[0].trainable_variables[-1] is model.blocks[1].conv.bias


# What cannot be traced ---------------------------------------------------------------------------

class _Refused(keras.Model):
    """A dense layer made in __init__; each subclass below does one thing a trace cannot hold."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, name="dense")


class _BranchOnValue(_Refused):
    def call(self, x):
        h = self.dense(x)
        if keras.ops.sum(h) > 0:
            h = -h
        return h


class _RawTensorFlow(_Refused):
    def call(self, x):
        import tensorflow as tf

        return tf.nn.relu(self.dense(x))


class _StateOnSelf(_Refused):
    def call(self, x):
        self.last = self.dense(x)
        return self.last


class _AddsLoss(_Refused):
    def call(self, x):
        h = self.dense(x)
        self.add_loss(keras.ops.mean(h))
        return h


class _AddsMetric(_Refused):
    def call(self, x):
        h = self.dense(x)
        self.add_metric(keras.ops.mean(h), name="mean")
        return h


class _LayerInCall(_Refused):
    def call(self, x):
        return keras.layers.Dense(3)(self.dense(x))


class _BranchOnTraining(_Refused):
    def call(self, x, training=None):
        h = self.dense(x)
        if training:
            h = h * 0.5
        return h


class _OwnWeights(_Refused):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(4,), initializer="ones", name="scale")

    def call(self, x):
        return self.dense(x) * self.scale


class _LayerOnAConstant(_Refused):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions = keras.layers.Embedding(6, 4, name="positions")

    def call(self, x):
        return self.dense(x) + self.positions(keras.ops.arange(6))


class _OneBlock(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = subclassed.Block(3, name="only")

    def call(self, x):
        return self.block(x)


@pytest.mark.parametrize("cls,message", [
    (_BranchOnValue, r"\(_BranchOnValue\) cannot be traced into stages: line \d+ of _BranchOnValue.call: "
                     r"`if keras.ops.sum\(h\) > 0:`: call branches in Python on a tensor's value, .*keras.ops.where"),
    (_RawTensorFlow, r"line \d+ of _RawTensorFlow.call: `return tf.nn.relu\(self.dense\(x\)\)`: call runs a "
                     r"TensorFlow op that does not go through Keras; use the keras.ops equivalent"),
    (_StateOnSelf, r"line \d+ of _StateOnSelf.call: `self.last = self.dense\(x\)`: call sets self.last: state kept "
                   r"on the model between calls"),
    (_AddsLoss, r"line \d+ of _AddsLoss.call: `self.add_loss\(keras.ops.mean\(h\)\)`: call adds a loss \(add_loss\)"),
    (_AddsMetric, r"line \d+ of _AddsMetric.call: `self.add_metric\(keras.ops.mean\(h\), name=\"mean\"\)`: call adds "
                  r"a metric \(add_metric\); give the metric to compile instead"),
    (_LayerInCall, r"line \d+ of _LayerInCall.call: `return keras.layers.Dense\(3\)\(self.dense\(x\)\)`: call makes "
                   r"layer '.*' \(Dense\) each time it runs.*make it in __init__"),
    (_BranchOnTraining, r"line \d+ of _BranchOnTraining.call: `if training:`: call branches in Python on `training`"),
    (_LayerOnAConstant, r"line \d+ of _LayerOnAConstant.call: `return self.dense\(x\) \+ "
                        r"self.positions\(keras.ops.arange\(6\)\)`: the traced graph does not reach layer "
                        r"'positions' \(Embedding\) and its weights: a layer called on a constant"),
    (_OwnWeights, r"_OwnWeights '.*' makes weights of its own \(.*scale\) and its call uses them outside any layer"),
])
def test_what_cannot_be_traced_is_refused_with_the_class_and_the_line(cls, message):
    model = cls()
    model.build((None, 6)) if cls is _OwnWeights else None
    with pytest.raises(ValueError, match=message):
        trace_model(model, input_spec=(6,))


def test_a_model_that_traces_into_one_layer_call_stays_one_stage_with_a_warning():
    model = _OneBlock()
    with pytest.warns(UserWarning, match=r"'.*' \(_OneBlock\) traces into one layer call: it stays one stage; name "
                                         r"its own Layer subclass in open_layers"):
        trace_model(model, input_spec=(4, 4, 3))
    assert [n.kind for n in describe_model(model).graph.nodes] == ["Block"]
    with pytest.raises(ValueError, match=r"open_layers=\['block'\]: \['block'\] name no Layer subclass .* it has "
                                         r"\['only'\]"):
        trace_model(model, input_spec=(4, 4, 3), open_layers=["block"])
    trace_model(model, input_spec=(4, 4, 3), open_layers=["only"])
    assert [n.kind for n in describe_model(model).graph.nodes] == ["Conv2D", "Add"]


class _BackboneOnly(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from tests.helpers.models import gpt2_backbone

        self.backbone = gpt2_backbone()

    def call(self, inputs):
        return self.backbone(inputs)


def test_a_model_calling_one_functional_model_is_cut_inside_it_without_a_warning():
    model = _BackboneOnly()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace_model(model, input_spec=HUB)
    assert split_model(model, num_stages=3).num_stages == 3


def test_an_unbuilt_model_without_a_spec_is_refused_naming_what_to_give():
    with pytest.raises(ValueError, match=r"is subclassed and not built, and no input spec was given: call it once "
                                         r"on a batch, or call model.build\(input_shape\), or give "
                                         r"trace_model\(model, input_spec=keras.Input\(shape, dtype=...\)\)"):
        VirtualWorker(subclassed.ResidualMLP(), "cpu,cpu", optimizer="sgd", loss=LOSS, references=[(1.0, 1.0)] * 2)


def test_the_profiler_measures_a_traced_model_on_random_inputs_of_its_trace():
    """(The strategy's test plans one from the profile measured on the data.)"""
    from hetpipe_tf.runtime.profiler import measure_profile

    profile = measure_profile(_built("residual_mlp"), 8, loss=LOSS, repeats=1, cache_dir=None)
    assert profile.layer_names[:3] == ("inp", "hidden", "mix") and len(profile.layer_names) == 6
    assert sum(profile.times["host"].forward) > 0


class _WithDropout(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, name="dense")
        self.drop = keras.layers.Dropout(0.5, name="drop")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x, training=None):
        return self.out(self.drop(self.dense(x), training=training))


def test_training_reaches_the_layers_as_keras_passes_it():
    model = _WithDropout()
    x = np.ones((4, 6), "float32")
    model(x)
    graph = trace_model(model)
    np.testing.assert_allclose(graph(x, training=False), model(x, training=False), atol=1e-6)
    assert float(np.max(np.abs(graph(x, training=True) - model(x, training=False)))) > 1e-3  # dropout ran


def test_the_trained_weights_are_the_users_model_objects_and_save_weights_keeps_them(tmp_path):
    model, _ = _pipeline("residual_mlp", 1)
    assert _max_difference([model.inp.kernel.numpy()], [_built("residual_mlp").inp.kernel.numpy()]) > 0
    model.save_weights(str(tmp_path / "trained.weights.h5"))
    fresh = _built("residual_mlp")
    fresh.load_weights(str(tmp_path / "trained.weights.h5"))
    assert _max_difference(fresh.get_weights(), model.get_weights()) == 0
    assert model.get_config() == {**fresh.get_config(), "name": model.name}  # untouched
