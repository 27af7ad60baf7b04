"""Checkpointed optimizer state of every supported optimizer (hetpipe_tf.runtime.checkpoint): a run
of one virtual worker at Nm = 1 saved after an epoch and resumed by new objects, under the same
cut or another, ends with the weights and optimizer state of the run never stopped. Among them the
optimizers whose state depends on a weight's shape or path (Adafactor's factored moments, Muon's
AdamW slots of the weights it does not orthogonalise) and Nadam's scalar of its own."""
import functools
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.runtime.checkpoint import Checkpoints, PlanCuts, stage_optimizer_state
from hetpipe_tf.runtime.fit_loop import FitOptions, fit
from hetpipe_tf.runtime.optimizers import SUPPORTED
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.wsp_runner import WSPRunner

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
EPOCHS, STEPS = 2, 3  # minibatches per epoch
CUT = (0, 3)  # two stages: the embedding and the hidden layer, then the logits
OTHER_CUT = (0, 2, 3)  # three stages: the hidden layer's weights and slots move to another stage

# Every supported optimizer, several with settings that add slots (amsgrad, momentum, centered)
# or read the iteration count (a learning-rate schedule, warm-up).
OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "Adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "AdamW": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "Adamax": lambda: keras.optimizers.Adamax(0.01),
    "Nadam": lambda: keras.optimizers.Nadam(0.01),
    "Lion": lambda: keras.optimizers.Lion(0.003),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "Adagrad": lambda: keras.optimizers.Adagrad(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.8)),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01, beta=0.1),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "Lamb": lambda: keras.optimizers.Lamb(0.01),
    "Muon": lambda: keras.optimizers.Muon(0.01),
    "ScheduleFreeAdamW": lambda: keras.optimizers.ScheduleFreeAdamW(0.01, warmup_steps=2),
}
# A worker's one dynamic loss scale (fp16's recipe), grown after every 2 clean minibatches: it moves
# within the run, and is checkpointed with the optimizer's state.
OPTIMIZERS_SCALED = {"AdamW, loss scaled": lambda: keras.optimizers.LossScaleOptimizer(
    keras.optimizers.AdamW(0.01), initial_scale=2.0 ** 8, dynamic_growth_steps=2)}
# Whose state depends on a weight's shape or path: resumed under another cut in CI too.
SHAPED = ("Adafactor", "Muon")


def _model():
    """An embedding (Muon updates it with AdamW, by its path), a matrix (Muon's Newton-Schulz,
    Adafactor's factored moments) and vectors (their AdamW and unfactored paths)."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(10, 4, name="token_embedding")(ids)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(h)
    return keras.Model(ids, keras.layers.Dense(5, name="logits")(h), name="m")


def _data():
    rng = np.random.default_rng(0)
    n = 4 * EPOCHS * STEPS
    return tf.data.Dataset.from_tensor_slices(
        (rng.integers(0, 10, size=(n, 3)).astype("int32"), rng.integers(0, 5, size=n))).batch(4, drop_remainder=True)


def _runner(model, name, cut):
    """One virtual worker of host-CPU stages starting at `cut`, Nm = 1, D = 0 (its solo times given:
    they pace emulated devices only)."""
    k = len(cut)
    spec = WorkerSpec(",".join(["cpu"] * k), tuple(f"/device:CPU:{s}" for s in range(k)), boundaries=cut,
                      references=((1.0, 1.0),) * k)
    config = RunConfig(num_in_flight=1, optimizer={**OPTIMIZERS, **OPTIMIZERS_SCALED}[name](), loss=LOSS, dilation=1,
                       timeout_s=60)
    return WSPRunner(model, [spec], config, ["/device:CPU:0"])


class _CopyAfterFirstEpoch(keras.callbacks.Callback):
    """Copies the checkpoint directory as it is after the first epoch's save (a run stopped there)."""

    def __init__(self, directory, copy):
        super().__init__()
        self.directory, self.copy = directory, copy

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            shutil.copytree(self.directory, self.copy)


def _ended(runner):
    """The run's weights, each stage's optimizer variables, and the state per model variable."""
    runtimes = runner.vws[0].runtimes
    return ([v.numpy() for v in runner.model.variables],
            [[v.numpy() for v in rt.optimizer.variables] for rt in runtimes],
            stage_optimizer_state(runtimes, runner.model))


