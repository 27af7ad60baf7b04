"""A minibatch's verdict: whether its loss and weight gradients are finite, carried as an int32.

Nothing reads a value back to the host on the way: each update is applied only if its verdict
says the minibatch is finite. A minibatch's verdict (:data:`FINITE`, or which stage's loss or
weight gradient was not finite, :func:`verdict_code`) travels upstream with its gradient, each
stage combining it with its own gradient (:func:`combined`, :func:`checked_gradient`), so a loss
or gradient that is NaN or infinite on one stage stops the update of that minibatch on that stage
and every stage before it (they apply after it, §4). The verdicts are read back later, and a
non-finite one becomes a :class:`NonFiniteError` (:func:`non_finite_error`).
"""
from collections.abc import Mapping, Sequence

import tensorflow as tf

from hetpipe_tf.errors import HetPipeRunError
from hetpipe_tf.runtime.update_terms import wide_dtype

#: A minibatch's verdict: finite so far.
FINITE = -1


def verdict_code(stage: int, loss: bool, variable: int = 0) -> int:
    """The verdict of a minibatch whose loss (`loss`, on the last stage `stage`) or weight gradient
    on `stage` was not finite, first in its weight `variable`: ``variable << 17 | stage << 1 | loss``.

    Returns:
        The code.
    """
    return variable << 17 | stage << 1 | int(loss)


def read_verdict(code: int) -> tuple[int, bool, int]:
    """(stage, loss, variable) of a verdict that is not :data:`FINITE` (see :func:`verdict_code`)."""
    return (code >> 1) & 0xFFFF, bool(code & 1), code >> 17


def combined(code: tf.Tensor, bad: tf.Tensor, own: tf.Tensor | int) -> tf.Tensor:
    """The verdict after a check: `code` if a later stage (or an earlier microbatch) already went
    bad, else `own` where `bad`.

    Returns:
        The combined code.
    """
    return tf.where(code != FINITE, code, tf.where(bad, own, code))


def checked_gradient(code: tf.Tensor, grads: Sequence[tf.Tensor | tf.IndexedSlices], stage: int) -> tf.Tensor:
    """`code` after checking the weight gradients `grads` of `stage` (an IndexedSlices' values):
    a gradient holds a NaN or an infinity exactly when its sum is not finite, but for a sum of
    finite values past the float's range, which is taken as not finite too.

    Returns:
        The code after the check.
    """
    if not grads:
        return code
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    finite = tf.stack([tf.math.is_finite(tf.reduce_sum(tf.cast(v, wide_dtype(v.dtype)))) for v in values])
    first_bad = tf.cast(tf.argmin(tf.cast(finite, tf.int32)), tf.int32)
    own = first_bad * (1 << 17) + verdict_code(stage, loss=False)
    return combined(code, tf.logical_not(tf.reduce_all(finite)), own)


class NonFiniteError(HetPipeRunError, FloatingPointError):
    """A minibatch's loss or gradient is NaN or infinite; nothing of that minibatch was applied.

    `stage` is the stage where the loss or gradient went bad; `logs` holds the minibatch's
    loss and metrics when the loss was not finite (for ``keras.callbacks.TerminateOnNaN``),
    else None."""

    def __init__(self, message: str, minibatch: int, stage: int, logs: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.minibatch = minibatch
        self.stage = stage
        self.logs = logs


def non_finite_error(code: int, minibatches: Sequence[int], logs: Mapping[str, tf.Tensor] | None,
                     variable_paths: Mapping[int, Sequence[str]]) -> NonFiniteError:
    """The error of `minibatches` (one update) whose verdict `code` is not finite: the minibatch,
    the stage and, for a gradient, its first weight (from `variable_paths`, per stage) that went
    bad; `logs`: the minibatch's loss and metrics, when its loss was not finite.

    Returns:
        The NonFiniteError to raise.
    """
    which = (f"minibatch {minibatches[0]}" if len(minibatches) == 1
             else f"minibatches {minibatches[0]}..{minibatches[-1]}")
    stage, loss, variable = read_verdict(code)
    if loss:
        values = {k: float(v) for k, v in logs.items()} if logs else None
        return NonFiniteError(
            f"{which}: the loss is {values['loss'] if values else 'not finite'} on stage {stage} (the last); "
            f"nothing of it was applied on any stage or pushed. Lower the learning rate, look for NaN or "
            f"Inf in the data, or clip gradients (the optimizer's clipnorm)", minibatches[-1], stage, values)
    return NonFiniteError(
        f"{which}: the gradient of stage {stage} is not finite (NaN or Inf in "
        f"{variable_paths[stage][variable]}, the first such weight); nothing of it was applied on "
        f"stage {stage} or the stages before it, or pushed. Lower the learning rate or clip gradients "
        f"(the optimizer's clipnorm)", minibatches[-1], stage)
