"""The loss and metrics the last stage computes from the model outputs and the labels.

Losses and metrics are given as Keras accepts them in ``compile``: a loss (name,
``keras.losses.Loss`` or function) for one output, or a list / dict with one per
output, with optional ``loss_weights``; metrics as names or functions.
"""
import keras
import tensorflow as tf


def _as_per_output(value, output_names, what):
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(output_names))
        if unknown:
            raise ValueError(f"{what} names unknown outputs {unknown}; the outputs are {output_names}")
        return [value.get(n) for n in output_names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(output_names):
            raise ValueError(f"{len(value)} {what} given for {len(output_names)} outputs {output_names}")
        return list(value)
    return [value] * len(output_names) if what == "metrics" else [value] + [None] * (len(output_names) - 1)


def _accuracy(y_true, y_pred):
    """Keras's "accuracy" resolved by shapes: binary, categorical (one-hot) or sparse labels."""
    if y_pred.shape[-1] == 1:
        return keras.metrics.binary_accuracy(y_true, y_pred)
    if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == y_pred.shape[-1]:
        return keras.metrics.categorical_accuracy(y_true, y_pred)
    return keras.metrics.sparse_categorical_accuracy(y_true, y_pred)


def _metric_fn(metric):
    if callable(metric) and not isinstance(metric, str):
        return getattr(metric, "__name__", type(metric).__name__), metric
    name = str(metric)
    if name in ("accuracy", "acc"):
        return "accuracy", _accuracy
    return name, keras.metrics.get(name)


class LossHead:
    """Computes the training objective and per-minibatch metrics on the last stage."""

    def __init__(self, loss, output_names, loss_weights=None, metrics=()):
        self.output_names = list(output_names)
        if loss is None:
            raise ValueError("a loss is needed to train: pass loss= as to Keras compile()")
        losses = _as_per_output(loss, self.output_names, "losses")
        self._losses = [keras.losses.get(l) if l is not None else None for l in losses]
        if all(l is None for l in self._losses):
            raise ValueError(f"no loss for any of the outputs {self.output_names}")
        weights = loss_weights if loss_weights is not None else [1.0] * len(self.output_names)
        self._weights = [w if w is not None else 1.0
                         for w in _as_per_output(weights, self.output_names, "loss_weights")]
        if isinstance(metrics, dict):
            per_output = _as_per_output(metrics, self.output_names, "metrics")
        else:
            per_output = [list(metrics)] + [[] for _ in self.output_names[1:]] \
                if len(self.output_names) > 1 else [list(metrics)]
        self._metrics = []
        for i, ms in enumerate(per_output):
            for m in ([] if ms is None else ms if isinstance(ms, (list, tuple)) else [ms]):
                name, fn = _metric_fn(m)
                if len(self.output_names) > 1:
                    name = f"{self.output_names[i]}_{name}"
                self._metrics.append((i, name, fn))

    def split_labels(self, y):
        if isinstance(y, dict):
            return [y.get(n) for n in self.output_names]
        if isinstance(y, (list, tuple)) and len(self.output_names) > 1:
            return list(y)
        return [y]

    def loss(self, labels, outputs):
        """The weighted sum of the per-output losses (each a mean over the minibatch)."""
        total = []
        for fn, w, y, out in zip(self._losses, self._weights, labels, outputs):
            if fn is not None:
                total.append(w * tf.cast(fn(y, out), tf.float32))
        return tf.add_n(total)

    def metrics(self, labels, outputs):
        """Per-minibatch metric values."""
        return {name: tf.reduce_mean(tf.cast(fn(labels[i], outputs[i]), tf.float32))
                for i, name, fn in self._metrics}