@functools.cache
def _uninterrupted(name, directory):
    """The run of EPOCHS never stopped, which saves at every epoch's end; `directory`/`name`/stopped
    then holds its checkpoint after the first epoch."""
    directory = f"{directory}/{name}"
    runner = _runner(_model(), name, CUT)
    fit(runner, _data(), FitOptions(epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
                                    checkpoints=Checkpoints(f"{directory}/whole"), plan=PlanCuts(1, (tuple(CUT),)),
                                    callbacks=[_CopyAfterFirstEpoch(f"{directory}/whole", f"{directory}/stopped")]))
    return _ended(runner)


def _resumed(name, directory, cut):
    """A new model and runner at `cut` that resume the run stopped after the first epoch (a copy of its
    checkpoints, which the resumed run adds to) and end it."""
    model = _model()
    copy = shutil.copytree(f"{directory}/{name}/stopped", f"{directory}/{name}/resumed-at-{'-'.join(map(str, cut))}")
    checkpoints = Checkpoints(copy)
    state = checkpoints.restore_model(model)
    assert state.epoch == 1 and state.positions == [STEPS]
    runner = _runner(model, name, cut)
    runner.resume(state)
    history = fit(runner, _data(), FitOptions(epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
                                              initial_epoch=state.epoch, positions=state.positions,
                                              checkpoints=checkpoints, plan=PlanCuts(1, (tuple(cut),))))
    assert len(history.history["loss"]) == EPOCHS - 1
    return _ended(runner)


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64")))) for x, y in zip(a, b))


def _flat(state):
    """A worker's optimizer state as {key: value}, keys as in the checkpoint."""
    return dict([(("scalar", k), v) for k, v in state["scalars"].items()]
                + [(("slot", p, s), v) for p, slots in state["slots"].items() for s, v in slots.items()])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


def test_every_supported_optimizer_has_a_case():
    assert sorted(OPTIMIZERS) == sorted(SUPPORTED)


@pytest.mark.parametrize("name", SUPPORTED)
def test_resumed_under_the_same_cut_it_ends_as_the_run_never_stopped(name, runs):
    weights, optimizers, state = _uninterrupted(name, runs)
    got_weights, got_optimizers, got_state = _resumed(name, runs, CUT)
    assert _max_diff(got_weights, weights) <= 1e-6
    # Every optimizer variable of every stage, whatever its checkpoint key (slots, iteration, Nadam's u_product).
    for got, want in zip(got_optimizers, optimizers):
        assert len(got) == len(want) and _max_diff(got, want) <= 1e-6
    # Every trainable weight's slots were saved, under its own position.
    assert sorted(_flat(got_state)) == sorted(_flat(state))
    assert sorted(state["slots"]) == list(range(5))
    assert int(state["scalars"]["iteration"]) == EPOCHS * STEPS


def _check_other_cut(name, runs):
    weights, _, state = _uninterrupted(name, runs)
    got_weights, got_optimizers, got_state = _resumed(name, runs, OTHER_CUT)
    assert len(got_optimizers) == len(OTHER_CUT)
    assert _max_diff(got_weights, weights) <= 1e-6
    want, got = _flat(state), _flat(got_state)
    assert sorted(got) == sorted(want)
    assert _max_diff([got[k] for k in sorted(want)], [want[k] for k in sorted(want)]) <= 1e-6


@pytest.mark.parametrize("name", SHAPED)
def test_resumed_under_another_cut_shape_dependent_state_ends_as_the_run_never_stopped(name, runs):
    _check_other_cut(name, runs)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SUPPORTED if n not in SHAPED])
def test_resumed_under_another_cut_it_ends_as_the_run_never_stopped(name, runs):
    _check_other_cut(name, runs)


def test_the_loss_scale_is_saved_and_resumed_with_the_optimizer_state(runs):
    name = "AdamW, loss scaled"
    weights, optimizers, state = _uninterrupted(name, runs)
    got_weights, got_optimizers, got_state = _resumed(name, runs, CUT)
    # Grown from 2^8 after every 2 clean minibatches of the 6, the last growth in the resumed epoch.
    assert float(state["scalars"]["loss_scale"]) == 2.0 ** 11 and int(state["scalars"]["loss_scale_counter"]) == 0
    assert _flat(got_state).keys() == _flat(state).keys()
    assert _max_diff(list(_flat(got_state).values()), list(_flat(state).values())) <= 1e-6
    assert _max_diff(got_weights, weights) <= 1e-6
