import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.cli.hetpipe_flags import OPTIMIZERS
from hetpipe_tf.runtime.optimizers import (
    NAMES, SUPPORTED, UnsupportedOptimizerError, by_name, check_optimizer, slots_per_weight, stage_optimizer)
from hetpipe_tf.runtime.virtual_worker import VirtualWorker

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS = 5

# Every supported optimizer, most with settings other than their defaults; among them per-variable
# clipping (clipnorm, clipvalue) and decoupled weight decay on optimizers other than AdamW.
OPTIMIZERS_TRAINED = {
    "SGD": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True, clipnorm=0.5),
    "Adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "AdamW": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "Adamax": lambda: keras.optimizers.Adamax(0.01, clipvalue=0.02),
    "Nadam": lambda: keras.optimizers.Nadam(0.01),
    "Lion": lambda: keras.optimizers.Lion(0.003, weight_decay=0.1),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01,
                                          l2_shrinkage_regularization_strength=0.01, beta=0.1),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "Lamb": lambda: keras.optimizers.Lamb(0.01, weight_decay=0.05),
    "Muon": lambda: keras.optimizers.Muon(0.01),
    "ScheduleFreeAdamW": lambda: keras.optimizers.ScheduleFreeAdamW(0.01, warmup_steps=2),
}


def _model():
    """Three dense layers (a stage each at k = 3): 2-D kernels (Muon's Newton-Schulz, Adafactor's
    factored moments) and 1-D biases (their Adam and unfactored paths)."""
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="d0"),
                             keras.layers.Dense(8, activation="tanh", name="d1"), keras.layers.Dense(5, name="d2")],
                            name="m")


def _batches():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(4, 6)).astype("float32"), rng.integers(0, 5, size=4)) for _ in range(STEPS)]


def _keras_trained(optimizer, exclude=None):
    """The model's weights after plain Keras training on the batches (train_on_batch), run eagerly
    (no train function to trace). Built inside a traced train step, ScheduleFreeAdamW's slots would
    start at zero where its build sets them to the weights (the variables' initial values are lifted
    out of the trace, the assign is not); run eagerly, as the pipeline's stages build, they do not."""
    model = _model()
    model.compile(optimizer=optimizer, loss=LOSS, run_eagerly=True)
    if exclude:
        exclude(model, optimizer)
    for x, y in _batches():
        model.train_on_batch(x, y)
    return [v.numpy() for v in model.weights]


def _pipeline_trained(optimizer, k, exclude=None):
    """The model and its virtual worker of k stages on the host CPU after training at Nm = 1. The
    stages' solo times are given (they pace emulated devices only), so they are not measured first."""
    model = _model()
    if exclude:
        exclude(model, optimizer)
    vw = VirtualWorker(model, ",".join(["cpu"] * k), num_in_flight=1, optimizer=optimizer, loss=LOSS, timeout_s=60,
                       references=[(1.0, 1.0)] * k)
    vw.train(iter(_batches()), STEPS)
    return model, vw


def _assert_equal_weights(model, want):
    for v, w in zip(model.weights, want):
        np.testing.assert_allclose(v.numpy(), w, atol=1e-5, err_msg=v.path)


@pytest.mark.parametrize("name", SUPPORTED)
def test_each_supported_optimizer_at_nm1_equals_keras_at_2_and_3_stages(name):
    make = OPTIMIZERS_TRAINED[name]
    want = _keras_trained(make())
    start = [v.numpy() for v in _model().weights]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(want, start)) > 1e-3  # it trained
    for k in (2, 3):
        model, vw = _pipeline_trained(make(), k)
        assert vw.num_stages == k
        _assert_equal_weights(model, want)
        assert [int(rt.optimizer.iterations) for rt in vw.runtimes] == [STEPS] * k


def _exclude(model, optimizer):
    """Stage 0's kernel by variable, stage 2's kernel and every bias by name: only d1's kernel decays."""
    optimizer.exclude_from_weight_decay(var_list=[model.get_layer("d0").kernel], var_names=["d2/kernel", "bias"])


def test_adamw_excludes_from_weight_decay_by_variable_and_by_name_on_every_stage():
    make = lambda: keras.optimizers.AdamW(0.02, weight_decay=2.0)  # noqa: E731 - a decay that shows
    want = _keras_trained(make(), exclude=_exclude)
    model, vw = _pipeline_trained(make(), 3, exclude=_exclude)
    assert [[v.path for v in rt.trainable] for rt in vw.runtimes] == [
        ["m/d0/kernel", "m/d0/bias"], ["m/d1/kernel", "m/d1/bias"], ["m/d2/kernel", "m/d2/bias"]]
    _assert_equal_weights(model, want)
    # Without the exclusions every weight decays: the excluded ones would differ.
    decayed = _keras_trained(make())
    excluded = [i for i, v in enumerate(model.weights) if v.path != "m/d1/kernel"]
    for i in excluded:
        assert np.max(np.abs(model.weights[i].numpy() - decayed[i])) > 1e-3, model.weights[i].path


