"""Pipe-SGD's light compressions (seed 002): each one's error stays within its bound, and what
they communicate is what they say (bfloat16 truncation, int8 values packed four to a word)."""
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.sync.compression import (decode_quant8, dequantize8, encode_quant8, pack_int8, quantize8,
                                         truncate16, unpack_int8, untruncate16)
from hetpipe_tf.sync.pipe_sgd import COMPRESSIONS


def _values(seed=0, n=4000):
    rng = np.random.default_rng(seed)
    # magnitudes from 1e-30 to 1e30, both signs, and a few exact zeros
    x = rng.normal(size=n) * 10.0 ** rng.uniform(-30, 30, size=n)
    x[:5] = 0.0
    return x.astype("float32")


def test_truncate16_drops_the_16_low_bits_and_errs_by_at_most_2_to_the_minus_7_relatively():
    x = _values()
    c = truncate16(x)
    assert c.dtype == tf.bfloat16  # 2 bytes per value communicated
    back = untruncate16(c).numpy()
    assert np.all(back.view(np.uint32) & 0xFFFF == 0)
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32) & 0xFFFF0000)  # truncation, not rounding
    err = np.abs(x.astype("float64") - back)
    assert np.all(err <= 2.0 ** -7 * np.abs(x))
    assert err.max() > 0 and np.max(err / np.maximum(np.abs(x), 1e-38)) > 2.0 ** -8  # the bound is nearly reached
    # rounding would give 1 + 2^-7 here; truncation keeps 1
    assert untruncate16(truncate16(np.float32(1 + 2.0 ** -7 * 0.99))).numpy() == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_quant8_errs_by_at_most_half_its_scale_max_abs_over_127(seed):
    x = np.random.default_rng(seed).normal(size=(37, 11)).astype("float32") * 3.0
    q, s = quantize8(x)
    assert q.dtype == tf.int8 and s.numpy() == pytest.approx(np.abs(x).max() / 127, rel=1e-6)
    assert np.abs(q.numpy()).max() == 127  # the largest value uses the whole range
    err = np.abs(dequantize8(q, s).numpy() - x)
    assert np.all(err <= s.numpy() / 2 * (1 + 1e-6))
    assert err.max() > s.numpy() / 4  # not trivially exact
    zq, zs = quantize8(np.zeros(5, "float32"))
    assert zs.numpy() == 0.0 and np.all(dequantize8(zq, zs).numpy() == 0.0)


def test_int8_values_pack_four_to_an_int32_word():
    q = tf.constant(np.arange(-60, 61, 11, dtype=np.int8))  # 11 values: 3 words, one padded
    words = pack_int8(q)
    assert words.dtype == tf.int32 and words.shape == (3,)
    assert np.array_equal(unpack_int8(words, 11).numpy(), q.numpy())


def test_a_quant8_payload_is_a_quarter_of_the_float32_bytes_and_decodes_to_the_dequantised_values():
    shapes = [(16, 8), (8,), (5, 3)]
    xs = [np.random.default_rng(i).normal(size=shape).astype("float32") for i, shape in enumerate(shapes)]
    payload = encode_quant8(xs)
    n = sum(x.size for x in xs)
    assert payload.dtype == tf.int32 and payload.shape == (3 + 32 + 2 + 4,)  # 3 scales, then ceil(n_i / 4) words each
    assert payload.shape[0] * 4 <= n + 4 * (3 + 3)  # ~1 byte per value, plus the scales and padding
    for got, x in zip(decode_quant8(payload, [tf.constant(x) for x in xs]), xs):
        np.testing.assert_array_equal(got.numpy(), dequantize8(*quantize8(x)).numpy())


def test_the_pure_names_match_the_wire_bytes():
    assert {n: c.wire_bytes for n, c in COMPRESSIONS.items()} == {"none": 4.0, "truncate16": 2.0, "quant8": 1.0}
    with pytest.raises(ValueError, match="truncate16 compresses float32 tensors, got float64"):
        truncate16(np.zeros(3))
