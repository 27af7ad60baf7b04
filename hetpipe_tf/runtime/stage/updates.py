"""A stage's update of a minibatch: w_local := w_local + u_p with the stage's optimizer (HetPipe
§4), applied only where the minibatch's verdict is finite, after the terms that depend on every
stage (:mod:`hetpipe_tf.runtime.update_terms`: the global clip, the loss scale, the tied weights'
summed gradients)."""
import functools
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.pipeline.schedule import WorkerUpdate
from hetpipe_tf.runtime.stage.verdicts import FINITE
from hetpipe_tf.runtime.stage.weights import StageWeights, is_remote
from hetpipe_tf.runtime.stage_rewrite import TiedVariable
from hetpipe_tf.runtime.update_terms import ScaleState, UpdateRule, clip_factor, clipped, squared_norm, summed

#: The weight elements from which a stage's update runs compiled by XLA (see docs/performance.md).
_XLA_APPLY_ELEMENTS = 1 << 20
#: A weight gradient: dense, or the rows of a table lookup.
Gradient = tf.Tensor | tf.IndexedSlices
#: Minibatch p's update terms: (verdict, loss scale S_p, the global clip's factor, the loss scale
#: after p, each tied weight's summed gradient).
Terms = tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, list[tf.Tensor | None]]


def _scaled(g: Gradient, scale: Callable[[tf.Tensor], tf.Tensor]) -> Gradient:
    """Gradient `g` with `scale` applied to its values (an IndexedSlices stays one)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(scale(g.values), g.indices, g.dense_shape)
    return scale(g)


class StageUpdate:
    """The update of stage `index` of a virtual worker under `rule`. The first stage makes the
    terms (`makes_terms`), the stages in `worker_update.waiting` take them (`takes_terms`);
    `ties` are the run's trainable TiedVariables, whose replicas apply their summed gradient."""

    def __init__(self, index: int, is_last: bool, weights: StageWeights, rule: UpdateRule,
                 worker_update: WorkerUpdate, ties: Sequence[TiedVariable], device: str,
                 single_threaded: bool) -> None:
        self.index = index
        self.is_last = is_last
        self.weights = weights
        self.rule = rule
        self.makes_terms = index == 0 and (bool(rule) or bool(worker_update))
        self.takes_terms = index in worker_update.waiting
        self.tied_positions = [(g, pos) for g, tie in enumerate(ties) for st, pos in tie.replicas if st == index]
        self.tied_sources = tuple(worker_update.tied) if index == 0 else ()
        self.ties = tuple(ties)
        self.scale_state = None
        self.loss_scale = None
        if rule.loss_scaling is not None:
            with tf.device(device):
                if index == 0:
                    self.scale_state = ScaleState(rule.loss_scaling)
                if is_last:
                    self.loss_scale = self.scale_state.scale if index == 0 else keras.Variable(
                        rule.loss_scaling.initial_scale, dtype="float32", trainable=False, name="loss_scale")
        self.apply = self._compiled_apply(device, single_threaded)

    def _compiled_apply(self, device: str, single_threaded: bool) -> Callable[[list[Gradient], tf.Tensor], tf.Tensor]:
        """XLA fuses the optimizer's elementwise update, which pays once a stage's weights are large
        (_XLA_APPLY_ELEMENTS); below that its launch costs more than the update. It copies a
        variable's buffer that a stashed version still shares, as eager updates do. Not on another
        task's device: TF 2.21's remote eager runtime then fails the next eager op
        ("KernelAndDeviceOp does not support EagerFunctionParams"). Always with single-threaded
        stages: the update's conditional (a functional If) then runs inside XLA's cluster, as TF
        2.21's single-threaded executor deadlocks two stages that run an If at once."""
        elements = sum(int(np.prod(v.shape)) for v in self.weights.trainable)
        if (elements >= _XLA_APPLY_ELEMENTS or single_threaded) and not is_remote(device):
            return FirstCallLocked(tf.function(functools.partial(self._apply_graph), jit_compile=True))
        return self._apply_graph  # in the task's own graph

    def _apply_graph(self, grads: list[Gradient], verdict: tf.Tensor) -> tf.Tensor:
        """Applies the gradients if the minibatch's verdict is finite; returns the verdict."""
        trainable = self.weights.trainable
        if trainable:  # a stage may have no weights (pooling, activations)
            def apply() -> tf.Tensor:
                self.weights.optimizer.apply(grads, trainable)
                return tf.constant(True)

            tf.cond(verdict == FINITE, apply, lambda: tf.constant(False))
        return verdict

    def scale_now(self) -> tf.Tensor | None:
        """Inside a graph, on the last stage: the loss scale S_p its loss is multiplied by (None
        without loss scaling)."""
        if self.loss_scale is None:
            return None
        return tf.convert_to_tensor(self.loss_scale.value)

    def squared(self, squared: tf.Tensor, weight_grads: Sequence[Gradient], scale: tf.Tensor) -> tf.Tensor:
        """The squared norm of the gradients so far, this stage's `weight_grads` (unscaled by
        `scale`) added, when clipping by the global norm; the tied weights' norms are of their
        sums, on the first stage."""
        if self.rule.global_clipnorm is None:
            return squared
        tied = {pos for _, pos in self.tied_positions}
        return summed([squared, squared_norm([g for i, g in enumerate(weight_grads) if i not in tied], scale)])

    def tied_gradients(self, weight_grads: Sequence[Gradient]) -> list[tf.Tensor]:
        """The gradients of this stage's tied replicas, in order."""
        return [tf.convert_to_tensor(weight_grads[pos]) for _, pos in self.tied_positions]

    def terms(self, weight_grads: Sequence[Gradient], code: tf.Tensor, squared: tf.Tensor, scale: tf.Tensor,
              tied_in: Sequence[list[tf.Tensor]]) -> Terms:
        """The first stage: a minibatch's update terms, from its own gradients and the tied
        replicas' gradients `tied_in` of the stages in `tied_sources`."""
        sums = [None] * len(self.ties)
        for g, pos in self.tied_positions:
            sums[g] = tf.convert_to_tensor(weight_grads[pos])
        for source, grads in zip(self.tied_sources, tied_in):
            held = [g for g, tie in enumerate(self.ties) for st, _ in tie.replicas if st == source]
            for g, grad in zip(held, grads):
                sums[g] = grad if sums[g] is None else sums[g] + grad
        clip = tf.constant(1.0)
        if self.rule.global_clipnorm is not None:
            clip = clip_factor(summed([squared, squared_norm(sums, scale)]), self.rule.global_clipnorm)
        after = self.scale_state.after(tf.equal(code, FINITE)) if self.scale_state is not None else scale
        return (code, scale, clip, after, sums)

    def with_terms(self, grads: Sequence[Gradient], terms: Terms) -> list[Gradient]:
        """The gradients to apply of a minibatch's `grads` under its `terms`: the tied replicas'
        sums, unscaled, clipped; the last stage's loss scale moves to the one after the minibatch."""
        _, scale, clip, after, sums = terms
        grads = list(grads)
        for g, pos in self.tied_positions:
            grads[pos] = sums[g]
        if self.rule.loss_scaling is not None:
            grads = [_scaled(g, lambda x: x / tf.cast(scale, x.dtype)) for g in grads]
        if self.rule.global_clipnorm is not None:
            grads = clipped(grads, clip)
        if self.rule.loss_scaling is not None and self.is_last and self.index > 0:
            self.loss_scale.assign(after)
        return grads
