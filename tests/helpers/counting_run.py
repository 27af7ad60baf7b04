"""A run whose global weights count the minibatches applied: two virtual workers in their own
processes, one of whose tasks may be sent a signal mid-run (tests/distributed/test_lost_worker.py
and test_kill_and_resume.py)."""
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 10.0

# Two virtual workers of one emulated device each (one stage, so a worker's clock is its
# stage's pushed waves) on one node and one parameter server, D = 0, Nm = 2, SGD without
# momentum on one minibatch repeated through a model linear in its weights, whose loss is linear in
# its outputs (the mean absolute error to labels far below them): every minibatch's update is the
# same, -lr * g, so the global weights count the minibatches pushed. 8 minibatches per epoch, 4
# per worker (2 waves). The run's JSON argument says which task gets which signal when: at the end
# of an epoch (batch None) or after the chief saw a minibatch of it.
TRAIN = r"""
import dataclasses, json, os, signal, sys, time
import numpy as np, keras, tensorflow as tf
from hetpipe_tf import HetPipeStrategy

run = json.loads(sys.argv[1])
cluster = {"name": "one-node", "device_types": {"E": {"label": "emulated", "emulated_speed": 1.0, "memory": "64M"}},
           "nodes": [{"name": "host", "device_type": "E", "count": 2}],
           "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0}}
strategy = HetPipeStrategy(cluster=cluster, policy="ed", vw_size=1, num_in_flight=2, staleness_bound=0,
                           dilation=4, timeout_s=run["timeout_s"], on_worker_failure=run["mode"],
                           checkpoint_dir=run.get("checkpoint_dir"), resume=run.get("resume", False))
x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
labels = np.full((4, 4), -1000.0, "float32")  # far below every output: |y - out| = out - y, linear
with strategy.scope():
    data = tf.data.Dataset.from_tensors((x, labels)).repeat(8)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="first"),
                              keras.layers.Dense(4, name="frozen", trainable=False)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mae")
start = [v.numpy().copy() for v in model.trainable_variables]
with tf.GradientTape() as tape:
    loss = keras.losses.MeanAbsoluteError()(labels, model(x))
gradients = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
signalled = {}
kill = run.get("kill")


def send():
    signalled["t"] = time.perf_counter()
    job = kill["task"]
    pid = os.getpid() if job == "chief" else strategy.runner.cluster.pid(job, 0)
    os.kill(pid, getattr(signal, kill["signal"]))


class Signal(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if kill and kill["batch"] is None and epoch == kill["epoch"]:
            send()

    def on_train_batch_end(self, batch, logs=None):
        if kill and not signalled and (self.epoch, batch) == (kill["epoch"], kill["batch"]):
            send()


history = model.fit(data, epochs=run["epochs"], steps_per_epoch=8, callbacks=[Signal()], verbose=2)
runner = strategy.runner
lost = [dataclasses.asdict(r) for r in runner.lost_workers]
for r in lost:
    r["detected_s"] = r.pop("found_at") - signalled["t"]
print("RESULT " + json.dumps({
    "clocks": list(runner.servers.clock.clocks()[0]), "lost": lost, "epochs": len(history.history["loss"]),
    "start": [w.tolist() for w in start], "gradients": [g.tolist() for g in gradients],
    "weights": [v.numpy().tolist() for v in model.trainable_variables]}), flush=True)
"""


def run_counting(mode="stop", kill=None, epochs=3, **more):
    """Runs TRAIN under on_worker_failure=`mode` for `epochs` epochs; `kill`: (task, signal name,
    epoch, minibatch or None for the epoch's end); `more`: checkpoint_dir, resume. Returns the
    finished process and what TRAIN printed (None if it printed nothing)."""
    run = dict(mode=mode, epochs=epochs, timeout_s=TIMEOUT_S, **more)
    if kill:
        run["kill"] = dict(zip(("task", "signal", "epoch", "batch"), kill))
    proc = subprocess.run([sys.executable, "-c", TRAIN, json.dumps(run)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc, json.loads(lines[-1][len("RESULT "):]) if lines else None


def applied_exactly(result, minibatches):
    """Whether the global weights are the start minus lr * g for exactly `minibatches` minibatches."""
    for start, g, got in zip(result["start"], result["gradients"], result["weights"]):
        np.testing.assert_allclose(got, np.asarray(start) - 0.05 * minibatches * np.asarray(g), atol=1e-5)
    return True
