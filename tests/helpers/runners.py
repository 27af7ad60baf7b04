"""Several virtual workers under WSP in this process, on the logical CPU devices of tests/conftest.py."""
import keras

from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.wsp_runner import WSPRunner


def wsp_runner(model, speeds, nm, d, **kw):
    """A WSPRunner of one virtual worker per entry of `speeds` (device speeds such as "1,0.5"),
    their stages on the CPU devices in turn, one parameter server, SGD(0.05) unless given; `kw` go to the
    runner (a timeout of 60 s and emulated devices at dilation 1, without calibration probes,
    unless given: dilation=None calibrates)."""
    workers, n = [], 0
    for s in speeds:
        k = len(s.split(","))
        workers.append(WorkerSpec(s, tuple(f"/device:CPU:{(n + j) % 4}" for j in range(k))))
        n += k
    config = RunConfig(num_in_flight=nm, staleness_bound=d,
                       **dict({"optimizer": keras.optimizers.SGD(0.05), "timeout_s": 60, "dilation": 1.0}, **kw))
    return WSPRunner(model, workers, config, ["/device:CPU:0"])
