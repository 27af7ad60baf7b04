import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.ops.weight_stash import StashStats, WeightStash


def test_put_get_release_round_trip():
    stash = WeightStash(capacity=2, name="t")
    a, b = tf.constant([1.0, 2.0]), tf.constant([[3]], tf.int32)
    stash.put(1, [a, b])
    got = stash.get(1, [tf.float32, tf.int32])
    np.testing.assert_array_equal(got[0], a)
    np.testing.assert_array_equal(got[1], b)
    assert stash.stats().minibatches == (1,)
    stash.release(1)
    assert stash.stats().num_versions == 0
    stash.close()


def test_a_version_may_hold_no_tensors():
    # A stage without weights (pooling, activations) still stashes its (empty) versions.
    stash = WeightStash(capacity=1)
    stash.put(1, [])
    assert stash.get(1, []) == [] and stash.stats() == StashStats(1, 0, (1,))
    stash.release(1)


def test_reports_bytes_it_holds():
    stash = WeightStash(capacity=3)
    stash.put(1, [tf.zeros([10], tf.float32), tf.zeros([4], tf.float64)])
    stash.put(2, [tf.zeros([10], tf.float32), tf.zeros([4], tf.float64)])
    assert stash.stats().bytes == 2 * (40 + 32)
    stash.release(1)
    assert stash.stats().bytes == 72
    stash.close()


def test_refuses_more_than_capacity_versions_with_clear_error():
    stash = WeightStash(capacity=2, name="stage3")
    stash.put(4, [tf.zeros([1])])
    stash.put(5, [tf.zeros([1])])
    with pytest.raises(tf.errors.ResourceExhaustedError,
                       match=r"stage3.*minibatch 6.*2 versions are live \(minibatches \[4, 5\]\).*Nm=2"):
        stash.put(6, [tf.zeros([1])])
    stash.release(4)
    stash.put(6, [tf.zeros([1])])
    assert stash.stats().minibatches == (5, 6)


def test_missing_and_duplicate_versions_are_errors():
    stash = WeightStash(capacity=2)
    stash.put(1, [tf.zeros([1])])
    with pytest.raises(tf.errors.AlreadyExistsError, match="minibatch 1 already"):
        stash.put(1, [tf.zeros([1])])
    with pytest.raises(tf.errors.NotFoundError, match=r"minibatch 7 \(live versions: \[1\]\)"):
        stash.get(7, [tf.float32])
    with pytest.raises(tf.errors.NotFoundError, match="minibatch 7"):
        stash.release(7)
    with pytest.raises(tf.errors.InvalidArgumentError, match="is float, requested int32"):
        stash.get(1, [tf.int32])


def test_stashed_version_is_unchanged_by_later_variable_updates():
    # w_p must stay the version p's forward pass used while the live weights move on.
    stash = WeightStash(capacity=2)
    v = tf.Variable([1.0, 1.0, 1.0])
    stash.put(1, [v.read_value()])
    v.assign_sub([0.5, 0.5, 0.5])
    stash.put(2, [v.read_value()])
    v.assign_add([10.0, 10.0, 10.0])
    np.testing.assert_array_equal(stash.get(1, [tf.float32])[0], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(stash.get(2, [tf.float32])[0], [0.5, 0.5, 0.5])


def test_works_inside_tf_function():
    stash = WeightStash(capacity=1)

    @tf.function
    def cycle(p, x):
        stash.put(p, [x])
        y = stash.get(p, [tf.float32])[0] * 2.0
        with tf.control_dependencies([y]):
            stash.release(p)
        return y

    for p in range(1, 4):
        np.testing.assert_allclose(cycle(tf.constant(p, tf.int64), tf.constant([float(p)])), [2.0 * p])
    assert stash.stats().num_versions == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="got 0"):
        WeightStash(capacity=0)


def test_stash_lives_on_its_device():
    tf.config.list_logical_devices()
    stash = WeightStash(capacity=1, device="/device:CPU:0")
    stash.put(1, [tf.ones([2])])
    assert "CPU:0" in stash.get(1, [tf.float32])[0].device
