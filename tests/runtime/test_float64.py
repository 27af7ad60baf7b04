"""A model built under ``keras.config.set_floatx("float64")`` (float64 weights) trains as Keras's own
``fit`` trains it: on float32 or float64 inputs (its layers cast them, as in Keras), with its
regularisation losses, a clip by the global norm and loss scaling computed in float64; in one
virtual worker and under WSP. Under loss scaling a regulariser's gradient on a stage before the
last is scaled and unscaled as Keras's (float32 too)."""
import keras
import numpy as np
import pytest

from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from hetpipe_tf.runtime.wsp_runner import WSPRunner
from hetpipe_tf.sync.pipe_sgd import CompressionDtypeError, PipeSGD
from tests.helpers.references import keras_fit_weights, max_difference

STEPS, BATCH = 5, 8


@pytest.fixture
def floatx():
    """Sets floatx and the dtype policy for the test (both global: Keras keeps the policy it first
    made from floatx, so setting floatx alone does not change it); both as they were after it."""
    policy = keras.config.dtype_policy()

    def set_both(dtype):
        keras.config.set_floatx(dtype)
        keras.config.set_dtype_policy(dtype)

    yield set_both
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy(policy)


def _model(scale=1.0):
    """An MLP of floatx's dtype (an L2 regulariser on its first layer); every initial weight times `scale`."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((12,)),
                              keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(5)], name="mlp")
    for v in model.weights:
        v.assign(v.numpy() * scale)
    return model


def _batches(dtype):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(BATCH, 12)).astype(dtype), rng.integers(0, 5, size=BATCH)) for _ in range(STEPS)]


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.05),
    "loss_scaled_sgd": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
}


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # computes in floatx's dtype


def _keras_run(optimizer, batches):
    """Keras's weights after the fit, and the tolerance: ten times how far Keras's own run moves
    when its initial weights are scaled by 1 + 1e-7."""
    want = keras_fit_weights(_model(), OPTIMIZERS[optimizer](), _loss(), batches)
    moved = keras_fit_weights(_model(scale=1 + 1e-7), OPTIMIZERS[optimizer](), _loss(), batches)
    return want, 10 * max_difference(want, moved)


def _check_trained(model, want, tolerance, dtype):
    assert {v.dtype for v in model.weights} == {dtype}
    assert max_difference([v.numpy() for v in model.weights], want) < tolerance
    assert max_difference(want, [v.numpy() for v in _model().weights]) > 10 * tolerance  # it trained


@pytest.mark.parametrize("dtype, optimizer, inputs", [
    ("float64", "sgd", "float32"), ("float64", "sgd", "float64"), ("float64", "adam_global_clipnorm", "float32"),
    ("float64", "loss_scaled_sgd", "float32"), ("float32", "loss_scaled_sgd", "float32")])
def test_a_model_trains_as_keras_fit_trains_it(floatx, dtype, optimizer, inputs):
    """Four stages on emulated devices, Nm = 1 (Keras's order of updates)."""
    floatx(dtype)
    batches = _batches(inputs)
    want, tolerance = _keras_run(optimizer, batches)
    model = _model()
    vw = VirtualWorker(model, "1,0.5,1,1", num_in_flight=1, optimizer=OPTIMIZERS[optimizer](), loss=_loss(),
                       timeout_s=60, references=[(1e-3, 1e-3)] * 4)
    vw.train(iter(batches), STEPS)
    _check_trained(model, want, tolerance, dtype)


def test_a_float64_model_trains_under_wsp_as_keras_fit_trains_it(floatx):
    """One virtual worker of two stages, Nm = 1, D = 0: its pushes to the parameter server and
    pulls from it keep float64; SGD's updates add up to Keras's."""
    floatx("float64")
    batches = _batches("float32")
    want, tolerance = _keras_run("sgd", batches)
    model = _model()
    config = RunConfig(num_in_flight=1, staleness_bound=0, optimizer=OPTIMIZERS["sgd"](), loss=_loss(), timeout_s=60)
    workers = [WorkerSpec("cpu,cpu", boundaries=(0, 2), references=((1.0, 1.0),) * 2)]
    WSPRunner(model, workers, config, ["/cpu:0"]).train([iter(batches)], STEPS)
    _check_trained(model, want, tolerance, "float64")


@pytest.mark.parametrize("compression", ["truncate16", "quant8"])
def test_pipe_sgd_compressions_of_float32_values_refuse_float64_weights_before_training(floatx, compression):
    floatx("float64")
    config = RunConfig(num_in_flight=1, staleness_bound=0, optimizer=OPTIMIZERS["sgd"](), loss=_loss(), timeout_s=60,
                       sync=PipeSGD(compression=compression))
    workers = [WorkerSpec("cpu", (f"/device:CPU:{w}",), references=((1.0, 1.0),)) for w in range(2)]
    with pytest.raises(CompressionDtypeError, match=rf"Pipe-SGD's {compression} compression compresses float32 "
                                                    r"weights only; this stage holds \['float64'\] \(8 weights, "
                                                    r"first mlp/dense\w*/kernel\)\. Use compression='none'"):
        WSPRunner(_model(), workers, config, ["/device:CPU:0"]).train([iter(_batches("float32"))] * 2, STEPS)
