"""Subclassed Keras models traced into layer graphs (hetpipe_tf.runtime.subclass_trace), cut into
stages and trained as Keras trains the same object."""
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

#: name -> (model class, minibatches, input spec (None: the built model's), stages)
CASES = {
    "residual_mlp": (subclassed.ResidualMLP, subclassed.vector_batches, None, 2),
    "loop_cnn": (subclassed.LoopCNN, subclassed.image_batches, None, 3),
    "transformer": (subclassed.TinyTransformer, subclassed.token_batches, TOKENS, 2),
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
