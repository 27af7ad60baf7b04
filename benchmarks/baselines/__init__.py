"""All-reduce baselines on emulated devices: Horovod (``benchmarks/horovod/``, its own
venv) and TensorFlow's MultiWorkerMirroredStrategy (:mod:`benchmarks.baselines.mwms`).

Both train hetpipe_tf's ``cnn`` on the bundled digits with the same emulated devices, the same
leave-out rule and the same JSON line, from :mod:`benchmarks.baselines.ranks` (pure Python, so
that the Horovod venv's TensorFlow 2.15 loads it too) and :mod:`benchmarks.baselines.training`
(TensorFlow and Keras 2 or 3). Nothing here imports at package import time.
"""
