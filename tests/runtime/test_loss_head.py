"""compile's loss, loss_weights and metrics mean what they mean to Keras: each structure is
trained by Keras (train_on_batch) and by a virtual worker with Nm = 1 from the same weights;
the weights, the logged names and the logged values must agree."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.runtime.loss_head import LossHead
from hetpipe_tf.runtime.virtual_worker import VirtualWorker

BATCH, STEPS = 8, 10
OUTPUTS = ("cls", "reg", "bin")
HETPIPE_LOGS = {"images_per_s", "global_clock"}  # hetpipe_tf's own epoch logs, besides Keras's
# Keras's optimizer warns of the heads without a loss (no gradient); hetpipe_tf gives them zeros.
pytestmark = pytest.mark.filterwarnings("ignore:Gradients do not exist for variables")


def _model():
    """Named, so that a strategy measures its profile once (the cache is keyed by the model's name)."""
    inputs = keras.Input((6,))
    trunk = keras.layers.Dense(8, activation="relu", name="trunk")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(4, activation="softmax", name="cls")(trunk),
                                keras.layers.Dense(2, name="reg")(trunk),
                                keras.layers.Dense(1, activation="sigmoid", name="bin")(trunk)], name="three_heads")


def _data(labels):
    """(x, y) of STEPS minibatches at once; y a tuple (cls's labels sparse or one-hot), a dict by
    output name, or reg's alone."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    x = rng.normal(size=(n, 6)).astype("float32")
    y = {"cls": rng.integers(0, 4, n), "reg": rng.normal(size=(n, 2)).astype("float32"),
         "bin": rng.integers(0, 2, (n, 1)).astype("float32")}
    one_hot = (np.eye(4, dtype="float32")[y["cls"]], y["reg"], y["bin"])
    return x, {"tuple": tuple(y[k] for k in OUTPUTS), "one-hot": one_hot, "dict": y, "reg": y["reg"]}[labels]


def _batches(x, y):
    cut = lambda v, i: keras.tree.map_structure(lambda a: a[i * BATCH:(i + 1) * BATCH], v)  # noqa: E731
    return [(cut(x, i), cut(y, i)) for i in range(STEPS)]


def _twins():
    keras.utils.set_random_seed(0)
    model = _model()
    twin = _model()
    twin.set_weights(model.get_weights())
    return model, twin


def _keras_train(model, compiled, batches):
    """Keras's weights after the steps and its logs averaged over them (its epoch logs)."""
    model.compile(optimizer=keras.optimizers.SGD(0.1), **compiled)
    steps = [model.train_on_batch(x, y, return_dict=True) for x, y in batches]
    return model.get_weights(), {k: np.mean([s[k] for s in steps]) for k in steps[0]}


def _sparse_ce_scaled(y_true, y_pred):
    return 0.5 * keras.losses.sparse_categorical_crossentropy(y_true, y_pred)


def _top_probability(y_true, y_pred):
    return keras.ops.max(y_pred, axis=-1)