def test_a_learning_rate_schedule_follows_the_applied_updates_on_every_stage():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)
    want = _keras_trained(keras.optimizers.AdamW(schedule))
    model = _model()
    optimizer = keras.optimizers.AdamW(schedule)
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=1, optimizer=optimizer, loss=LOSS, timeout_s=60,
                       references=[(1.0, 1.0)] * 2)
    x, y = (np.concatenate(parts) for parts in zip(*_batches()))
    vw.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True), epochs=1, verbose=0)
    _assert_equal_weights(model, want)
    assert int(optimizer.iterations) == STEPS  # what callbacks read
    for rt in vw.runtimes:
        assert int(rt.optimizer.iterations) == STEPS
        assert float(rt.optimizer.learning_rate) == pytest.approx(0.05 * 0.5 ** STEPS)


@pytest.mark.parametrize("make,message", [
    (lambda: keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(keras.optimizers.SGD())),
     r"optimizer MultiOptimizer is not supported: it gives each variable one of several optimizers"),
    (lambda: type("MyAdam", (keras.optimizers.Adam,), {})(),
     r"optimizer MyAdam is not supported; supported: keras.optimizers.SGD, keras.optimizers.Adam, "
     r"keras.optimizers.AdamW, .* keras.optimizers.ScheduleFreeAdamW \(those whose update of a variable depends "
     r"only on that variable"),
    (lambda: keras.optimizers.Adam(use_ema=True), r"optimizer Adam with use_ema=True: keeps a moving average"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(use_ema=True)),
     r"optimizer Adam with use_ema=True"),
    (lambda: keras.optimizers.SGD(gradient_accumulation_steps=2),
     r"optimizer SGD with gradient_accumulation_steps=2: applies one update per so many minibatches"),
    (lambda: keras.optimizers.Lion(loss_scale_factor=128.0),
     r"optimizer Lion with loss_scale_factor=128.0: divides the gradients by it"),
])
def test_a_refused_optimizer_says_why(make, message):
    with pytest.raises(UnsupportedOptimizerError, match=message):
        check_optimizer(make())
    with pytest.raises(UnsupportedOptimizerError, match=message):
        VirtualWorker(_model(), "cpu,cpu", optimizer=make(), loss=LOSS)


def test_a_stage_copy_has_the_config_and_excludes_the_copies_of_the_excluded_variables():
    model = _model()
    opt = keras.optimizers.AdamW(0.05, weight_decay=0.1, clipnorm=1.0)
    opt.exclude_from_weight_decay(var_list=[model.get_layer("d1").kernel], var_names=["bias"])
    originals = model.get_layer("d1").trainable_variables
    copies = [keras.Variable(v.numpy(), name=v.name) for v in originals]
    copy = stage_optimizer(opt, originals, copies)
    assert copy is not opt and copy.get_config() == opt.get_config()
    assert [copy._use_weight_decay(v) for v in copies] == [False, False]  # kernel by variable, bias by name
    assert copy._use_weight_decay(keras.Variable(np.zeros(2), name="kernel"))
    assert isinstance(check_optimizer("adamw"), keras.optimizers.AdamW)


def test_slots_per_weight_counts_what_each_keras_build_adds():
    model = _model()
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    for name, make in OPTIMIZERS_TRAINED.items():
        optimizer = make()
        optimizer.build(model.trainable_variables)
        # Values in optimizer variables other than scalars (the iteration count, the learning rate,
        # Nadam's u_product, Adafactor's placeholders for vectors).
        values = sum(int(np.prod(v.shape)) for v in optimizer.variables if v.shape != ())
        slots = slots_per_weight(optimizer)
        if name == "Muon":  # a bound: 2-D kernels get a momentum only, the biases a velocity too
            kernels = sum(int(np.prod(v.shape)) for v in model.trainable_variables if len(v.shape) == 2)
            assert values == 2 * weights - kernels and slots == 2, name
        elif name == "Adafactor":  # its velocity, and the factored moments of each m x n kernel: m + n
            factored = sum(sum(v.shape) for v in model.trainable_variables if len(v.shape) == 2)
            assert values == weights + factored and slots == 1, name
        else:
            assert values == slots * weights, name
    assert [slots_per_weight(o) for o in (keras.optimizers.SGD(), keras.optimizers.RMSprop(momentum=0.5),
                                          keras.optimizers.Adam(amsgrad=True))] == [0, 2, 3]


def test_by_name_makes_every_name_the_optimizer_flags_take():
    assert OPTIMIZERS == NAMES and len(NAMES) == len(SUPPORTED)
    for name in NAMES:
        assert type(check_optimizer(by_name(name, 0.001))).__name__.lower() == name
    adamw = by_name("adamw", 0.002, weight_decay=0.05)
    assert (type(adamw), adamw.weight_decay) == (keras.optimizers.AdamW, 0.05)
    assert float(adamw.learning_rate) == pytest.approx(0.002)
    assert by_name("sgd", momentum=0.9).momentum == 0.9
    with pytest.raises(UnsupportedOptimizerError, match=r"unknown optimizer 'adamx'; allowed: sgd, adam, adamw, "):
        by_name("adamx")
