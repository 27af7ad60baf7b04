"""hetpipe_tf custom ops: C++ kernels under cc/, their Python wrappers beside the loader."""
