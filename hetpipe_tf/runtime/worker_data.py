"""The data a fit trains on: a batched dataset of (inputs, labels), made from arrays if need be,
and each virtual worker's shard of it, at its own minibatch size.

HetPipe's virtual workers each train their own minibatches of the data (§3): with even sizes,
worker i of n takes minibatches i, i + n, i + 2n, ... (``Dataset.shard``). With uneven
minibatches (beyond the paper; :mod:`hetpipe_tf.planning.uneven`) a round is B = Σ b_j
consecutive samples, and worker i takes samples [o_i, o_i + b_i) of every round, o_i = Σ_{j<i}
b_j: one round is one minibatch of every worker, nothing is taken twice and nothing is
skipped (the rounds run on across the dataset's repetitions). With b_i all equal to the
dataset's batch size that is the even split, which is then used as it is.

Every worker reads its own copy of the input pipeline, so the split is a partition of the
data only when the copies agree: a deterministic pipeline, or a shuffle with a seed.
"""
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def epoch_steps(dataset: tf.data.Dataset) -> int:
    """Minibatches in one pass over `dataset` (a finite tf.data.Dataset)."""
    steps = int(dataset.cardinality())
    if steps <= 0:
        raise ValueError("steps_per_epoch is needed: the dataset's length is unknown or infinite")
    return steps


def batch_size_of(dataset: tf.data.Dataset) -> int:
    """The static batch size of a dataset of (inputs, labels)."""
    size = tf.nest.flatten(dataset.element_spec[0])[0].shape[0]
    if size is None:
        raise ValueError(f"the dataset's batch size must be static (batch(..., drop_remainder=True)); its "
                         f"element spec is {dataset.element_spec}")
    return int(size)


def mean_batch_size(dataset: tf.data.Dataset, sizes: Sequence[int] | None = None) -> float:
    """The samples per minibatch of a fit: the mean of the workers' `sizes`, or the dataset's."""
    return sum(sizes) / len(sizes) if sizes else batch_size_of(dataset)


def is_dataset(x: Any) -> bool:
    """Whether `x` is a ``tf.data.Dataset``."""
    return isinstance(x, tf.data.Dataset)


def as_dataset(x: Any, y: Any = None, batch_size: int | None = None, shuffle: bool = True) -> tf.data.Dataset:
    """A batched (inputs, labels) dataset from a dataset or from arrays (as Keras's fit)."""
    if is_dataset(x):
        if y is not None or batch_size is not None:
            raise ValueError("with a tf.data.Dataset give neither y nor batch_size (the dataset is batched)")
        return x
    if x is None or y is None:
        raise ValueError(f"fit takes a batched tf.data.Dataset of (inputs, labels), or arrays x and y; got "
                         f"x={type(x).__name__}, y={type(y).__name__}")
    n = len(np.asarray(tf.nest.flatten(x)[0]))
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        data = data.shuffle(n, reshuffle_each_iteration=True)
    return data.batch(batch_size or 32, drop_remainder=True)


def first_batch(data: tf.data.Dataset, where: str) -> Any:
    """The first minibatch of `data`.

    Args:
        data: the dataset.
        where: the cluster this process joined, for the message.

    Returns:
        Its first element.

    Raises:
        ValueError: the dataset was made before this process joined its cluster (its ops are
            placed on devices the process no longer has).
        InvalidArgumentError: TensorFlow's, for any other reason the dataset cannot give it.
    """
    try:
        return next(iter(data))
    except tf.errors.InvalidArgumentError as e:
        if "unknown device" not in str(e):
            raise
        raise ValueError(f"the dataset was made before this process joined the cluster ({where}), so it names a "
                         f"device that no longer exists ({str(e).splitlines()[0][:160]}); make the dataset inside "
                         f"`with strategy.scope():`") from None


def worker_shards(data: tf.data.Dataset, workers: int, sizes: Sequence[int] | None = None) -> list[tf.data.Dataset]:
    """Each worker's endless stream of minibatches of `data`.

    Args:
        data: a batched tf.data.Dataset of (inputs, labels).
        workers: the number of virtual workers.
        sizes: each worker's minibatch size b_i; None (or all the dataset's batch size): the even
            split, each worker a shard of the batches; else worker i takes sizes[i] samples of
            every round of Σ sizes samples.

    Returns:
        One endless dataset per worker.

    Raises:
        ValueError: `sizes` does not give one size per worker.
    """
    if sizes is not None and len(sizes) != workers:
        raise ValueError(f"{len(sizes)} minibatch sizes {list(sizes)} for {workers} virtual workers: give one "
                         f"per worker")
    if sizes is None or set(sizes) == {batch_size_of(data)}:
        return [data.shard(workers, i).repeat() for i in range(workers)] if workers > 1 else [data.repeat()]
    rounds = data.repeat().unbatch().batch(sum(sizes), drop_remainder=True)
    offsets = [sum(sizes[:i]) for i in range(workers)]
    return [rounds.map(functools.partial(_samples, o, b)) for o, b in zip(offsets, sizes)]


def _samples(offset: int, size: int, *element: Any) -> Any:

    """Samples [offset, offset + size) of every tensor of a round."""
    return tf.nest.map_structure(lambda t: t[offset:offset + size], element if len(element) > 1 else element[0])
