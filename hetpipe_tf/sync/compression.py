"""Pipe-SGD's light compressions in TensorFlow (Pipe-SGD, "Compression": "floating-point
truncation on 16-bit LSBs, and scalar 8-bit quantization"), and their wire formats.

What :mod:`hetpipe_tf.sync.pipe_sgd` names and bounds (:data:`hetpipe_tf.sync.pipe_sgd.COMPRESSIONS`)
is computed here, on the device of the tensors given:

* ``truncate16``: a float32 with its 16 low bits set to zero is a bfloat16 exactly (sign, 8
  exponent bits, the 7 high mantissa bits), so C(x) is that bfloat16 (2 bytes on the wire) and
  D(C(x)) its float32: |x - D(C(x))| <= 2^-7·|x| (the dropped bits are less than one unit of
  the 7th mantissa bit). Truncation, not rounding, as Pipe-SGD says.
* ``quant8``: one scale per tensor, s = max|x| / 127, and q = round(x / s) in -127..127 (int8,
  1 byte on the wire, four packed in an int32 word, since TensorFlow's collectives carry no
  int8); D(q) = s·q, so |x - D(C(x))| <= s / 2. An all-zero tensor has s = 0 and q = 0.
"""
from collections.abc import Sequence

import tensorflow as tf

_HIGH_BITS = 0xFFFF0000


def truncate16(x: tf.Tensor) -> tf.Tensor:
    """C(x) of ``truncate16``: float32 `x` with its 16 low bits dropped, as a bfloat16 tensor."""
    x = tf.convert_to_tensor(x)
    if x.dtype != tf.float32:
        raise ValueError(f"truncate16 compresses float32 tensors, got {x.dtype.name}; use compression='none' "
                         f"for other types")
    kept = tf.bitwise.bitwise_and(tf.bitcast(x, tf.uint32), tf.constant(_HIGH_BITS, tf.uint32))
    return tf.cast(tf.bitcast(kept, tf.float32), tf.bfloat16)  # exact: the value is a bfloat16


def untruncate16(c: tf.Tensor) -> tf.Tensor:
    """D(c) of ``truncate16``: the float32 of a bfloat16 (exact)."""
    return tf.cast(c, tf.float32)


def quantize8(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """C(x) of ``quant8``: (q, s) with s = max|x| / 127 and q = round(x / s) as int8."""
    x = tf.convert_to_tensor(x)
    if x.dtype != tf.float32:
        raise ValueError(f"quant8 compresses float32 tensors, got {x.dtype.name}; use compression='none' "
                         f"for other types")
    scale = tf.maximum(tf.reduce_max(tf.abs(x)), 0.0) / 127.0  # an empty tensor's max is -inf
    q = tf.math.divide_no_nan(x, scale)
    return tf.cast(tf.clip_by_value(tf.round(q), -127.0, 127.0), tf.int8), scale


def dequantize8(q: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """D(q, s) of ``quant8``: s·q as float32."""
    return tf.cast(q, tf.float32) * scale


def pack_int8(q: tf.Tensor) -> tf.Tensor:
    """The int8 values of `q` (flattened) as int32 words, four to a word (zeros pad the last)."""
    flat = tf.reshape(q, [-1])
    pad = -flat.shape.num_elements() % 4
    flat = tf.concat([flat, tf.zeros([pad], tf.int8)], 0)
    return tf.bitcast(tf.reshape(flat, [-1, 4]), tf.int32)


def unpack_int8(words: tf.Tensor, size: int) -> tf.Tensor:
    """The first `size` int8 values packed in `words` by :func:`pack_int8`."""
    return tf.reshape(tf.bitcast(words, tf.int8), [-1])[:size]


def encode_quant8(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """One worker's ``quant8`` payload of float32 `tensors`: an int32 vector of every tensor's
    scale (its float32 bits), then every tensor's packed q. The same length on every worker."""
    scales: list[tf.Tensor] = []
    words: list[tf.Tensor] = []
    for x in tensors:
        q, s = quantize8(x)
        scales.append(s)
        words.append(pack_int8(q))
    return tf.concat([tf.bitcast(tf.stack(scales), tf.int32)] + words, 0)


def decode_quant8(payload: tf.Tensor, like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The float32 tensors (shaped as `like`, whose shapes are known) of one worker's
    :func:`encode_quant8` payload."""
    n = len(like)
    scales = tf.bitcast(payload[:n], tf.float32)
    out: list[tf.Tensor] = []
    at = n
    for i, x in enumerate(like):
        size = x.shape.num_elements()
        count = -(-size // 4)
        q = unpack_int8(payload[at:at + count], size)
        out.append(tf.reshape(dequantize8(q, scales[i]), x.shape))
        at += count
    return out
