"""Data that comes with hetpipe_tf.

Importing this package registers the ``hetpipe_digits`` (bundled, see
``hetpipe_tf.data.digits``) and ``hetpipe_addition`` (generated, see
``hetpipe_tf.data.addition``; its builder is ``hetpipe_tf.data.addition_builder``)
TensorFlow Datasets builders; ``hetpipe_tf.data.datasets`` loads them.
"""
from hetpipe_tf.data.addition_builder import HetpipeAddition  # noqa: F401  (registers the builder)
from hetpipe_tf.data.digits import HetpipeDigits  # noqa: F401  (registers the builder)
