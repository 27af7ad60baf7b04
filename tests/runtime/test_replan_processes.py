"""A run that re-plans with a process per virtual worker (launch='processes', and 'tf_config' under
``hetpipe launch``; slow: each chief starts or joins the local cluster and its workers' processes;
CI's subset covers the switch's protocol in tests/distributed/test_replan_protocol.py and the switch
in one process in test_replan_switch.py).

A device that runs 5x slower than the plan says from the start is found by the watch, the run
decides to switch and switches at a drained point: every worker's process stays (the same pid,
the same task) and builds its worker again under the new plan from the state sent to it, its data
stream where it stands. The run ends within 1e-6 of the same run checkpointed on disk at the
switch's drained point and resumed under the new plan by new processes (three chiefs: the run;
the first plan's chunks up to the switch, saved; the new plan's from the checkpoint; the later two
are given the run's first and new plans, not plans of profiles they measure themselves). Every
wave is pushed once, every worker's share of every epoch trained once. The chief's images/s of a
train counts its every update; the workers of a run that does not re-plan send no stage compute.
Under 'tf_config' (the same ProcessRunner, its workers' processes started by their home nodes' worker
tasks) the same run switches once, keeps the processes those tasks started, and ends within 1e-6
of the run under 'processes'."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHIEF = r"""
import dataclasses, json, os, pickle, sys, time
import numpy as np, keras, tensorflow as tf
from hetpipe_tf.distributed.cluster_devices import ClusterDevices
from hetpipe_tf.distributed.launch import join_cluster
from hetpipe_tf.distributed.process_runner import ProcessRunner
from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime import plan_assembly as assembly
from hetpipe_tf.runtime.checkpoint import Checkpoints, PlanCuts
from hetpipe_tf.runtime.fit_loop import FitOptions, fit
from hetpipe_tf.runtime.replan.decide import SwitchRule, nominal_devices
from hetpipe_tf.runtime.replan.runner import ReplanningRunner, ReplanOptions
from hetpipe_tf.runtime.replan.watch import WatchRule
from hetpipe_tf.runtime.worker_data import worker_shards
from tests.helpers.replan import BATCH, given_profile

mode, out = sys.argv[1], sys.argv[2]
launch = sys.argv[3] if mode == "replan" else "processes"  # "tf_config": under `hetpipe launch`
STEPS, EPOCHS, SLOWED = 48, 2, "host-F:1"
cluster = load_cluster("local")
chief = join_cluster(cluster, launch, 120.0, 120.0)
devices = ClusterDevices(cluster, launch)

def model_():
    # tanh at a rate of 0.01: two runs equal in exact arithmetic round apart (a merge of pulled weights
    # falls after as many local updates as timing allows), and this model keeps that below 1e-6
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(384, activation="tanh") for _ in range(10)]
                            + [keras.layers.Dense(4)])

def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype("float32")
    y = rng.integers(0, 4, STEPS * BATCH)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True).repeat()

model = model_()
training = assembly.Training(keras.optimizers.SGD(0.01, momentum=0.9),
                             keras.losses.SparseCategoricalCrossentropy(from_logits=True), timeout_s=120)
# One virtual worker of the four devices: two workers' runs differ by when each pull is answered
# (a pull of wave c may hold another worker's wave c + 1), which timing across processes decides.
request = PlanRequest(policy="ed", vw_size=4, staleness_bound=0, dilation=1.0)
if mode == "replan":
    plan = assembly.assemble_plan(cluster, request, training.optimizer, given_profile(model))
    with open(out + ".first", "wb") as f:
        pickle.dump(plan, f)
else:  # the first plan of the run compared with: a plan of another measured profile may cut elsewhere
    plan = pickle.load(open(sys.argv[5], "rb"))

HOMES = [devices.home_node(w.devices) for w in plan.workers]  # each worker's process stays on its node

def workers(p):
    # the slowed device runs 5x slower than every plan says, from the start
    out = []
    for w in range(len(p.workers)):
        own = nominal_devices(p, w)
        spec, n = devices.worker(w, own, p.node_boundaries(w), p.host_pass_seconds(w), HOMES[w])
        specs = tuple(dataclasses.replace(s, speed=s.speed / 5) if d.name == SLOWED else s
                      for s, d in zip(spec.devices, own))
        out.append((dataclasses.replace(spec, devices=specs), n))
    return out

def runner(p, config):
    ws = workers(p)
    return ProcessRunner(model, chief, [s for s, _ in ws], config, devices.ps, [n for _, n in ws], HOMES,
                         stage_compute=mode == "replan")

def config(p):
    return assembly.resolved_config(request, p, PlanCuts.of_plan(p), training).replace(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9))

def shape(p):
    return [[[d.name for d in w.devices], list(p.node_boundaries(i))] for i, w in enumerate(p.workers)] + [
        p.num_in_flight, p.placement]

def weights():
    return [v.numpy() for v in model.variables]

if mode == "replan":
    def switch(old, p, cfg, state):
        ws = workers(p)
        old.switch_plan([s for s, _ in ws], cfg, HOMES, [n for _, n in ws], state)
        return old

    options = ReplanOptions(watch=WatchRule(window_waves=2, baseline_waves=1),
                            switch=SwitchRule(min_gain=0.0, payback=0.0), chunk_minibatches=4)
    run = ReplanningRunner(plan, request, config(plan), runner, options, switch_runner=switch)
    run.set_fit_length(STEPS * EPOCHS)
    pids = {}
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=training.loss)
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)
            if launch == "processes" and not pids.get(len(run.switches)):
                pids[len(run.switches)] = sorted(chief.pid(f"vw{w}", 0) for w in range(run.num_workers))

    fit(run, data(), FitOptions(epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0, callbacks=[Seen()]))
    with open(out + ".plan", "wb") as f:
        pickle.dump(run.plan, f)
    np.savez(out, *weights())
    result = {"switches": [{k: v for k, v in s.items() if k in ("positions", "after_chunks")} for s in run.switches],
              "decisions": run.decisions, "chunks": run.chunk_log, "positions": run.positions,
              "clocks": list(run.runner.servers.clock.clocks()[0]), "batches": len(seen), "pids": pids,
              "first_plan": shape(plan), "plan": shape(run.plan)}
