"""The planning layer (pure Python, no TensorFlow): the model as plain data, clusters and
device specs, profiles, the cost model, the partitioner, the allocation policies and the
planner (HetPipe §4, §7, §8.1)."""
