"""The loss and metrics the last stage computes from the model outputs and the labels.

The rule: ``loss``, ``loss_weights`` and ``metrics`` mean exactly what they mean to
``keras.Model.compile``, because this module hands them to Keras's own
``CompileLoss`` and ``CompileMetrics`` (``keras.src.trainers.compile_utils``, the
objects ``compile`` builds, reached through :mod:`hetpipe_tf.compat`). So every
structure Keras accepts maps to the outputs as in Keras (one loss for all outputs,
lists, dicts by output name, ``None`` for an output, names, functions,
``keras.losses.Loss`` and ``keras.metrics.Metric`` objects, per-output metric lists
and dicts), and whatever Keras rejects is rejected, with Keras's
reason. The labels are handed over as the dataset gives them, and the outputs as
the model returns them (one tensor, or a list in the model's output order).

Logged names are Keras's: ``loss``, the metrics (``<output>_<metric>`` with several
outputs, ``_1``... for repeated names), then ``<output>_loss``, the unweighted loss
of each output, when several outputs have a loss.

Keras's metrics are stateful running means over an epoch. Here every value is of one
minibatch (the training loop averages them, as :mod:`hetpipe_tf.runtime.fit_loop` says): each
call runs Keras's objects in a ``keras.StatelessScope`` that starts from their reset
state and discards every update. Nothing is mutated, so the stage's thread, an
evaluation on another thread and other workers' heads may share the user's Metric
objects. The mean of per-minibatch values equals Keras's epoch value only for means
over samples, so metrics that are not (``keras.metrics.Mean`` subclasses that keep
Mean's result: ``accuracy``, ``mae``, any function of ``(y_true, y_pred)``...) are
rejected, as are sample weights (there is no argument for them).

The objects are built on the first call, from the shapes of its labels and outputs
(``"accuracy"`` and ``"crossentropy"`` are resolved by shapes, as Keras does), outside
any ``tf.function`` being traced.
"""
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import tensorflow as tf

from hetpipe_tf.compat import CompileLoss, CompileMetrics, compute_output_spec

_BUILD_LOCK = threading.Lock()  # heads of several workers may share the user's Metric objects


def _spec(value: Any) -> keras.KerasTensor:
    return keras.KerasTensor(tuple(value.shape), keras.backend.standardize_dtype(value.dtype))


def _is_mean(metric: keras.metrics.Metric) -> bool:
    return isinstance(metric, keras.metrics.Mean) and type(metric).result is keras.metrics.Mean.result


def _fresh_state(metrics: Iterable[keras.metrics.Metric]) -> list[tuple[keras.Variable, Any]]:
    """(variable, value) pairs that put `metrics` in their reset state, without touching them."""
    return [pair for m in metrics for pair in zip(m.variables, m.stateless_reset_state())]


