"""Multi-process WSP scenarios on TensorFlow's distributed runtime (loopback), one per process.

    python -m tests.distributed.cluster_scenarios SCENARIO

A process can connect to one cluster only, and tasks end with the chief that started
them, so test_launch.py runs every scenario in a fresh process and reads the JSON
line it prints last.
"""
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _cluster(num_ps, worker_cpus):
    from hetpipe_tf.distributed.launch import LocalCluster

    return LocalCluster(num_ps=num_ps, worker_cpus=worker_cpus).start().connect()


def _two_workers(cluster, model, speeds, nm, d, loss, timeout_s=60, record_provenance=True):
    import keras

    from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
    from hetpipe_tf.runtime.wsp_runner import WSPRunner

    config = RunConfig(num_in_flight=nm, staleness_bound=d, optimizer=keras.optimizers.SGD(0.05), loss=loss,
                       record_provenance=record_provenance, timeout_s=timeout_s)
    return WSPRunner(model, [WorkerSpec(s, tuple(cluster.worker_devices(w))) for w, s in enumerate(speeds)], config,
                     cluster.ps_devices())


def wsp_exact():
    """Two VWs of different emulated speeds, two parameter servers, Nm=3, D=1, 10 minibatches
    each (the last wave partial): the global weights equal w0 - lr * every gradient, and every
    minibatch's weights keep the WSP bounds."""
    import numpy as np

    from hetpipe_tf.sync import staleness
    from tests.helpers.models import constant_gradient_model, mean_output
    from tests.helpers.references import exact_sgd_case

    cluster = _cluster(2, [2, 2])
    model = constant_gradient_model()
    n, nm, d = 10, 3, 1
    data, expected = exact_sgd_case(model, n)
    runner = _two_workers(cluster, model, ("1,1", "0.5,0.5"), nm, d, mean_output)
    runner.train(data, n)
    error = max(float(np.max(np.abs(v.numpy() - expected[v.path]))) for v in model.trainable_variables)
    checked = [staleness.check(runner.provenance(s), nm, d, 2) for s in range(2)]
    return {"max_error": error, "checked": checked, "clocks": list(runner.servers.clock.clocks()[0]),
            "ps_devices": sorted({v.device for v in runner.servers.variables.values()}),
            "stage_devices": [rt.trainable[0].value.device for vw in runner.vws for rt in vw.runtimes],
            "task_pids": [cluster.pid(*t) for t in cluster.tasks]}


def seed_001():
    """Seed 001's example (Nm=4, D=0) with two VWs on worker tasks."""
    import keras

    from hetpipe_tf.sync import staleness
    from tests.helpers import models
    from tests.helpers.data import random_batches
    from tests.helpers.models import LOSS

    cluster = _cluster(1, [2, 2])
    keras.utils.set_random_seed(0)
    model = models.mlp()
    runner = _two_workers(cluster, model, ("1,1", "0.5,0.5"), 4, 0, LOSS)
    runner.train([random_batches(model, 16, seed=i) for i in range(2)], 16)
    records = runner.provenance(0)
    return {"checked": staleness.check(records, 4, 0, 2),
            "mb11": [sorted(records[(0, 11)][0]), sorted(records[(0, 11)][1])],
            "mb12_globals": sorted(records[(0, 12)][1])}


def killed_worker():
    """A worker task dies mid-training: training must fail within its timeout with an error."""
    import keras

    from tests.helpers import models
    from tests.helpers.data import random_batches
    from tests.helpers.models import LOSS

    cluster = _cluster(1, [2, 2])
    keras.utils.set_random_seed(0)
    model = models.mlp()
    runner = _two_workers(cluster, model, ("1,1", "1,1"), 2, 0, LOSS, timeout_s=15, record_provenance=False)
    victim = cluster.pid("worker", 1)
    killed = {}

    def kill(worker, p, logs):
        if worker == 0 and p == 10 and not killed:
            os.kill(victim, signal.SIGKILL)
            killed["t"] = time.monotonic()

    t0 = time.monotonic()
    try:
        runner.train([random_batches(model, 8, seed=i) * 100 for i in range(2)], 800, on_minibatch_done=kill)
        outcome = {"error": None}
    except Exception as exc:  # noqa: BLE001 - what the test inspects
        outcome = {"error": type(exc).__name__, "message": str(exc)[:2000]}
    outcome.update(seconds_after_kill=time.monotonic() - killed.get("t", t0), killed=bool(killed),
                   task_pids=[cluster.pid(*t) for t in cluster.tasks])
    return outcome


SCENARIOS = {f.__name__: f for f in (wsp_exact, seed_001, killed_worker)}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)
