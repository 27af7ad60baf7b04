"""The Keras-facing API: ``HetPipeStrategy`` and the TensorBoard callbacks."""
