"""The terms every stage's update of a minibatch takes when they depend on every stage's gradient.

Three settings of a run make a stage's update of minibatch p depend on what the other stages
computed for p (:class:`hetpipe_tf.pipeline.schedule.WorkerUpdate` orders the messages):

* a clip by the **global norm** (``global_clipnorm``, Keras's ``clip_by_global_norm``): every
  gradient of p is scaled by min(1, clipnorm / ||g||), ||g|| the norm of all the stages'
  gradients together (a tied weight counted once, with its replicas' summed gradient), each
  counted as Keras counts the gradient it would receive: an embedding's ``tf.IndexedSlices`` by
  its rows as they are (a row per lookup, so ids a batch repeats count once per occurrence);
* **dynamic loss scaling** (``keras.optimizers.LossScaleOptimizer``, which Keras's
  ``compile`` makes under ``mixed_float16``): the last stage multiplies p's loss by the scale S_p,
  every stage divides its gradient by S_p; p is applied on no stage if any stage's gradient is
  not finite, and then the scale halves; after ``dynamic_growth_steps`` applied minibatches in a
  row it doubles (Keras's rule, one scale per virtual worker);
* **tied weights** (a layer several stages call, e.g. tied input and output embeddings): every
  replica applies the sum of the replicas' gradients of p (Megatron's embedding group), so the
  replicas never drift.

The terms travel as messages: each stage's gradient message carries, with the gradient, p's
verdict so far (:func:`hetpipe_tf.runtime.stage.verdicts.verdict_code`), the squared norm of the
gradients so far and S_p; the stages that hold a tied replica send the first stage its gradient;
the first stage, the last to end p's backward pass, makes the terms (the verdict, S_p, the clip's
factor, the scale after p, each tied weight's summed gradient) and sends them to the stages whose
update waits for them. With Nm = 1 this is exactly Keras's order of operations: unscale, clip by
the global norm, apply (with the optimizer's own per-variable clipping), adjust the scale.

A minibatch skipped for an overflow is not counted in any stage's optimizer iterations (their
learning-rate schedules read those), as in Keras; the user's optimizer, which ``fit`` keeps for
the callbacks, counts the minibatches trained, skipped ones too.
"""
from dataclasses import dataclass

import keras
import tensorflow as tf


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling as Keras's ``LossScaleOptimizer`` does it."""
    initial_scale: float = 2.0 ** 15
    dynamic_growth_steps: int = 2000


@dataclass(frozen=True)
class UpdateRule:
    """What a run's updates take from every stage (see the module docstring): the global clip norm
    (None: none) and the loss scaling (None: none)."""
    global_clipnorm: float | None = None
    loss_scaling: LossScaling | None = None

    def __bool__(self) -> bool:
        return self.global_clipnorm is not None or self.loss_scaling is not None


def squared_norm(grads: list[tf.Tensor | tf.IndexedSlices], divisor: tf.Tensor | float) -> tf.Tensor:
    """The squared norm of the unscaled `grads` (each divided by `divisor`) as one scalar, each
    gradient counted as Keras's ``clip_by_global_norm`` counts it: a ``tf.IndexedSlices`` (an
    embedding's lookup) by its rows as they are, a row repeated as often as its id is in the batch;
    a dense gradient (a tied embedding whose uses add up to one) by its values. Each is summed in
    its own dtype (float16 ones in float32), as Keras sums a float64 model's in float64.

    Returns:
        The scalar, in the widest of float32 and the gradients' dtypes.
    """
    sums = []
    for g in grads:
        rows = _rows(g)
        dtype = wide_dtype(rows.dtype)
        sums.append(tf.reduce_sum(tf.square(tf.cast(rows, dtype) / tf.cast(divisor, dtype))))
    return summed(sums)


def wide_dtype(dtype: tf.DType) -> str:
    """The dtype a float of `dtype` is summed or checked in: float32, or `dtype` if wider (float64).

    Returns:
        The dtype's name.
    """
    return str(keras.backend.result_type(dtype, "float32"))


def summed(values: list[tf.Tensor]) -> tf.Tensor:
    """The sum of float scalars `values` at their widest dtype (at least float32); 0.0 if none.

    Returns:
        The sum.
    """
    if not values:
        return tf.constant(0.0)
    dtype = keras.backend.result_type(*(v.dtype for v in values), "float32")
    return tf.add_n([tf.cast(v, dtype) for v in values])


def _rows(g: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """The values whose squares Keras sums for gradient `g`: an IndexedSlices' rows, unsummed."""
    return g.values if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)


def clip_factor(squared: tf.Tensor, clipnorm: float) -> tf.Tensor:
    """Keras's ``clip_by_global_norm`` factor for a global norm of sqrt(`squared`): NaN when the
    norm is not finite, as Keras's.

    Returns:
        The factor.
    """
    use_norm = tf.sqrt(squared)
    return clipnorm * tf.minimum(1.0 / use_norm, 1.0 / clipnorm) + (use_norm - use_norm)


def clipped(grads: list[tf.Tensor | tf.IndexedSlices], factor: tf.Tensor) -> list[tf.Tensor]:
    """`grads` multiplied by the global clip's `factor` as Keras's ``clip_by_global_norm`` multiplies
    them: an IndexedSlices times a tensor is its dense sum times it, so the optimizer then updates an
    embedding as a dense weight (every row's moments move), as it does under Keras's clip.

    Returns:
        The clipped gradients.
    """
    return [g * tf.cast(factor, g.dtype) for g in grads]


class ScaleState:
    """The first stage's dynamic loss scale and its count of applied minibatches since it last changed."""

    def __init__(self, scaling: "LossScaling") -> None:
        self.scaling = scaling
        self.scale = keras.Variable(scaling.initial_scale, dtype="float32", trainable=False, name="loss_scale")
        self.counter = keras.Variable(0, dtype="int32", trainable=False, name="loss_scale_counter")

    def after(self, applied: tf.Tensor) -> tf.Tensor:
        """Inside a graph: the scale after a minibatch that was `applied` (a bool tensor), as
        ``LossScaleOptimizer`` moves it; assigns both variables and returns the scale.

        Returns:
            The new scale.
        """
        grow = tf.logical_and(applied, tf.equal(self.counter.value, self.scaling.dynamic_growth_steps - 1))
        scale = tf.where(applied, tf.where(grow, self.scale.value * 2.0, self.scale.value), self.scale.value * 0.5)
        counter = tf.where(tf.logical_and(applied, tf.logical_not(grow)), self.counter.value + 1, 0)
        self.scale.assign(scale)
        self.counter.assign(counter)
        return scale

    def variables(self) -> list[keras.Variable]:
        """The loss scale's variables: the scale and the count of applied minibatches."""
        return [self.scale, self.counter]
