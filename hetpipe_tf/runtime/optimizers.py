"""Which Keras optimizers a pipelined virtual worker supports, and one copy per stage.

Every stage applies its own minibatch updates to its own weights (§4:
w_local = w_local + u_p), with its own copy of the user's optimizer built from
the same config, so that with Nm = 1 the updates are exactly plain Keras
training's. That holds for an optimizer exactly when its update of a variable
depends only on that variable, its gradient and its own slots, the iteration
count and the learning rate: every stage applies every minibatch, so each
copy's iteration count, and a learning-rate schedule read from it, is Keras's.

Per variable in Keras 3: SGD, Adam, AdamW, Adamax, Nadam (its one scalar
``u_product`` follows the iteration count alone), Lion, Adafactor (its factored
moments and its step size come from the variable and its gradient), Adagrad,
Adadelta, Ftrl, RMSprop, Lamb (its trust ratio is the norm of the variable over
the norm of its update, per variable), Muon (Newton-Schulz on each 2-D variable
whole; a cut never splits a variable) and ScheduleFreeAdamW. Any of them with
``weight_decay`` (decoupled, per variable) and ``clipnorm`` or ``clipvalue``
(per gradient). A stage's weights keep the model variables' names and paths,
which weight-decay exclusion by name and Muon's exclusions match against;
exclusions by variable (``exclude_from_weight_decay(var_list=...)``) are held by
identity, and :func:`stage_optimizer` gives them to the stage's copies.

Ftrl and ScheduleFreeAdamW keep the weights themselves in their slots (Ftrl's
``linear``, the schedule-free base sequence), so a change that a WSP pull merges
into w_local (§5) does not last: Ftrl's next step recomputes the weight from
its slots, and the schedule-free average keeps a shrinking share of it. With
one virtual worker they are exact.

Two settings couple the stages, and a virtual worker runs them with terms every
stage's update takes (:mod:`hetpipe_tf.runtime.update_terms`, :func:`update_rule_of`):
``global_clipnorm``, and the wrapper ``LossScaleOptimizer`` (which Keras's
``compile`` makes under the ``mixed_float16`` policy); each stage's copy is then
the inner optimizer without its global clip (:func:`stage_optimizer`).

Refused, each with its reason (:func:`check_optimizer`): settings that need the
pipeline's own support (``use_ema``, ``gradient_accumulation_steps``,
``loss_scale_factor``), and the wrapper MultiOptimizer.
"""
from collections.abc import Sequence

import keras

from hetpipe_tf import compat
from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.runtime.update_terms import LossScaling, UpdateRule

#: Supported optimizer class -> optimizer variables per weight, from its config (what each Keras
#: 3 ``build`` adds per model variable; see :func:`slots_per_weight`).
_SLOTS = {
    keras.optimizers.SGD: lambda c: int(c["momentum"] != 0),
    keras.optimizers.Adam: lambda c: 2 + int(bool(c["amsgrad"])),
    keras.optimizers.AdamW: lambda c: 2 + int(bool(c["amsgrad"])),
    keras.optimizers.Adamax: lambda c: 2,
    keras.optimizers.Nadam: lambda c: 2,
    keras.optimizers.Lion: lambda c: 1,
    keras.optimizers.Adafactor: lambda c: 1,
    keras.optimizers.Adagrad: lambda c: 1,
    keras.optimizers.Adadelta: lambda c: 2,
    keras.optimizers.Ftrl: lambda c: 2,
    keras.optimizers.RMSprop: lambda c: 1 + int(c["momentum"] > 0) + int(bool(c["centered"])),
    keras.optimizers.Lamb: lambda c: 2,
    keras.optimizers.Muon: lambda c: 2,
    keras.optimizers.ScheduleFreeAdamW: lambda c: 2,
}
SUPPORTED = tuple(cls.__name__ for cls in _SLOTS)
_BY_NAME = {cls.__name__.lower(): cls for cls in _SLOTS}
#: The names :func:`by_name` takes (the binaries' --optimizer flag): each supported class's name in lower case.
NAMES = tuple(_BY_NAME)
# Optimizers refused for a reason of their own.
_REFUSED = {
    "MultiOptimizer": "it gives each variable one of several optimizers, each with its own learning rate and "
                      "iteration count, where the pipeline's fit sets one learning rate on each stage's copy, its "
                      "checkpoints key one optimizer's slots and the planner counts one number of slots per "
                      "weight; not supported yet",
}
# Setting -> (values that are fine, why other values are refused).
_REFUSED_SETTINGS = {
    "use_ema": ((None, False), "keeps a moving average of the weights, which Keras's fit writes into the model "
                               "when training ends; the pipeline does not yet write each stage's averages "
                               "back, nor give them to the parameter servers"),
    "gradient_accumulation_steps": ((None,), "applies one update per so many minibatches, where the pipeline "
                                            "applies each minibatch's update and counts the iterations by "
                                            "minibatch (§4); use a larger batch, or the gpipe schedule, which "
                                            "accumulates microbatches"),
    "loss_scale_factor": ((None,), "divides the gradients by it, and the pipeline's last stage does not multiply "
                                   "the loss by it yet"),
}