class LossHead:
    """Keras's compiled loss and metrics of one minibatch, for the last stage.

    Args:
      loss, loss_weights, metrics: as for ``keras.Model.compile`` (``metrics=()`` or None:
        none). Sample weights are not supported (``HetPipeStrategy`` joins a list of
        ``weighted_metrics`` to the metrics).
      output_names: the model's output names, in its output order.
    """

    def __init__(self, loss: Any, output_names: Sequence[str], loss_weights: Any = None, metrics: Any = ()) -> None:
        self.output_names = list(output_names)
        if loss is None:
            raise ValueError("a loss is needed to train: pass loss= as to keras.Model.compile()")
        self._given = f"loss={loss!r}, loss_weights={loss_weights!r}, metrics={metrics!r}"
        self._compile_loss = CompileLoss(loss, loss_weights, output_names=self.output_names)
        self._compile_metrics = CompileMetrics(metrics or None, None, output_names=self.output_names)
        self._built = False

    def split_labels(self, y: Any) -> Any:
        """The labels as Keras's compiled loss and metrics take them: as the dataset gives them
        (a tensor, or a list, tuple or dict by output name)."""
        return y

    def loss(self, labels: Any, outputs: Sequence[tf.Tensor]) -> tf.Tensor:
        """The compiled loss: the sum of each output's loss times its loss weight (the model's
        own losses, such as regularization, are not included)."""
        y_pred = self._build(labels, outputs)
        with keras.StatelessScope(_fresh_state(self._compile_loss.metrics), initialize_variables=False):
            return self._compile_loss(labels, y_pred)

    def metrics(self, labels: Any, outputs: Sequence[tf.Tensor]) -> dict[str, tf.Tensor]:
        """Keras's logs for one minibatch, in Keras's order: ``loss`` (the compiled loss; callers
        that add the model's own losses replace it), the metrics, then ``<output>_loss``."""
        y_pred = self._build(labels, outputs)
        state = _fresh_state(self._compile_loss.metrics) + _fresh_state([self._compile_metrics])
        with keras.StatelessScope(state, initialize_variables=False):
            logs = {"loss": self._compile_loss(labels, y_pred)}
            self._compile_metrics.update_state(labels, y_pred)
            logs.update(self._compile_metrics.result())
            logs.update((m.name, m.result()) for m in self._compile_loss.metrics)
        return logs

    def evaluate(self, model: keras.Model, dataset: Iterable[Any]) -> dict[str, float]:
        """Loss and metrics of `model` (the whole Keras model, its current weights) on `dataset`,
        in inference mode, averaged over samples as Keras's ``evaluate``."""
        sums: dict[str, float] = {}
        n = 0
        for x, y in dataset:
            outputs = model(x, training=False)
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            values = self.metrics(self.split_labels(y), outputs)
            if model.losses:  # as Keras's evaluate: the model's own losses (regularization) count
                values["loss"] = values["loss"] + tf.add_n(model.losses)
            b = int(tf.nest.flatten(x)[0].shape[0])
            for k, v in values.items():
                sums[k] = sums.get(k, 0.0) + float(v) * b
            n += b
        return {k: v / n for k, v in sums.items()}

    def check(self, y: Any, outputs: Sequence[keras.KerasTensor]) -> None:
        """Builds Keras's loss and metric objects for labels like `y` (as the data gives them) and
        the model's `outputs` (KerasTensors), symbolically, raising what training would raise
        (a compile that does not fit the outputs, a metric that is not a mean) before it starts."""
        self._build(self.split_labels(y), list(outputs))

    def _build(self, labels: Any, outputs: Sequence[Any]) -> Any:
        """Builds Keras's objects for labels and outputs like these (once); returns the outputs
        as the model returns them."""
        y_pred = outputs[0] if len(outputs) == 1 else list(outputs)
        if self._built:
            return y_pred
        with _BUILD_LOCK, tf.init_scope():  # out of a tf.function being traced: variables are made once
            if not self._built:
                y_true = keras.tree.map_structure(_spec, labels)
                try:  # as Keras's Trainer builds them: a symbolic step
                    compute_output_spec(self._step, y_true, keras.tree.map_structure(_spec, y_pred))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(
                        f"compile({self._given}) does not fit the model's outputs {self.output_names} "
                        f"and labels of shapes {keras.tree.map_structure(lambda t: tuple(t.shape), labels)}; "
                        f"Keras says: {str(e).rstrip('.')}. As for keras.Model.compile, give one loss for "
                        f"every output, or a list (one per output) or dict (by output name, None for no "
                        f"loss) of losses and of loss_weights, and metrics as a list (one entry per "
                        f"output) or a dict by output name") from e
                self._check_means()
                self._built = True
        return y_pred

    def _step(self, y_true: Any, y_pred: Any) -> Any:
        self._compile_metrics.update_state(y_true, y_pred)
        return self._compile_loss(y_true, y_pred)

    def _check_means(self) -> None:
        for m in self._compile_metrics.metrics:
            if not _is_mean(m):
                raise ValueError(
                    f"metrics: {m.name!r} ({type(m).__name__}) is not a mean over samples. hetpipe_tf "
                    f"logs the mean of per-minibatch values, which is Keras's epoch value only for "
                    f"means (keras.metrics.Mean subclasses that keep Mean's result, such as 'accuracy', "
                    f"'mae', keras.metrics.MeanSquaredError, or any function of (y_true, y_pred)); "
                    f"use one of those, or measure {m.name!r} after training (keras.Model.evaluate of the "
                    f"model compiled with it)")
