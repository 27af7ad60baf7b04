"""The runtime's own cost per minibatch against Keras's ``fit``, on the host CPU (JSON lines).

Real compute, nothing emulated: every device is this host's CPU as it is. Two models, each at
the batch size the tables of the runtime's profile use (``docs/performance.md``):

* ``mlp``: Dense 32-32-32-10 on 32 features, batch 32: so little compute that a step's time
  is the cost of running it (Keras's whole training step, or the runtime's per stage);
* ``cnn``: six 3x3 convolutions (32, 32, 64, 64, 128, 128 filters, pooling after every second)
  and two Dense layers on 32x32x3 images, batch 64: compute-bound.

Configurations of each, every one in a fresh process:

* ``keras_fit``: ``model.fit`` with Keras's default ``compile`` (``jit_compile="auto"``, which is
  off on a CPU-only host);
* ``virtual_worker_k1``, ``_k2``, ``_k4``: ``VirtualWorker(devices="cpu,...")``, k stages on
  the host CPU, Nm = k;
* ``strategy_in_process`` and ``strategy_processes``: ``HetPipeStrategy(cluster="local_cpu",
  policy="np", vw_size=2, num_in_flight=2)``, two virtual workers of two stages each, as threads
  of one process and as one process per virtual worker with parameter-server and worker tasks
  on TensorFlow's distributed runtime (gRPC on loopback).

Each run fits three epochs of `--steps` minibatches and times the second: tracing and the
pipeline's start are in the first, and the last holds the run's end (its drain, and the first
call of the last minibatches' tasks, which stash no further version); the rounds alternate the
configurations, so that slow phases of a shared machine hit them alike, and each figure is the
median over `--rounds`.
Per row: ms per minibatch (for the strategy, per minibatch of either worker: the wall time over
every worker's minibatches), the ratio of Keras's ms to it, and the CPU seconds per minibatch of
every process of the run (the process and every process it started). Per model: the fixed cost
per stage (from the mlp: (ms at k stages - ms at 1) / (k - 1)), and the strategy's
processes / in_process ratio.

Targets: cnn k = 1 >= 0.97x Keras; mlp k = 1 at most 1.5x Keras's whole step; every further stage
<= 0.5 ms per minibatch; processes / in_process >= 0.9 on real compute, and the CPU per minibatch of
every process together <= 1.2x one process's.

A ``fit`` call as users make it (model ``fit_call``, `--fit-call-steps` minibatches, 400 by default):
an MLP (32 features, two Dense(32) with relu, Dense(10), each relu a layer of its own so that four
stages can be cut; batch 32; SGD) through Keras's ``fit`` and
``VirtualWorker`` at k = 1, 2, 4 (devices "cpu", "cpu,cpu", "cpu,cpu,cpu,cpu", Nm = k), every
configuration in one process, each keeping its model (and worker) across the rounds, which
alternate the configurations. Each round times, per configuration, the middle epoch of
``fit(epochs=3)`` (the steady rate per minibatch) and then a whole ``fit(epochs=1)`` call (never
the configuration's first: tracing that a second call need not repeat is not in it), from the
caller's side. Per row: both per minibatch, and the call's own cost (the call's wall time minus its
minibatches at that round's steady rate), medians over the rounds; the same in the process's CPU
time (steadier than wall time on a shared host); the summary gives the fixed cost per further stage
at the steady rate (wall and CPU).

Targets: a further stage <= 0.5 ms per minibatch; a whole call's own cost <= 0.1 s above Keras's at
k = 2 and <= 0.2 s at k = 4.

    python benchmarks/runtime_overhead.py [--rounds=3] [--steps=200] [--models=mlp,cnn,fit_call]
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.baselines.processes import script_result  # noqa: E402

CONFIGS = ("keras_fit", "virtual_worker_k1", "virtual_worker_k2", "virtual_worker_k4", "strategy_in_process",
           "strategy_processes")
BATCH = {"mlp": 32, "cnn": 64}

RUN = r"""
import json, os, sys, time
import numpy as np

config, model_name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
import keras
import tensorflow as tf
from benchmarks.baselines.processes import tree_cpu


def build(name):
    if name == "mlp":
        return keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(32, activation="relu") for _ in range(3)]
                                + [keras.layers.Dense(10)], name="mlp")
    i = keras.Input((32, 32, 3))
    x = i
    for block, filters in enumerate((32, 32, 64, 64, 128, 128)):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        if block % 2 == 1:
            x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    return keras.Model(i, keras.layers.Dense(10)(x), name="cnn")


def data(name, batch, workers=1):
    rng = np.random.default_rng(0)
    shape = (32,) if name == "mlp" else (32, 32, 3)
    n = steps * batch * workers
    x, y = rng.normal(size=(n,) + shape).astype("float32"), rng.integers(0, 10, size=n)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