class UnsupportedOptimizerError(HetPipeUsageError, ValueError):
    """An optimizer the pipeline cannot run as plain Keras would."""


def by_name(name: str, learning_rate: float = 0.01, momentum: float = 0.0, weight_decay: float | None = None,
            global_clipnorm: float | None = None) -> keras.optimizers.Optimizer:
    """A Keras optimizer by the name the binaries' --optimizer flag takes (``adamw``, ``sgd``, ...: a
    supported class's name in lower case).

    Args:
        name: the optimizer's name (:data:`NAMES`).
        learning_rate: its learning rate.
        momentum: SGD's momentum.
        weight_decay: None: the class's default (AdamW's and Muon's 0.004, the others' none).
        global_clipnorm: its global clip norm (None: none).

    Returns:
        The Keras optimizer.

    Raises:
        UnsupportedOptimizerError: `name` is not a supported optimizer's.
    """
    if name not in _BY_NAME:
        raise UnsupportedOptimizerError(f"unknown optimizer {name!r}; allowed: {', '.join(NAMES)}")
    kwargs = {"learning_rate": learning_rate, "global_clipnorm": global_clipnorm}
    if name == "sgd":
        kwargs["momentum"] = momentum
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    return _BY_NAME[name](**kwargs)


def check_name(name: str) -> str:
    """Checks that `name` names a supported optimizer (:data:`NAMES`, any case); it makes no
    optimizer (a Keras optimizer's variables would start TensorFlow's runtime).

    Args:
        name: the optimizer's name.

    Returns:
        `name`.

    Raises:
        UnsupportedOptimizerError: it names none.
    """
    if name.lower() not in _BY_NAME:
        raise UnsupportedOptimizerError(f"unknown optimizer {name!r}; allowed: {', '.join(NAMES)}")
    return name


def check_optimizer(optimizer: keras.optimizers.Optimizer | str) -> keras.optimizers.Optimizer:
    """The Keras optimizer of `optimizer`, checked to run in the pipeline as Keras would.

    Args:
        optimizer: an instance, or a name (the class with its defaults).

    Returns:
        The optimizer (made from the name, or the one given).

    Raises:
        UnsupportedOptimizerError: the optimizer, or one of its settings, is not supported.
    """
    if isinstance(optimizer, str):
        optimizer = _BY_NAME[check_name(optimizer).lower()]()
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        check_optimizer(optimizer.inner_optimizer)
        return optimizer
    name = type(optimizer).__name__
    if name in _REFUSED:
        raise UnsupportedOptimizerError(f"optimizer {name} is not supported: {_REFUSED[name]}")
    if type(optimizer) not in _SLOTS:
        raise UnsupportedOptimizerError(
            f"optimizer {name} is not supported; supported: {', '.join('keras.optimizers.' + s for s in SUPPORTED)} "
            f"(those whose update of a variable depends only on that variable, its gradient and state, the "
            f"iteration count and the learning rate)")
    config = optimizer.get_config()
    for key, (fine, why) in _REFUSED_SETTINGS.items():
        if config.get(key) not in fine:
            raise UnsupportedOptimizerError(f"optimizer {name} with {key}={config[key]!r}: {why}")
    return optimizer


