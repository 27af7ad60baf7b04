"""Pipe-SGD's all-reduce on TensorFlow's collective ops, two members in threads of one process on
logical CPU devices: the sum, and what each compression sends and costs in accuracy."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.sync.allreduce import AllReduceGroup
from hetpipe_tf.sync.compression import dequantize8, quantize8

DEVICES = ("/device:CPU:0", "/device:CPU:1")
PATHS = ("dense/kernel", "dense/bias")


def _tensors(worker):
    rng = np.random.default_rng(worker)
    return [rng.normal(size=(7, 5)).astype("float32") * (worker + 1), rng.normal(size=(5,)).astype("float32")]


def _all_reduce(group, instance=1):
    out, errors = [None, None], []

    def member(w):
        try:
            with tf.device(DEVICES[w]):
                values = [tf.constant(x) for x in _tensors(w)]
            out[w] = [t.numpy() for t in group.all_reduce(w, 0, DEVICES[w], instance, values, PATHS)]
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_without_compression_every_member_gets_the_sum():
    group = AllReduceGroup("test-none", 2, "none", timeout_s=30)
    for instance in (1, 2):  # a stage's collectives follow one another
        out = _all_reduce(group, instance)
        for got in out:
            for g, a, b in zip(got, _tensors(0), _tensors(1)):
                np.testing.assert_array_equal(g, a + b)
    assert group.payload([tf.constant(x) for x in _tensors(0)]).dtype == tf.float32


def test_truncate16_sends_bfloat16_and_errs_within_its_bound_plus_one_bfloat16_rounding_of_the_sum():
    group = AllReduceGroup("test-truncate16", 2, "truncate16", timeout_s=30)
    sent = group.payload([tf.constant(x) for x in _tensors(0)])
    assert sent.dtype == tf.bfloat16 and sent.shape == (40,)  # 2 bytes per value
    out = _all_reduce(group)
    assert np.array_equal(out[0][0], out[1][0])
    for got, a, b in zip(out[0], _tensors(0), _tensors(1)):
        bound = 2.0 ** -7 * (np.abs(a) + np.abs(b)) + 2.0 ** -8 * np.abs(got)
        assert np.all(np.abs(got - (a + b)) <= bound) and np.any(got != a + b)


def test_quant8_sends_about_a_byte_per_value_and_sums_the_dequantised_values():
    group = AllReduceGroup("test-quant8", 2, "quant8", timeout_s=30)
    sent = group.payload([tf.constant(x) for x in _tensors(0)])
    assert sent.dtype == tf.int32 and sent.shape == (2 + 9 + 2,)  # 2 scales, ceil(35/4) + ceil(5/4) words
    out = _all_reduce(group)
    for i, got in enumerate(out[0]):
        a, b = _tensors(0)[i], _tensors(1)[i]
        (qa, sa), (qb, sb) = quantize8(a), quantize8(b)
        np.testing.assert_allclose(got, dequantize8(qa, sa).numpy() + dequantize8(qb, sb).numpy(), atol=1e-6)
        assert np.all(np.abs(got - (a + b)) <= (sa.numpy() + sb.numpy()) / 2 * (1 + 1e-5))


def test_members_on_one_device_or_with_other_variables_are_refused():
    group = AllReduceGroup("test-join", 2, "none")
    group.join(0, 0, DEVICES[0], PATHS)
    with pytest.raises(ValueError, match=r"workers 0 and 1 both have it on /device:CPU:0; give each worker its own"):
        group.join(1, 0, DEVICES[0], PATHS)
    with pytest.raises(ValueError, match=r"must cut the model at the same boundaries: worker 0's stage 0 holds "
                                         r"\['dense/kernel', 'dense/bias'\], worker 1's \['dense/kernel'\]"):
        group.join(1, 0, DEVICES[1], PATHS[:1])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ALONE = """
import tensorflow as tf
from hetpipe_tf.sync.allreduce import AllReduceGroup

group = AllReduceGroup("alone", 2, "none", timeout_s=1)
try:
    group.all_reduce(0, 3, "/device:CPU:0", 7, [tf.ones([3])], ["dense/bias"])
except TimeoutError as exc:
    print("TIMEOUT", exc)
"""


def test_an_all_reduce_that_a_worker_never_joins_times_out_saying_why():
    # in a process of its own: after a collective timed out, TensorFlow aborts the process's later ones
    run = subprocess.run([sys.executable, "-c", ALONE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("TIMEOUT Pipe-SGD: all-reduce 7 of stage 3 (virtual worker 0) did not hear from all 2 workers within "
            "1 s. Every worker must train the same minibatches of a run") in run.stdout
