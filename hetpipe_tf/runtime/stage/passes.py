"""A stage's pass on given weights (HetPipe §4: minibatch p's passes use the version w_p): the
graph of the pass in training mode, what it is differentiated with respect to, the pass split
into a forward call and a later backward call, and both passes timed on the stage's device."""
import functools
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.runtime.compiled import SplitPass, spec_of
from hetpipe_tf.runtime.loss_head import LossHead

#: A tensor or a nest of tensors (labels, what a minibatch brings).
Nest = Any
#: The outputs of a pass's graph: (targets, regularisation loss, logs).
PassOutputs = tuple[list[tf.Tensor], tf.Tensor, dict[str, tf.Tensor]]


def is_float(t: tf.Tensor) -> bool:
    """Whether a tensor holds floating-point values."""
    return tf.as_dtype(t.dtype).is_floating


class StagePass:
    """The pass of `stage` (a Keras stage sub-model) whose non-trainable state is `non_trainable`;
    on the last stage (`loss_head` given) its targets are [loss] and its logs the loss and
    metrics, elsewhere the tensors it sends."""

    def __init__(self, stage: keras.Model, non_trainable: Sequence[keras.Variable], loss_head: LossHead | None,
                 device: str, name: str) -> None:
        self.stage = stage
        self.non_trainable = non_trainable
        self.loss_head = loss_head
        self.device = device
        self.name = name
        self.num_received = len(stage.io.received)
        self._splits = {}  # update_state -> the SplitPass of the pass
        #: The order of the logs in a split pass's outputs (last stage), known once it is traced.
        self.log_names = None
        # A partial, not a method or a lambda: TensorFlow keys its retracing warning on a
        # function's code, which every stage would share.
        self._timed = FirstCallLocked(tf.function(functools.partial(self._timed_graph)))

    @property
    def is_last(self) -> bool:
        return self.loss_head is not None

    def graph(self, weights: Sequence[tf.Tensor], entering: Sequence[tf.Tensor], labels: Nest,
              update_state: bool = True) -> PassOutputs:
        """The stage's pass (training mode) with the given weights: (targets, regularisation loss,
        logs). Targets are the sent tensors, or on the last stage [loss] (the regularisation
        included) with the logs."""
        state = [v.value for v in self.non_trainable]
        sent, new_state, reg = self.stage.stateless_call(weights, state, entering, True)
        for v, value in zip(self.non_trainable, new_state) if update_state else ():
            v.assign(value)
        if not self.is_last:
            return sent, reg, {}
        labels = self.loss_head.split_labels(labels)
        loss = self.loss_head.loss(labels, sent)
        # Keras's compute_loss adds the model's own losses to the compiled loss, at its dtype.
        loss = loss + tf.cast(reg, loss.dtype)
        with tf.name_scope("metrics"):
            metrics = self.loss_head.metrics(labels, [tf.stop_gradient(o) for o in sent])
        return [loss], reg, dict(metrics, loss=loss)

    def differentiated(self, weights: Sequence[tf.Tensor],
                       entering: Sequence[tf.Tensor]) -> tuple[list[int], list[tf.Tensor]]:
        """What a pass is differentiated with respect to: what the previous stage sent (its gradient
        goes back; model inputs loaded here need no gradient) and the weights. Returns the
        positions of the received floating-point tensors and the sources (those, then the weights)."""
        float_pos = [i for i in range(self.num_received) if is_float(entering[i])]
        return float_pos, [entering[i] for i in float_pos] + list(weights)

    def specs(self, weights: Sequence[tf.Tensor], entering: Sequence[tf.Tensor],
              labels: Nest) -> tuple[Nest, Nest, Nest]:
        """The specs of a pass's inputs: the weights' as they are; what a minibatch brings, for
        minibatches of any size."""
        return (spec_of(weights), spec_of(entering, relax_batch=True), spec_of(labels, relax_batch=True))

    def split(self, update_state: bool, weights: Sequence[tf.Tensor], entering: Sequence[tf.Tensor],
              labels: Nest) -> SplitPass:
        """The stage's pass as a :class:`SplitPass` (made once per `update_state`): its outputs are
        the sent tensors and the regularisation loss, or on the last stage the loss and the logs."""
        if update_state not in self._splits:
            def fn(weights: Sequence[tf.Tensor], entering: Sequence[tf.Tensor], labels: Nest) -> list[tf.Tensor]:
                targets, reg, logs = self.graph(weights, entering, labels, update_state=update_state)
                if self.is_last:
                    self.log_names = list(logs)
                    return list(targets) + [logs[k] for k in self.log_names]
                return list(targets) + [reg]

            with tf.init_scope():
                self._splits[update_state] = SplitPass(fn, self.specs(weights, entering, labels), self.device,
                                                       name=f"{self.name}_pass")
        return self._splits[update_state]

    @property
    def recorded(self) -> SplitPass:
        """The split pass whose records a later backward call takes in."""
        return self._splits[True]

    def timed(self, weights: Sequence[tf.Tensor], entering: Sequence[tf.Tensor], labels: Nest) -> tuple[float, float]:
        """The pass's forward and backward times (seconds) as the stage's device measures them: one
        compiled call that reads ``tf.timestamp`` before, between and after the two passes, so that
        the time of the calls reaching the device is left out. Changes no state; the backward pass
        is seeded with ones."""
        with tf.device(self.device):
            forward, backward, _, _ = self._timed(weights, entering, labels)
        return float(forward), float(backward)

    def _timed_graph(self, weights: list[tf.Tensor], entering: list[tf.Tensor],
                     labels: Nest) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
        _, sources = self.differentiated(weights, entering)
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(sources)
                targets, reg, _ = self.graph(weights, entering, labels, update_state=False)
            outputs = list(targets) if self.is_last else [t for t in targets if is_float(t)] + [reg]
        with tf.control_dependencies(outputs):
            forwarded = tf.timestamp()
        with tf.control_dependencies([forwarded]):
            grads = tape.gradient(outputs, sources, output_gradients=[tf.ones_like(t) for t in outputs],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        with tf.control_dependencies(tf.nest.flatten(grads, expand_composites=True)):
            done = tf.timestamp()
        # The passes' values are returned too: a function runs only what its outputs need, and
        # the timestamps' control dependencies alone would not keep the passes.
        return forwarded - start, done - forwarded, outputs, grads
