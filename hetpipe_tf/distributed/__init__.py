"""TensorFlow's distributed runtime: the tasks of a cluster (``tf.distribute.Server``) and
how this process starts, joins and stops them."""