STRUCTURES = {
    "one loss for all outputs, one weight": (
        "one-hot", lambda: dict(loss="mse", loss_weights=0.5)),
    "lists": ("tuple", lambda: dict(
        loss=["crossentropy", "mse", "binary_crossentropy"], loss_weights=[1.0, 0.5, 2.0],
        metrics=["accuracy", ["mae", "mse"], None])),
    "dicts by output name, None for an output": ("dict", lambda: dict(
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(), "reg": None, "bin": "binary_crossentropy"},
        loss_weights={"cls": 0.3, "reg": 1.0, "bin": 1.5},
        metrics={"cls": "accuracy", "bin": [keras.metrics.BinaryAccuracy(name="ba"), "mse"]})),
    "functions and objects, repeated metric names": ("tuple", lambda: dict(
        loss=[_sparse_ce_scaled, keras.losses.Huber(), keras.losses.BinaryCrossentropy(label_smoothing=0.1)],
        metrics=[[_top_probability], keras.metrics.MeanAbsoluteError(),
                 [keras.metrics.BinaryAccuracy(), keras.metrics.BinaryAccuracy()]])),
    "a loss for one output, labels for it alone": ("reg", lambda: dict(loss=[None, "mse", None])),
}


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_virtual_worker_trains_and_logs_like_keras(structure):
    labels, compiled = STRUCTURES[structure]
    compiled = compiled()  # one set of objects for both: the head must not disturb Keras's metrics
    model, twin = _twins()
    x, y = _data(labels)
    want, keras_logs = _keras_train(model, compiled, _batches(x, y))
    vw = VirtualWorker(twin, "cpu,cpu", num_in_flight=1, optimizer=keras.optimizers.SGD(0.1),
                       timeout_s=60, **compiled)
    history = vw.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True),
                       epochs=1, verbose=0)
    logs = {k: v[0] for k, v in history.history.items() if k not in HETPIPE_LOGS}
    assert sorted(logs) == sorted(keras_logs)
    for k, v in keras_logs.items():
        assert logs[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for got, w in zip(twin.get_weights(), want):
        np.testing.assert_allclose(got, w, atol=1e-5)


@pytest.mark.parametrize("structure", ["dicts by output name, None for an output", "lists"])
def test_strategy_trains_and_logs_like_keras(structure):
    labels, compiled = STRUCTURES[structure]
    compiled = compiled()
    model, twin = _twins()
    x, y = _data(labels)
    want, keras_logs = _keras_train(model, compiled, _batches(x, y))
    cluster = {"name": "one", "device_types": {"F": {"label": "emulated", "emulated_speed": 1.0, "memory": "64M"}},
               "nodes": [{"name": "host", "device_type": "F", "count": 2}],
               "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0}}
    strategy = HetPipeStrategy(cluster=cluster, policy="np", num_in_flight=1, launch="in_process", dilation=1)
    with strategy.scope():
        twin.compile(optimizer=keras.optimizers.SGD(0.1), **compiled)
    history = twin.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True),
                       epochs=1, verbose=0)
    logs = {k: v[0] for k, v in history.history.items() if k not in HETPIPE_LOGS | {"emulated_overrun_fraction"}}
    assert sorted(logs) == sorted(keras_logs)
    for k, v in keras_logs.items():
        assert logs[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for got, w in zip(twin.get_weights(), want):
        np.testing.assert_allclose(got, w, atol=1e-5)


# Rejected -----------------------------------------------------------------------------------
def _head_error(compiled, labels="one-hot"):
    """The error of a loss head's first minibatch."""
    model = _model()
    x, y = _batches(*_data(labels))[0]
    with pytest.raises(ValueError) as info:
        head = LossHead(compiled.get("loss"), model.output_names, loss_weights=compiled.get("loss_weights"),
                        metrics=compiled.get("metrics"))
        head.metrics(head.split_labels(y), model(x))
    return str(info.value)


@pytest.mark.parametrize("compiled,message", [
    (dict(loss={"cls": "mse", "bin": "mse"}), r"Expected keys \['cls', 'reg', 'bin'\] in loss dict"),
    (dict(loss="mse", loss_weights=2), "Expected `loss_weights` argument to be a float"),
    (dict(loss=["mse", "mse", "mse"], loss_weights=[1.0, 2.0]), "`loss_weights` must match the number of losses"),
    (dict(loss="mse", metrics="mae"), "Expected `metrics` argument to be a list, tuple, or dict"),
    (dict(loss="mse", metrics=["mae"]), r"Invalid `metrics`"),
])
def test_what_keras_rejects_is_rejected(compiled, message):
    with pytest.raises(ValueError, match=message):
        model = _model()
        model.compile(optimizer="sgd", **compiled)
        model.train_on_batch(*_batches(*_data("one-hot"))[0])
    assert re.search(message, _head_error(compiled))


@pytest.mark.parametrize("metric", [keras.metrics.AUC(), keras.metrics.RootMeanSquaredError(), "precision"])
def test_metrics_that_are_not_means_are_rejected(metric):
    error = _head_error(dict(loss="mse", metrics={"bin": [metric]}))
    assert error.startswith("metrics: ") and "is not a mean over samples" in error


def test_a_rejected_metric_stops_the_virtual_worker_before_training():
    model = _model()
    x, y = _data("one-hot")
    vw = VirtualWorker(model, "cpu", num_in_flight=1, loss="mse", metrics={"bin": ["auc"]}, timeout_s=60)
    with pytest.raises(ValueError, match="metrics: 'auc' .* is not a mean over samples"):
        vw.train(iter(_batches(x, y)), STEPS)


def test_strategy_names_what_it_does_not_support():
    strategy = HetPipeStrategy(cluster="local", policy="np", launch="in_process", dilation=1)
    with strategy.scope():
        model = _model()
        with pytest.raises(ValueError, match=r"takes compile\(weighted_metrics=...\) as a list, .* got "
                                             r"weighted_metrics=\['mae'\] with metrics=\{'reg': \['mse'\]\}"):
            model.compile(optimizer="sgd", loss="mse", metrics={"reg": ["mse"]}, weighted_metrics=["mae"])
        model.compile(optimizer="sgd", loss="mse")
    x, y = _data("tuple")
    for argument in ("sample_weight", "class_weight"):
        with pytest.raises(ValueError, match=rf"does not take \['{argument}'\] \({argument}: every sample"):
            model.fit(x, y, **{argument: np.ones(len(x))})
