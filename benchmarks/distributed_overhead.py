"""The multi-process runtime against one process: one process per virtual worker (JSON lines).

The same plan runs with ``launch="in_process"`` (every virtual worker a thread of one
process) and ``launch="processes"`` (the paper's deployment: parameter-server and worker
tasks on TensorFlow's distributed runtime over gRPC on loopback, and one process per
virtual worker, :mod:`hetpipe_tf.distributed.process_runner`), for 2 and 4 virtual
workers on the ``local`` preset's EMULATED devices (dilation calibrated per mode, so each
row's emulation is faithful for the runtime that ran it, and its overrun fraction is
reported). Each configuration runs in a fresh process (a process joins one cluster).

Per row: images/s of the last epoch (steady state), the ratio processes / in_process,
the chief's CPU seconds per minibatch, and the calls per minibatch and stage (stated by
:mod:`hetpipe_tf.distributed.process_runner`).

    python benchmarks/distributed_overhead.py [--epochs=4] [--model=cnn]
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = """
import json, resource, sys, time
import keras
from hetpipe_tf import HetPipeStrategy
from hetpipe_tf.cli import models
from hetpipe_tf.data import datasets

launch, policy, vw_size, epochs, model_name = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
strategy = HetPipeStrategy(cluster="local", policy=policy, vw_size=vw_size, num_in_flight=4, staleness_bound=0,
                           launch=launch, timeout_s=120)
keras.utils.set_random_seed(0)
train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=32, shuffle=True, seed=0)
with strategy.scope():
    model = models.build_model(model_name, tuple(train.element_spec[0].shape[1:]),
                               datasets.dataset_info("hetpipe_digits").num_classes)
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0 = cpu()
history = model.fit(train, epochs=epochs, verbose=0)
steps = epochs * int(train.cardinality())
report = strategy.runner.emulation_report()
print("RESULT " + json.dumps({"images_per_s": history.history["images_per_s"][-1],
                              "chief_cpu_s_per_minibatch": (cpu() - c0) / steps,
                              "allocation": strategy.plan.allocation, "emulation": report.as_dict()}))
"""


def run(launch, policy, vw_size, epochs, model):
    proc = subprocess.run([sys.executable, "-c", RUN, launch, policy, str(vw_size), str(epochs), model], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{launch} {policy} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="cnn")
    args = parser.parse_args()
    for workers, policy, vw_size in ((2, "ed", 2), (4, "np", 1)):
        rows = {}
        for launch in ("in_process", "processes"):
            rows[launch] = r = run(launch, policy, vw_size, args.epochs, args.model)
            print(json.dumps({"benchmark": "distributed_overhead", "virtual_workers": workers, "policy": policy,
                              "allocation": r["allocation"], "launch": launch, "devices": "EMULATED",
                              "images_per_s": round(r["images_per_s"], 1),
                              "chief_cpu_s_per_minibatch": round(r["chief_cpu_s_per_minibatch"], 5),
                              "function_calls_per_minibatch_per_stage": 3, "ops_per_minibatch_per_stage": 5,
                              "rpcs_per_minibatch_per_local_stage": 0 if launch == "processes" else None,
                              "emulation": r["emulation"]}), flush=True)
        print(json.dumps({"benchmark": "distributed_overhead", "virtual_workers": workers, "policy": policy,
                          "ratio_processes_over_in_process": round(
                              rows["processes"]["images_per_s"] / rows["in_process"]["images_per_s"], 3),
                          "target": ">= 0.9", "devices": "EMULATED",
                          "faithful": all(r["emulation"]["emulation_faithful"] for r in rows.values())}), flush=True)


if __name__ == "__main__":
    main()