elif mode == "before":  # the first plan's chunks up to the switch, checkpointed
    given = json.load(open(sys.argv[3]))
    first = runner(plan, config(plan))
    first.begin_fit(worker_shards(data(), len(plan.workers)), [0] * len(plan.workers))
    rates = []  # per chunk: the runner's images/s, and the chunk's images over the wall time of its train
    for _, chunk in given["chunks"][:given["switches"][0]["after_chunks"]]:
        called = time.perf_counter()
        first.train_fit(chunk)
        rates.append([first.images_per_s(), sum(chunk) * BATCH / (time.perf_counter() - called)])
        first.drain()
    Checkpoints(out).save(first.run_state(0, given["switches"][0]["positions"], PlanCuts.of_plan(plan)))
    # a run that does not re-plan: its workers' updates carry no stage compute
    result = {"rates": rates, "compute": [first.stage_compute_s(w) for w in range(first.num_workers)]}
else:  # "after": the new plan's chunks from the checkpoint, by new processes
    given = json.load(open(sys.argv[3]))
    new_plan = pickle.load(open(sys.argv[4], "rb"))
    state = Checkpoints(out).restore_model(model)
    second = runner(new_plan, config(new_plan))
    second.resume(state)
    second.begin_fit(worker_shards(data(), len(new_plan.workers)), state.positions)
    for _, chunk in given["chunks"][given["switches"][0]["after_chunks"]:]:
        second.train_fit(chunk)
        second.drain()
    second.end_fit()
    np.savez(out + "/final.npz", *weights())
    result = {}
print("RESULT " + json.dumps(result), flush=True)
"""


def _chief(*args, launcher=()):
    proc = subprocess.run([*launcher, sys.executable, "-c", CHIEF, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _weights(path):
    saved = np.load(path)
    return [saved[k] for k in sorted(saved.files, key=lambda k: int(k[4:]))]


@pytest.fixture(scope="module")
def replanned(tmp_path_factory):
    """The run that re-plans under launch='processes': its result and its directory."""
    path = tmp_path_factory.mktemp("replan")
    return _chief("replan", path / "replan.npz", "processes"), path


@pytest.mark.slow
def test_a_switch_keeps_the_processes_and_ends_as_a_checkpoint_resumed_under_the_new_plan(replanned):
    run, tmp_path = replanned
    assert len(run["switches"]) == 1, json.dumps(run["decisions"]) + json.dumps(run["first_plan"])
    [switch] = run["switches"]
    assert run["decisions"][0]["switch"] and run["decisions"][0]["slowed"][0]["device"] == "host-F:1"
    assert run["plan"] != run["first_plan"]  # stages in another order, other cuts, Nm or placement
    # the same processes before and after the switch
    assert run["pids"]["0"] == run["pids"]["1"], run["pids"]
    # Keras saw one run; every worker trained its share of every epoch; each wave pushed once
    steps, epochs, workers = 48, 2, len(run["positions"])
    assert run["batches"] == steps * epochs
    assert run["positions"] == [-(-(steps * epochs - w) // workers) for w in range(workers)]
    assert run["clocks"] == [sum(-(-n[w] // nm) for nm, n in run["chunks"]) for w in range(workers)]
    assert [sum(n[w] for _, n in run["chunks"][:switch["after_chunks"]]) for w in range(workers)] \
        == switch["positions"]
    given = tmp_path / "replan.json"
    given.write_text(json.dumps(run))
    saved = tmp_path / "checkpoint"
    first = tmp_path / "replan.npz.first"
    before = _chief("before", saved, given, "-", first)
    # images/s counts every update of a train: over the time from its start to its last update,
    # within the train's call
    assert all(counted >= called > 0 for counted, called in before["rates"]), before["rates"]
    assert before["compute"] == [[]] * workers
    _chief("after", saved, given, tmp_path / "replan.npz.plan", first)
    for a, b in zip(_weights(tmp_path / "replan.npz"), _weights(saved / "final.npz")):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_switch_under_tf_config_keeps_the_processes_its_nodes_tasks_started_and_trains_as_under_processes(
        replanned, tmp_path):
    expected, path = replanned
    logs = tmp_path / "logs"
    run = _chief("replan", tmp_path / "replan.npz", "tf_config", launcher=[
        sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "launch", "--cluster=local", f"--task_log_dir={logs}", "--"])
    assert len(run["switches"]) == 1, json.dumps(run["decisions"]) + json.dumps(run["first_plan"])
    assert [run[k] for k in ("first_plan", "plan", "chunks", "positions", "clocks", "batches")] \
        == [expected[k] for k in ("first_plan", "plan", "chunks", "positions", "clocks", "batches")]
    # each worker's process started once, by its home node's worker task, and kept across the switch
    started = [line for log in sorted(logs.glob("worker-*.log")) for line in log.read_text().splitlines()
               if "task starter: started vw" in line]
    assert len(started) == len(run["positions"]), started
    for a, b in zip(_weights(tmp_path / "replan.npz"), _weights(path / "replan.npz")):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
