"""Each virtual worker's data: its shard of a batched dataset, at its own minibatch size.

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

import tensorflow as tf

from hetpipe_tf.runtime.fit_loop import batch_size_of


def worker_shards(data, workers, sizes=None):
    """Each worker's endless stream of minibatches of `data` (a batched tf.data.Dataset of
    (inputs, labels)): the even split for `sizes` None (or all the dataset's batch size), else
    worker i's b_i = sizes[i] samples of every round of Σ sizes samples."""
    if sizes is not None and len(sizes) != workers:
        raise ValueError(f"{len(sizes)} minibatch sizes {list(sizes)} for {workers} virtual workers: give one "
                         f"per worker")
    if sizes is None or set(sizes) == {batch_size_of(data)}:
        return [data.shard(workers, i).repeat() for i in range(workers)] if workers > 1 else [data.repeat()]
    rounds = data.repeat().unbatch().batch(sum(sizes), drop_remainder=True)
    offsets = [sum(sizes[:i]) for i in range(workers)]
    return [rounds.map(functools.partial(_samples, o, b)) for o, b in zip(offsets, sizes)]


def _samples(offset, size, *element):
    """Samples [offset, offset + size) of every tensor of a round."""
    return tf.nest.map_structure(lambda t: t[offset:offset + size], element if len(element) > 1 else element[0])
