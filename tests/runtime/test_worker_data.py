"""Each virtual worker's data at its own minibatch size (issue 14 item 4)."""
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.runtime.worker_data import worker_shards


def _data(n=20, batch=4):
    x = np.arange(n, dtype="float32")[:, None] * np.ones((1, 3), "float32")
    return tf.data.Dataset.from_tensor_slices((x, np.arange(n))).batch(batch, drop_remainder=True)


def test_uneven_sizes_split_every_round_into_consecutive_samples_nothing_twice_nothing_skipped():
    shards = worker_shards(_data(), 2, (5, 3))
    assert [s.element_spec[0].shape.as_list() for s in shards] == [[5, 3], [3, 3]]  # static: a fixed size each
    taken = [[y.numpy().tolist() for _, y in s.take(5)] for s in shards]
    # Rounds of 8 run on across the dataset's repetitions (20 samples: the third round wraps).
    samples = [taken[0][r] + taken[1][r] for r in range(5)]
    assert [v for r in samples for v in r] == [i % 20 for i in range(40)]
    assert taken[0][0] == [0, 1, 2, 3, 4] and taken[1][0] == [5, 6, 7]
    x, y = next(iter(shards[1]))
    np.testing.assert_array_equal(x.numpy()[:, 0], y.numpy())  # inputs and labels stay together


def test_even_sizes_are_the_shards_of_the_batches():
    even = worker_shards(_data(), 2, (4, 4))
    plain = worker_shards(_data(), 2)
    for a, b in zip(even, plain):
        assert [y.numpy().tolist() for _, y in a.take(3)] == [y.numpy().tolist() for _, y in b.take(3)]
    assert [y.numpy().tolist() for _, y in even[1].take(2)] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match=r"3 minibatch sizes \[1, 2, 3\] for 2 virtual workers"):
        worker_shards(_data(), 2, (1, 2, 3))
