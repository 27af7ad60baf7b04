"""One process per virtual worker (launch='processes'): the same training as in one process,
the stages on the worker's own node in its own process, the others on their node's task."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.marks import needs_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAIN = """
import json, sys
import numpy as np, keras, tensorflow as tf
from hetpipe_tf import HetPipeStrategy

launch, out, links = sys.argv[1], sys.argv[2], sys.argv[3] == "links"
# Today's recipe: bfloat16 compute (activations and gradients cross stages and processes in it),
# float32 weights, AdamW clipped by the norm of every stage's gradients together.
keras.config.set_dtype_policy("mixed_bfloat16")
strategy = HetPipeStrategy(cluster="local", policy="ed", vw_size=4, num_in_flight=2, staleness_bound=0,
                           dilation=1.0, launch=launch, timeout_s=60, emulate_links=links)
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int32")
# A dataset made before the chief joins the cluster (at scope()) names devices it then lacks.
early = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True) if launch == "processes" else None
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.AdamW(0.01, global_clipnorm=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
early_error = None
if early is not None:
    try:
        model.fit(early, epochs=1, verbose=0)
    except ValueError as e:
        early_error = str(e)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
first = model.fit(data, epochs=1, verbose=0)  # a second fit goes on where the first ended
history = model.fit(data, epochs=1, validation_data=data, verbose=0)
history.history.update({k: first.history[k] + history.history[k] for k in first.history})
np.savez(out, *[v.numpy() for v in model.weights])
runner = strategy.runner
nodes = [n.name for n in strategy.cluster.nodes]
worker = strategy.plan.workers[0]
print("RESULT " + json.dumps({
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "tasks": [list(t) + [runner.cluster.address(*t)] for t in getattr(getattr(runner, "cluster", None), "tasks", [])],
    "descriptions": getattr(runner, "descriptions", []),
    "home": nodes.index(worker.devices[0].node), "worker_nodes": sorted({nodes.index(d.node) for d in worker.devices}),
    "clocks": list(runner.servers.clock.clocks()[0]), "early_error": early_error,
    "weight_dtypes": sorted({v.dtype for v in model.weights})}))
"""


def _train(tmp_path, launch, links=False):
    out = tmp_path / f"{launch}{'-links' if links else ''}.npz"
    proc = subprocess.run([sys.executable, "-c", TRAIN, launch, str(out), "links" if links else "-"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    weights = np.load(out)
    return json.loads(lines[-1][len("RESULT "):]), [weights[k] for k in sorted(weights.files, key=lambda k: int(k[4:]))]


def test_a_virtual_worker_in_its_own_process_trains_exactly_as_in_one_process(tmp_path):
    """In bfloat16 with AdamW and a global clip norm: what crosses the process boundary is the
    compute dtype, the weights stay float32, and the result is one process's."""
    alone, expected = _train(tmp_path, "in_process")
    apart, got = _train(tmp_path, "processes")
    # The virtual worker has a process of its own beside the ps and worker tasks.
    assert {("vw0", 0), ("ps", 0)} <= {(job, i) for job, i, _ in apart["tasks"]}, apart["tasks"]
    # Its home node (the node of its first stage, which the plan picks by the measured profile) is one of
    # the two nodes its devices are on: its stages there run on its own devices, the other node's on
    # that node's worker task.
    lines, home, nodes = apart["descriptions"][0], apart["home"], apart["worker_nodes"]
    assert nodes == [0, 1] and home in nodes, (home, nodes)
    assert "/job:vw0/replica:0/task:0/device:CPU:0" in lines and f"/job:worker/task:{1 - home}/device:CPU:" in lines, \
        lines
    assert f"/job:worker/task:{home}/device:CPU:" not in lines, lines
    assert apart["clocks"] == alone["clocks"] == [16]  # 32 minibatches, waves of Nm = 2
    assert "make the dataset inside `with strategy.scope():`" in apart["early_error"], apart["early_error"]
    assert len(got) == len(expected)
    assert apart["weight_dtypes"] == alone["weight_dtypes"] == ["float32"]
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(apart["history"][key], alone["history"][key], atol=1e-5)
    # Validation reads the global weights when the chief reaches the epoch's end, while the
    # workers go on (as in one process), so it is only checked to be there.
    assert len(apart["history"]["val_loss"]) == 1


@pytest.mark.slow
@needs_root
def test_emulated_links_change_the_timing_not_the_training(tmp_path):
    # Each node's tasks in a network namespace of its own (hetpipe_tf.distributed.netlinks),
    # the virtual worker's process in its home node's: D = 0 trains exactly as in one process.
    alone, expected = _train(tmp_path, "in_process")
    linked, got = _train(tmp_path, "processes", links=True)
    addresses = {(job, i): address.rsplit(":", 1)[0] for job, i, address in linked["tasks"]}
    # The worker's process is in its home node's namespace (the plan picks the home by the measured
    # profile: either node), parameter server 0 in node 0's.
    assert addresses[("vw0", 0)] == addresses[("worker", linked["home"])]
    assert addresses[("ps", 0)] == addresses[("worker", 0)] != addresses[("worker", 1)]
    assert all(a.startswith("10.") for a in addresses.values()), addresses
    assert linked["clocks"] == alone["clocks"]
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, atol=1e-5)


CALIBRATE = """
import json
import numpy as np, keras, tensorflow as tf
from hetpipe_tf import HetPipeStrategy

strategy = HetPipeStrategy(cluster="local", policy="ed", num_in_flight=2, staleness_bound=0, launch="processes",
                           timeout_s=120)  # dilation None: calibrated
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    reports = []
    for _ in range(2):
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
        report = strategy.runner.emulation_report()
        reports.append({"dilation": report.dilation, "calibration": [list(c) for c in report.calibration],
                        "paced_tasks": report.tasks})
print("RESULT " + json.dumps({"reports": reports, "workers": strategy.runner.num_workers}))
"""


@pytest.mark.slow
def test_the_chief_calibrates_one_dilation_in_every_workers_process_once():
    """launch='processes' with dilation None (about 90 s): the chief probes every virtual worker's
    process at once before the first fit, and each process trains at that one dilation in both
    fits; the second fit probes no more."""
    proc = subprocess.run([sys.executable, "-c", CALIBRATE], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    first, second = result["reports"]
    assert result["workers"] == 2 and first["calibration"], result
    assert second["calibration"] == first["calibration"]  # no probe again
    # The run's one dilation, the first passing probe's or above, in both fits.
    assert first["dilation"] == second["dilation"] >= first["calibration"][-1][0]
    assert first["paced_tasks"] > 0 and second["paced_tasks"] > 0
