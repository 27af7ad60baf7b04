"""Test set-up shared by every test.

Emulated devices are logical CPU devices, which TensorFlow only creates before its
runtime starts: make enough of them here, before any test touches TensorFlow.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 4)