class Clock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.start = (time.perf_counter(), tree_cpu())

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.end = (time.perf_counter(), tree_cpu())


batch = {"mlp": 32, "cnn": 64}[model_name]
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
keras.utils.set_random_seed(0)
clock = Clock()
minibatches = steps
if config == "keras_fit":
    model = build(model_name)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    model.fit(data(model_name, batch), epochs=3, verbose=0, callbacks=[clock])
elif config.startswith("virtual_worker"):
    from hetpipe_tf import VirtualWorker
    k = int(config[-1])
    model = build(model_name)
    vw = VirtualWorker(model, devices=",".join(["cpu"] * k), num_in_flight=k, optimizer=keras.optimizers.SGD(0.01),
                       loss=loss)
    vw.fit(data(model_name, batch), epochs=3, verbose=0, callbacks=[clock])
else:
    from hetpipe_tf import HetPipeStrategy
    launch = config[len("strategy_"):]
    strategy = HetPipeStrategy(cluster="local_cpu", policy="np", vw_size=2, num_in_flight=2, launch=launch,
                               timeout_s=300)
    with strategy.scope():
        model = build(model_name)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
        train = data(model_name, batch, workers=2)
    model.fit(train, epochs=3, verbose=0, callbacks=[clock])
    minibatches = steps * 2  # both workers' minibatches of the epoch
wall, cpu = (e - s for e, s in zip(clock.end, clock.start))
print("RESULT " + json.dumps({"ms_per_minibatch": 1e3 * wall / minibatches, "cpu_s_per_minibatch": cpu / minibatches}))
"""


FIT_CALL_CONFIGS = ("keras_fit", "virtual_worker_k1", "virtual_worker_k2", "virtual_worker_k4")

FIT_CALL = r"""
import json, sys, time
import numpy as np

steps, rounds = int(sys.argv[1]), int(sys.argv[2])
configs = sys.argv[3].split(",")
import keras
import tensorflow as tf
from hetpipe_tf import VirtualWorker

BATCH = 32
rng = np.random.default_rng(0)
x, y = rng.normal(size=(steps * BATCH, 32)).astype("float32"), rng.integers(0, 10, size=steps * BATCH)
train = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Clock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.start = (time.perf_counter(), time.process_time())

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.end = (time.perf_counter(), time.process_time())


def trainer(config):
    keras.utils.set_random_seed(0)
    # Dense(32, relu) twice and Dense(10), each relu a layer of its own: the same computation, in
    # five layer calls, so that k = 4 has cut points (three layer calls allow two).
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(32), keras.layers.Activation("relu"),
                              keras.layers.Dense(32), keras.layers.Activation("relu"), keras.layers.Dense(10)],
                             name="mlp")
    if config == "keras_fit":
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
        return model
    k = int(config[-1])
    return VirtualWorker(model, devices=",".join(["cpu"] * k), num_in_flight=k,
                         optimizer=keras.optimizers.SGD(0.01), loss=loss)


trainers = {c: trainer(c) for c in configs}
rows = {c: {key: [] for key in ("steady_ms", "call_ms", "call_own_s", "steady_cpu_ms", "call_own_cpu_s")}
        for c in configs}
for _ in range(rounds):
    for config in configs:
        clock = Clock()
        trainers[config].fit(train, epochs=3, verbose=0, callbacks=[clock])
        steady_s, steady_cpu_s = ((e - s) / steps for e, s in zip(clock.end, clock.start))
        start = (time.perf_counter(), time.process_time())
        trainers[config].fit(train, epochs=1, verbose=0)
        call_s, call_cpu_s = (e - s for e, s in zip((time.perf_counter(), time.process_time()), start))
        rows[config]["steady_ms"].append(1e3 * steady_s)
        rows[config]["call_ms"].append(1e3 * call_s / steps)
        rows[config]["call_own_s"].append(call_s - steps * steady_s)
        rows[config]["steady_cpu_ms"].append(1e3 * steady_cpu_s)
        rows[config]["call_own_cpu_s"].append(call_cpu_s - steps * steady_cpu_s)
