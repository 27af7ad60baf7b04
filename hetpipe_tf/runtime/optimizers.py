"""Which Keras optimizers a pipelined virtual worker supports, and one copy per stage.

Every stage applies its own minibatch updates to its own weights (§4:
w_local = w_local + u_p), with its own copy of the user's optimizer built from
the same config, so that with Nm = 1 the updates are exactly plain Keras
training's. Settings that couple the weights of different stages are refused.
"""
import keras

SUPPORTED = ("SGD", "Adam", "RMSprop")
# Setting -> (values that are fine, why other values are refused).
_COUPLING = {
    "global_clipnorm": ((None,), "clips by the norm of all gradients together, across stages; use clipnorm"),
    "use_ema": ((None, False), "keeps an average of all weights; not supported yet"),
    "gradient_accumulation_steps": ((None, 1), "accumulates across minibatches, which WSP waves already do"),
}


class UnsupportedOptimizerError(ValueError):
    """An optimizer the pipeline cannot run as plain Keras would."""


def by_name(name, learning_rate=0.01, momentum=0.0):
    """A Keras optimizer by the name the binaries' --optimizer flag takes: sgd, adam or rmsprop."""
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate, momentum=momentum)
    if name in ("adam", "rmsprop"):
        return {"adam": keras.optimizers.Adam, "rmsprop": keras.optimizers.RMSprop}[name](learning_rate)
    raise UnsupportedOptimizerError(f"unknown optimizer {name!r}; allowed: sgd, adam, rmsprop")


def check_optimizer(optimizer):
    """Returns a Keras optimizer for `optimizer` (an instance or a name), or raises."""
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    name = type(optimizer).__name__
    if not isinstance(optimizer, keras.optimizers.Optimizer) or name not in SUPPORTED:
        raise UnsupportedOptimizerError(
            f"optimizer {name} is not supported; supported: "
            f"{', '.join('keras.optimizers.' + s for s in SUPPORTED)} (SGD with or without momentum "
            f"or Nesterov)")
    config = optimizer.get_config()
    for key, (fine, why) in _COUPLING.items():
        if config.get(key) not in fine:
            raise UnsupportedOptimizerError(f"optimizer {name} with {key}={config[key]!r}: {why}")
    return optimizer


def stage_optimizer(optimizer):
    """A fresh optimizer with `optimizer`'s class and config, for one stage."""
    optimizer = check_optimizer(optimizer)
    return type(optimizer).from_config(optimizer.get_config())


def slots_per_weight(optimizer):
    """How many optimizer variables each weight gets (SGD: 0, or 1 with momentum; Adam: 2;
    RMSprop: 1, plus 1 with momentum and 1 when centered): memory the planner counts."""
    optimizer = check_optimizer(optimizer)
    config = optimizer.get_config()
    name = type(optimizer).__name__
    if name == "SGD":
        return 1 if config.get("momentum") else 0
    if name == "Adam":
        return 2 + (1 if config.get("amsgrad") else 0)
    return 1 + (1 if config.get("momentum") else 0) + (1 if config.get("centered") else 0)