#: Optimizers that keep the weights themselves in their slots (Ftrl's ``linear``, the schedule-free
#: base sequence): what a synchronisation scheme merges into a worker's weights does not last.
_WEIGHTS_IN_SLOTS = ("Ftrl", "ScheduleFreeAdamW")


def check_for_workers(optimizer: keras.optimizers.Optimizer | str, workers: int) -> None:
    """Checks that `optimizer` can train `workers` virtual workers together: one that keeps the
    weights in its slots loses the other workers' updates a pull merges into w_local (§5).

    Args:
        optimizer: the optimizer, or its name.
        workers: the number of virtual workers.

    Raises:
        UnsupportedOptimizerError: it keeps the weights in its slots and `workers` > 1.
    """
    name = _BY_NAME[check_name(optimizer).lower()].__name__ if isinstance(optimizer, str) else \
        type(inner_optimizer(optimizer)).__name__
    if workers > 1 and name in _WEIGHTS_IN_SLOTS:
        raise UnsupportedOptimizerError(
            f"optimizer {name} with {workers} virtual workers: it keeps the weights themselves in its slots, so "
            f"the other workers' updates that synchronisation merges into a worker's weights would not last; "
            f"train it with one virtual worker, or take another optimizer for several")


def stage_optimizer(optimizer: keras.optimizers.Optimizer | str, originals: Sequence[keras.Variable] = (),
                    copies: Sequence[keras.Variable] = ()) -> keras.optimizers.Optimizer:
    """A fresh optimizer with `optimizer`'s class and config, for one stage whose weights `copies` are
    copies of the model variables `originals` (in the same order), with `optimizer`'s weight-decay
    exclusions: those by name as they are, those by variable given to the copies of the variables.

    Returns:
        The stage's optimizer (without a global clip norm: the stages apply it together).
    """
    optimizer = inner_optimizer(check_optimizer(optimizer))
    copy = type(optimizer).from_config({**optimizer.get_config(), "global_clipnorm": None})
    excluded, pattern = compat.weight_decay_exclusions(optimizer)
    if excluded or pattern is not None:
        copy.exclude_from_weight_decay(
            var_list=[c for o, c in zip(originals, copies) if compat.variable_key(optimizer, o) in excluded],
            var_names=None if pattern is None else [pattern.pattern])
    return copy


def slots_per_weight(optimizer: keras.optimizers.Optimizer | str) -> int:
    """How many optimizer variables of a weight's size each weight gets, the memory the planner counts:
    SGD 0, or 1 with momentum; Adam and AdamW 2, 3 with amsgrad; RMSprop 1, plus 1 with momentum
    and 1 when centered; Lion, Adagrad 1; Adamax, Nadam, Adadelta, Ftrl, Lamb, ScheduleFreeAdamW 2.

    Two are bounds. Muon: 2, an upper bound: every weight gets a momentum, and those it updates with
    AdamW (all but the 2-D weights outside embeddings and excluded layers) a velocity too; the 2-D
    weights it orthogonalises (Newton-Schulz) get the momentum only. Adafactor: 1, a lower bound: its
    full-size velocity (Keras 3 keeps one besides the factored moments); the factored moments, m + n
    values for an m x n matrix (1/m + 1/n of its bytes) and two scalars for a vector, are not counted.
    Nor is Nadam's one scalar per stage.

    Returns:
        The count for `optimizer`'s class and settings.
    """
    optimizer = inner_optimizer(check_optimizer(optimizer))
    return _SLOTS[type(optimizer)](optimizer.get_config())


def inner_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the weights: a LossScaleOptimizer's inner one, else `optimizer`."""
    optimizer = check_optimizer(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def update_rule_of(optimizer: keras.optimizers.Optimizer) -> UpdateRule:
    """What every stage's update takes from the others under `optimizer` (a checked one): its
    inner optimizer's ``global_clipnorm`` and a LossScaleOptimizer's dynamic loss scaling (a name:
    neither).

    Returns:
        The UpdateRule.
    """
    if isinstance(optimizer, str):
        return UpdateRule()
    scaling = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scaling = LossScaling(float(optimizer.initial_scale), int(optimizer.dynamic_growth_steps))
    return UpdateRule(global_clipnorm=inner_optimizer(optimizer).global_clipnorm, loss_scaling=scaling)
