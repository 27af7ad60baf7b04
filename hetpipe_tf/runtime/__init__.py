"""The TensorFlow runtime of one process: stages cut from a Keras model and placed with
``tf.device``, the stage runtime, the loss head, optimizers, the virtual worker, the fit
loop, the profiler, and several virtual workers under WSP."""
