"""Data bundled with hetpipe_tf.

Importing this package registers the ``hetpipe_digits`` TensorFlow Datasets
builder (see ``hetpipe_tf.data.digits``); ``hetpipe_tf.data.datasets`` loads it.
"""
from hetpipe_tf.data.digits import HetpipeDigits  # noqa: F401  (registers the builder)
