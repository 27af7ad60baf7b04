"""The multi-process runtime against one process: one process per virtual worker (JSON lines).

The same plan runs with ``launch="in_process"`` (every virtual worker a thread of one
process) and ``launch="processes"`` (the paper's deployment: parameter-server and worker
tasks on TensorFlow's distributed runtime over gRPC on loopback, and one process per
virtual worker, :mod:`hetpipe_tf.distributed.process_runner`), for 2 virtual workers (ED,
each spanning both nodes, so one stage of each is on the other node's worker task; NP,
each on one node) and 4 (NP, one device each) of the ``local`` preset's EMULATED devices, and
the same groupings of the ``local_cpu`` preset (real compute: this host's CPU as it is, no
pacing). Each configuration runs in a fresh process (a process joins one cluster).

The two modes emulate the same devices: ``in_process`` calibrates the dilation (it needs
the larger one: every stage shares one Python process), and ``processes`` runs at that
dilation, so their images/s compare the runtimes, not two dilations. Each row reports
its own overrun fraction (faithful below 5 %).

Last, with emulated links between the two nodes (1 Gbit/s, 0.5 ms; each node's tasks in a
network namespace of its own, :mod:`hetpipe_tf.distributed.netlinks`, root needed), ED in
processes with §8.3's ``local`` parameter placement against ``default`` (target: local >=
default), at the dilation the first calibrates.

Per row: images/s over every epoch but the first (steady state), the chief's CPU seconds per
minibatch and those of every process of the run (the chief and the tasks it started), and
the calls per minibatch and stage (stated by :mod:`hetpipe_tf.distributed.process_runner`);
per configuration the ratio processes / in_process (target >= 0.9).

    python benchmarks/distributed_overhead.py [--epochs=4] [--model=cnn]
"""
import argparse
import json
import os
import sys

from hetpipe_tf.planning.cluster import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.baselines.processes import script_result  # noqa: E402

RUN = """
import json, resource, sys
import keras
from benchmarks.baselines.processes import tree_cpu
from hetpipe_tf import HetPipeStrategy
from hetpipe_tf.cli import models
from hetpipe_tf.data import datasets

launch, cluster, policy, vw_size, epochs, model_name = sys.argv[1:3] + [sys.argv[3], int(sys.argv[4]),
                                                                      int(sys.argv[5]), sys.argv[6]]
dilation = float(sys.argv[7]) if sys.argv[7] != "calibrate" else None
placement = sys.argv[8] if sys.argv[8] != "-" else None
cluster = json.loads(cluster) if cluster.startswith("{") else cluster
strategy = HetPipeStrategy(cluster=cluster, policy=policy, vw_size=vw_size, num_in_flight=4, staleness_bound=0,
                           launch=launch, dilation=dilation, timeout_s=120, placement=placement)
keras.utils.set_random_seed(0)
with strategy.scope():  # joins the cluster: datasets are made inside
    train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=32, shuffle=True, seed=0)
    model = models.build_model(model_name, tuple(train.element_spec[0].shape[1:]),
                               datasets.dataset_info("hetpipe_digits").num_classes)
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


c0, t0 = cpu(), tree_cpu()
history = model.fit(train, epochs=epochs, verbose=0)
t1 = tree_cpu()
steps = epochs * int(train.cardinality())
rates = history.history["images_per_s"][1:]  # steady state: the first epoch also starts and traces
print("RESULT " + json.dumps({"images_per_s": len(rates) / sum(1 / r for r in rates),
                              "chief_cpu_s_per_minibatch": (cpu() - c0) / steps,
                              "all_processes_cpu_s_per_minibatch": (t1 - t0) / steps,
                              "allocation": strategy.plan.allocation,
                              "emulation": report.as_dict() if (report := strategy.runner.emulation_report()) else None}))
"""

# Per minibatch and stage, and per stage and wave (hetpipe_tf.distributed.process_runner).
CALLS = {"calls_per_minibatch_per_stage": {"compiled_functions": 4, "custom_ops": 2, "eager_ops_and_reads_at_most": 3},
         "calls_per_wave_per_stage": {"push": 3, "pull": 1, "merge": "4 + stashed versions"},
         "rpcs": "a stage on the worker's own node: the push and the pull only; on another node's worker task: "
                 "one per call"}


def run(launch, cluster, policy, vw_size, epochs, model, dilation, placement=None):
    return script_result(RUN, [launch, cluster if isinstance(cluster, str) else json.dumps(cluster), policy,
                               str(vw_size), str(epochs), model, "calibrate" if dilation is None else str(dilation),
                               placement or "-"], ROOT, 1800, f"{launch} {policy}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="cnn")
    args = parser.parse_args()
    for cluster, devices in (("local", "EMULATED"), ("local_cpu", "host CPU (real compute)")):
        for workers, policy, vw_size in ((2, "ed", 2), (2, "np", 2), (4, "np", 1)):
            emulated = devices == "EMULATED"
            rows = {"in_process": run("in_process", cluster, policy, vw_size, args.epochs, args.model, None)}
            dilation = rows["in_process"]["emulation"]["dilation"] if emulated else None
            rows["processes"] = run("processes", cluster, policy, vw_size, args.epochs, args.model, dilation)
            common = {"benchmark": "distributed_overhead", "cluster": cluster, "devices": devices,
                      "virtual_workers": workers, "policy": policy}
            for launch, r in rows.items():
                print(json.dumps({**common, "allocation": r["allocation"], "launch": launch,
                                  "images_per_s": round(r["images_per_s"], 1),
                                  "chief_cpu_s_per_minibatch": round(r["chief_cpu_s_per_minibatch"], 5),
                                  "all_processes_cpu_s_per_minibatch": round(r["all_processes_cpu_s_per_minibatch"], 5),
                                  "emulation": r["emulation"], **CALLS}), flush=True)
            print(json.dumps({**common, "ratio_processes_over_in_process": round(
                rows["processes"]["images_per_s"] / rows["in_process"]["images_per_s"], 3), "target": ">= 0.9",
                **({"dilation": dilation, "faithful": all(r["emulation"]["emulation_faithful"] for r in rows.values())}
                   if emulated else {})}), flush=True)
    # §8.3: with links between the nodes, ED's local placement (each stage's layers on its own
    # node's server) against default (round-robin): the dilation calibrated by the first.
    linked = json.loads(json.dumps(PRESETS["local"]))
    linked["links"].update(inter_node_GBps=0.125, inter_node_latency_ms=0.5, emulate=True)  # 1 Gbit/s, 0.5 ms
    rows, dilation = {}, None
    for placement in ("local", "default"):
        rows[placement] = run("processes", linked, "ed", 2, args.epochs, args.model, dilation, placement)
        dilation = rows[placement]["emulation"]["dilation"]
        print(json.dumps({"benchmark": "distributed_overhead", "cluster": "local with emulated links",
                          "links": "1 Gbit/s, 0.5 ms between nodes", "devices": "EMULATED", "virtual_workers": 2,
                          "policy": "ed", "placement": placement, "launch": "processes",
                          "allocation": rows[placement]["allocation"],
                          "images_per_s": round(rows[placement]["images_per_s"], 1),
                          "emulation": rows[placement]["emulation"]}), flush=True)
    print(json.dumps({"benchmark": "distributed_overhead", "cluster": "local with emulated links",
                      "ratio_ed_local_over_default": round(rows["local"]["images_per_s"] / rows["default"]["images_per_s"],
                                                           3), "target": ">= 1.0", "dilation": dilation,
                      "faithful": all(r["emulation"]["emulation_faithful"] for r in rows.values())}), flush=True)


if __name__ == "__main__":
    main()
