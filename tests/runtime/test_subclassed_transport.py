"""A subclassed model sent to a worker process (hetpipe_tf.runtime.model_transport): its trace
travels, and a layer class a worker could not rebuild is refused before any process starts."""
import json
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

from hetpipe_tf.runtime.model_transport import pack_model, unpack_model
from hetpipe_tf.runtime.stage_rewrite import describe_model
from hetpipe_tf.runtime.subclass_trace import trace_model
from tests.helpers import models, subclassed
from tests.helpers.models import GPT2_LENGTH


def _nodes(model):
    return [(n.kind, n.inputs, n.outputs) for n in describe_model(model).graph.nodes]


@pytest.mark.parametrize("make,batch,spec", [
    (subclassed.ResidualMLP, subclassed.vector_batches, None),
    (subclassed.tiny_transformer, subclassed.token_batches, keras.Input((GPT2_LENGTH,), dtype="int32")),
    (subclassed.HubClassifier, subclassed.hub_batches, {"token_ids": keras.Input((GPT2_LENGTH,), dtype="int32"),
                                                        "padding_mask": keras.Input((GPT2_LENGTH,), dtype="int32")}),
])
def test_the_trace_travels_with_the_user_models_paths_order_and_graph(make, batch, spec):
    keras.utils.set_random_seed(1)
    model = make()
    x, _ = batch(1)[0]
    model(x)
    if spec is not None:
        trace_model(model, input_spec=spec)
    rebuilt = unpack_model(pack_model(model))  # what a worker process does with the packed text
    rebuilt.set_weights(model.get_weights())
    assert [v.path for v in rebuilt.weights] == [v.path for v in model.weights]
    assert _nodes(rebuilt) == _nodes(model)  # the same cuts mean the same stages
    np.testing.assert_allclose(rebuilt(x), model(x), atol=1e-6)


def test_a_functional_model_travels_as_its_json():
    model = models.mlp()
    assert pack_model(model) == model.to_json()


def test_a_layer_class_a_worker_cannot_rebuild_is_refused_naming_it_and_the_remedies():
    model = subclassed.LoopCNN()
    model(subclassed.image_batches(1)[0][0])
    with pytest.raises(ValueError, match=r"model '.*' \(LoopCNN\) cannot be sent to the worker processes: layer "
                                         r"'block0' is of class Block, from module tests.helpers.subclassed, not "
                                         r"registered; register it as serializable .* make its module importable by "
                                         r"the workers .* or use launch=\"in_process\""):
        pack_model(model)


ROOT = pathlib.Path(__file__).parents[2]

TRAIN = """
import json
import numpy as np, keras, tensorflow as tf
from hetpipe_tf import HetPipeStrategy
from tests.helpers.subclassed import ResidualMLP, vector_batches

strategy = HetPipeStrategy(cluster="local", policy="ed", vw_size=2, num_in_flight=2, dilation=1.0,
                           launch="processes", timeout_s=60)
x, y = (np.concatenate(part) for part in zip(*vector_batches(16)))
with strategy.scope():
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    keras.utils.set_random_seed(0)
    model = ResidualMLP()
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(data, epochs=2, verbose=0)
servers = strategy.runner.servers.variables
print("RESULT " + json.dumps({
    "runner": type(strategy.runner).__name__, "loss": history.history["loss"],
    "held": max(float(np.abs(v.numpy() - servers[v.path].numpy()).max()) for v in model.trainable_variables)}))
"""


@pytest.mark.slow
def test_a_subclassed_model_trains_with_a_process_per_virtual_worker():
    """launch="processes": each worker's process rebuilds the model from its trace (its class is
    never rebuilt there), trains its stages against the chief's servers; the user's model ends
    holding the global weights and the loss goes down."""
    proc = subprocess.run([sys.executable, "-c", TRAIN], cwd=ROOT, capture_output=True, text=True, timeout=500)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["runner"] == "ProcessRunner" and result["held"] == 0.0
    assert result["loss"][1] < result["loss"][0]
