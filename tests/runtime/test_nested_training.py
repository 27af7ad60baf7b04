"""Training nested models pipelined: a model used as a layer is cut inside, trains as Keras
does, and its trained weights land in the user's nested model."""
import keras
import numpy as np

from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from tests.helpers import models
from tests.helpers.data import gpt2_batches, random_batches
from tests.helpers.models import LOSS
from tests.helpers.references import clone, stale_sgd_reference


def _nested_model_cut_inside(vw):
    """Whether the model's first nested model has layer calls in two stages or more."""
    nested = next(layer.name for layer in vw.model.layers if isinstance(layer, keras.Model)) + "/"
    nodes = vw.staged.graph.nodes
    return len({s.index for s in vw.staged.stages for i in s.io.nodes if nodes[i].layer.startswith(nested)}) >= 2


def test_gpt2_backbone_as_a_layer_at_nm1_equals_keras_and_its_weights_land_in_the_backbone(tmp_path):
    keras.utils.set_random_seed(8)
    model = models.gpt2_backbone_as_layer()
    ref = clone(model)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, jit_compile=False)
    data = gpt2_batches(5)
    for x, y in data:
        ref.train_on_batch(x, y)
    vw = VirtualWorker(model, "cpu,cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                       timeout_s=60)
    assert _nested_model_cut_inside(vw)
    vw.train(iter(data), 5)
    for got, want in zip(model.weights, ref.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, err_msg=got.path)
    # The user's backbone object holds the trained weights: it and the model save and load back.
    backbone = next(layer for layer in model.layers if isinstance(layer, keras.Model))
    for got, want in zip(backbone.weights, ref.get_layer(backbone.name).weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, err_msg=got.path)
    x, _ = data[0]
    model.save(tmp_path / "model.keras")
    backbone.save(tmp_path / "backbone.keras")
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "model.keras")(x), model(x), atol=1e-6)
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "backbone.keras")(x), backbone(x), atol=1e-6)


def _nm_k_equals_stale_sgd(model, batches, k):
    """Nm = k: minibatch p's gradient is taken at the weights after updates 1..p-k (HetPipe §4)."""
    want, _ = stale_sgd_reference(model, batches, k, keras.optimizers.SGD(0.1))
    vw = VirtualWorker(model, ",".join(["cpu"] * k), num_in_flight=k, optimizer=keras.optimizers.SGD(0.1),
                       loss=LOSS, timeout_s=60)
    assert _nested_model_cut_inside(vw)
    vw.train(iter(batches), len(batches))
    for got, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), w, atol=1e-5, err_msg=got.path)


def test_model_of_models_at_nm_k_equals_stale_sgd():
    keras.utils.set_random_seed(9)
    model = models.model_of_models()
    _nm_k_equals_stale_sgd(model, random_batches(model, 8), k=3)


def test_gpt2_backbone_as_a_layer_at_nm_k_equals_stale_sgd():
    keras.utils.set_random_seed(9)
    _nm_k_equals_stale_sgd(models.gpt2_backbone_as_layer(), gpt2_batches(6, seed=1), k=3)
