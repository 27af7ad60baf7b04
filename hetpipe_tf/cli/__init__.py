"""The binaries: ``hetpipe-train`` (train.py) and ``hetpipe`` (hetpipe.py), their flags,
how they end on an error, the model zoo they build by name, and the pictures."""