print("RESULT " + json.dumps(rows))
"""


def fit_call(rounds, steps, configs):
    """Rows and summary of `fit` calls as users make them (every configuration in one process)."""
    configs = [c for c in FIT_CALL_CONFIGS if c in configs]
    rows = script_result(FIT_CALL, [str(steps), str(rounds), ",".join(configs)], ROOT, 3600, "fit_call")
    med = {c: {key: statistics.median(v) for key, v in r.items()} for c, r in rows.items()}
    keras_row = med.get("keras_fit")
    for config in configs:
        m = med[config]
        print(json.dumps({"benchmark": "runtime_overhead", "model": "fit_call", "batch_size": 32, "config": config,
                          "devices": "host CPU (real compute, nothing emulated)", "steps": steps,
                          "middle_epoch_ms_per_minibatch": round(m["steady_ms"], 3),
                          "whole_call_ms_per_minibatch": round(m["call_ms"], 3),
                          "call_own_cost_s": round(m["call_own_s"], 3),
                          "call_own_cost_above_keras_s": round(m["call_own_s"] - keras_row["call_own_s"], 3)
                          if keras_row else None,
                          "middle_epoch_cpu_ms_per_minibatch": round(m["steady_cpu_ms"], 3),
                          "call_own_cpu_s": round(m["call_own_cpu_s"], 3),
                          "each_round": {key: [round(v, 3) for v in vs] for key, vs in rows[config].items()}}),
              flush=True)
    summary = {"benchmark": "runtime_overhead", "model": "fit_call", "summary": True, "rounds": rounds,
               "steps": steps}
    if "virtual_worker_k1" in med:
        for k in (2, 4):
            if f"virtual_worker_k{k}" in med:
                for key, name in (("steady_ms", "fixed_cost_per_further_stage_ms"),
                                  ("steady_cpu_ms", "cpu_per_further_stage_ms")):
                    summary[f"{name}_k{k}"] = round(
                        (med[f"virtual_worker_k{k}"][key] - med["virtual_worker_k1"][key]) / (k - 1), 3)
    summary["targets"] = {"fixed_cost_per_further_stage_ms": "<= 0.5", "call_own_cost_above_keras_s at k=2": "<= 0.1",
                          "call_own_cost_above_keras_s at k=4": "<= 0.2"}
    print(json.dumps(summary), flush=True)


def run(config, model, steps):
    return script_result(RUN, [config, model, str(steps)], ROOT, 3600, f"{config} {model}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="minibatches per epoch (of each worker)")
    parser.add_argument("--models", default="mlp,cnn,fit_call")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--fit-call-steps", type=int, default=400, help="minibatches per epoch of fit_call")
    args = parser.parse_args()
    configs = args.configs.split(",")
    for model in args.models.split(","):
        if model == "fit_call":
            fit_call(args.rounds, args.fit_call_steps, configs)
            continue
        steps = args.steps if model == "mlp" else max(args.steps // 8, 10)
        results = {c: [] for c in configs}
        for _ in range(args.rounds):
            for config in configs:
                results[config].append(run(config, model, steps))
        ms = {c: statistics.median(r["ms_per_minibatch"] for r in rs) for c, rs in results.items()}
        cpu = {c: statistics.median(r["cpu_s_per_minibatch"] for r in rs) for c, rs in results.items()}
        keras_ms = ms.get("keras_fit")
        for config in configs:
            print(json.dumps({"benchmark": "runtime_overhead", "model": model, "batch_size": BATCH[model],
                              "config": config, "devices": "host CPU (real compute, nothing emulated)",
                              "ms_per_minibatch": round(ms[config], 3),
                              "ms_per_minibatch_each_round": [round(r["ms_per_minibatch"], 3) for r in results[config]],
                              "keras_over_this": round(keras_ms / ms[config], 3) if keras_ms else None,
                              "cpu_s_per_minibatch_all_processes": round(cpu[config], 5)}), flush=True)
        summary = {"benchmark": "runtime_overhead", "model": model, "summary": True, "rounds": args.rounds,
                   "steps_timed": steps}
        if "virtual_worker_k1" in ms:
            for k in (2, 4):
                if f"virtual_worker_k{k}" in ms:
                    summary[f"fixed_cost_per_further_stage_ms_k{k}"] = round(
                        (ms[f"virtual_worker_k{k}"] - ms["virtual_worker_k1"]) / (k - 1), 3)
            if keras_ms:
                summary["k1_ms_over_keras_ms"] = round(ms["virtual_worker_k1"] / keras_ms, 3)
        if "strategy_processes" in ms and "strategy_in_process" in ms:
            summary["processes_over_in_process_throughput"] = round(
                ms["strategy_in_process"] / ms["strategy_processes"], 3)
            summary["processes_over_in_process_cpu"] = round(
                cpu["strategy_processes"] / cpu["strategy_in_process"], 3)
        summary["targets"] = {"cnn: keras_over_this at k=1": ">= 0.97", "mlp: k1_ms_over_keras_ms": "<= 1.5",
                              "fixed_cost_per_further_stage_ms": "<= 0.5",
                              "processes_over_in_process_throughput": ">= 0.9",
                              "processes_over_in_process_cpu": "<= 1.2"}
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
