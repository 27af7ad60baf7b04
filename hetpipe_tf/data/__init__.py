"""Data that comes with hetpipe_tf.

``hetpipe_tf.data.datasets`` loads every data set; importing it registers the
``hetpipe_digits`` (bundled, see ``hetpipe_tf.data.digits``) and ``hetpipe_addition``
(generated, see ``hetpipe_tf.data.addition``; its builder is
``hetpipe_tf.data.addition_builder``) TensorFlow Datasets builders. The package itself
imports neither TensorFlow nor TensorFlow Datasets, so that the binaries check their flags
before either starts.
"""
import os

#: Where TensorFlow Datasets' data sets are prepared unless a data_dir is given.
DEFAULT_DATA_DIR = os.environ.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"), "tensorflow_datasets")
