"""The GPU acceptance check: what a user with GPUs runs first, and pastes the report of.

CI has no GPU: the GPU paths are tested there through one seam (the listing of this machine's GPUs,
:mod:`hetpipe_tf.distributed.gpus`), and this script is how a GPU machine is checked. It runs:

1. **devices**: the GPUs TensorFlow lists here (name, memory, compute capability), each timed on a
   small model's training step with TensorFlow directly (step time, images/s, the step's
   effective TFLOP/s, and its peak memory);
2. **equality**: one virtual worker pipelined over two GPUs (``gpu:0,gpu:1``; over ``gpu:0``
   twice with one GPU) against Keras on one GPU, at Nm = 1 and the same minibatches: their weights
   must agree within the project's tolerance (``--atol``, 1e-5 as the tests use), with the
   worker's throughput and each GPU's peak memory;
3. **wsp**: two virtual workers under WSP (D = 1) with ``launch="processes"`` on a cluster file
   made of the GPUs found (a node per kind of GPU, its speed the effective TFLOP/s measured in
   1.), in a child process (the chief there must hide the GPUs before TensorFlow starts, which
   this process has used): its plan and images/s.

On a machine without a GPU it says "no GPU found" and exits 0. ``--cpu_dry_run`` runs the same
code on the host CPU in place of the GPUs (the equality over ``cpu,cpu``, the WSP check on a
host-CPU cluster): what the tests run to keep the script working. Every row is also written as a
JSON line (``--out``).

    python benchmarks/gpu_check.py [--steps=20] [--atol=1e-5] [--out=gpu_check.jsonl] [--cpu_dry_run]
        [--checks=devices,equality,wsp]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BENCHMARK = "gpu_check"
#: Minibatch size and layer widths of the check's model (an MLP: its FLOPs are known exactly).
BATCH, FEATURES, WIDTH, CLASSES = 128, 256, 1024, 10
DRY = {"batch": 16, "width": 64}  # the dry run's smaller model: the host CPU stands for every GPU


def model_shape(dry):
    return (DRY["batch"], DRY["width"]) if dry else (BATCH, WIDTH)


def build_model(width):
    import keras

    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(CLASSES)], name="gpu_check_mlp")


def train_flops(model, batch):
    """FLOPs of one training step of the MLP: 2 per multiply-add forward, twice that backward."""
    return 6 * batch * sum(int(w.shape[0]) * int(w.shape[1]) for w in model.trainable_weights if len(w.shape) == 2)


def data(n_batches, batch, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_batches * batch, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=n_batches * batch)
    return x, y


def peak_memory(device):
    """The peak bytes TensorFlow allocated on `device` ("GPU:0") since its last reset, or None (a CPU)."""
    import tensorflow as tf

    if "GPU" not in device:
        return None
    return int(tf.config.experimental.get_memory_info(device)["peak"])


def reset_memory(devices):
    import tensorflow as tf

    for device in devices:
        if "GPU" in device:
            tf.config.experimental.reset_memory_stats(device)


def time_device(device, label, steps, dry):
    """One device's row: a small model's training step timed on it with TensorFlow directly."""
    import keras
    import tensorflow as tf

    batch, width = model_shape(dry)
    reset_memory([device])
    with tf.device(device):
        keras.utils.set_random_seed(0)
        model = build_model(width)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = data(1, batch)
        x, y = tf.constant(x), tf.constant(y)
        for _ in range(3):  # traces and warms up
            model.train_on_batch(x, y)
        start = time.perf_counter()
        for _ in range(steps):
            loss = model.train_on_batch(x, y)
        float(loss)  # waits for the last step
        seconds = (time.perf_counter() - start) / steps
    return {"benchmark": BENCHMARK, "check": "device", "device": device, "label": label,
            "step_ms": round(seconds * 1e3, 3), "images_per_s": round(batch / seconds, 1),
            "effective_tflops": round(train_flops(model, batch) / seconds / 1e12, 4),
            "peak_memory_bytes": peak_memory(device.lstrip("/"))}


def equality(devices, steps, atol, dry):
    """One virtual worker over `devices` (a device list, e.g. "gpu:0,gpu:1") against Keras on the
    first, at Nm = 1 on the same minibatches: the largest weight difference and the verdict."""
    import keras
    import numpy as np
    import tensorflow as tf

    from hetpipe_tf.runtime.virtual_worker import VirtualWorker

    batch, width = model_shape(dry)
    first = "/" + devices.split(",")[0].upper()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = data(steps, batch, seed=1)
    with tf.device(first):
        keras.utils.set_random_seed(0)
        reference = build_model(width)
        twin = build_model(width)
        twin.set_weights(reference.get_weights())
        reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        for i in range(steps):
            reference.train_on_batch(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
    names = ["GPU:" + d.split(":")[1] for d in devices.split(",") if d.startswith("gpu")]
    reset_memory(sorted(set(names)))
    vw = VirtualWorker(twin, devices, num_in_flight=1, optimizer=keras.optimizers.SGD(0.1), loss=loss, timeout_s=300)
    history = vw.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True), epochs=1,
                     verbose=0)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(twin.get_weights(), reference.get_weights()))
    return {"benchmark": BENCHMARK, "check": "equality", "devices": devices, "num_in_flight": 1, "steps": steps,
            "max_abs_weight_difference": diff, "atol": atol, "equal": diff <= atol,
            "images_per_s": round(float(history.history["images_per_s"][-1]), 1),
            "peak_memory_bytes": {n: peak_memory(n) for n in sorted(set(names))} or None}


def cluster_of(gpus, rows, dry):
    """The cluster file of the WSP check: a node per kind of GPU found (its GPUs named), its speed
    the effective TFLOP/s its first GPU measured; dry: two host-CPU nodes of one device each."""
    if dry:
        return {"name": "gpu_check_dry_run", "device_types": {"C": {"label": "host CPU", "host_cpu": True,
                                                                    "memory": "1G"}},
                "nodes": [{"name": "cpu-a", "device_type": "C", "count": 1},
                          {"name": "cpu-b", "device_type": "C", "count": 1}],
                "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0}}
    kinds = {}
    for g in gpus:
        kinds.setdefault(g.name, []).append(g)
    speed = {r["device"]: r["effective_tflops"] for r in rows}
    types, nodes = {}, []
    for k, (name, members) in enumerate(kinds.items()):
        types[f"T{k}"] = {"label": name, "memory": min(g.memory for g in members),
                          "peak_tflops": max(speed[f"/GPU:{members[0].index}"], 1e-3),
                          "memory_bandwidth_GBps": 300}  # not measured: the planner's links matter little here
        nodes.append({"name": f"node-{k}", "device_type": f"T{k}", "count": len(members),
                      "gpus": [g.index for g in members]})
    return {"name": "gpu_check", "device_types": types, "nodes": nodes,
            "links": {"intra_node_GBps": 15.75, "inter_node_GBps": 15.75}}


def wsp_child(cluster_path, steps, dry):
    """In a child process: two virtual workers under WSP with launch="processes"; prints its row."""
    import keras
    import tensorflow as tf

    from hetpipe_tf.api.strategy import HetPipeStrategy

    with open(cluster_path) as f:
        n_devices = sum(n["count"] for n in json.load(f)["nodes"])
    batch, width = model_shape(dry)
    strategy = HetPipeStrategy(cluster=cluster_path, policy="ed" if n_devices % 2 == 0 and n_devices > 2 else "np",
                               vw_size=max(1, n_devices // 2), staleness_bound=1, num_in_flight=2, launch="processes",
                               timeout_s=300)
    with strategy.scope():
        x, y = data(steps * 2, batch, seed=2)
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
        keras.utils.set_random_seed(0)
        model = build_model(width)
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
    row = {"benchmark": BENCHMARK, "check": "wsp", "launch": "processes", "staleness_bound": 1,
           "virtual_workers": len(strategy.plan.workers), "allocation": strategy.plan.allocation,
           "num_in_flight": strategy.plan.num_in_flight, "loss": round(float(history.history["loss"][-1]), 4),
           "images_per_s": round(float(history.history["images_per_s"][-1]), 1)}
    print("ROW " + json.dumps(row), flush=True)


def wsp(cluster, steps, dry):
    """The WSP check's row, from a child process (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        path = os.path.join(tmp, "cluster.json")
        with open(path, "w") as f:
            json.dump(cluster, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--wsp_child", path, f"--steps={steps}"]
        done = subprocess.run(cmd + (["--cpu_dry_run"] if dry else []), check=False, capture_output=True, text=True,
                              timeout=900)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows:
        return {"benchmark": BENCHMARK, "check": "wsp", "failed": f"exit {done.returncode}",
                "log": (done.stdout + done.stderr)[-3000:]}
    return json.loads(rows[-1])


def report(rows, dry):
    """The report to paste, as text lines."""
    lines = [f"hetpipe_tf GPU check{' (CPU DRY RUN: the host CPU in place of every GPU)' if dry else ''}"]
    for r in rows:
        if r["check"] == "listing":
            lines.append(f"devices: {r['gpus']} GPU(s)" + "".join(f"\n  {g}" for g in r["found"]))
        elif r["check"] == "device":
            mem = r["peak_memory_bytes"]
            lines.append(f"  {r['device']} {r['label']}: {r['step_ms']} ms/step, {r['images_per_s']} images/s, "
                         f"{r['effective_tflops']} effective TFLOP/s" + (f", peak {mem / 2 ** 20:.1f} MiB" if mem
                                                                          else ""))
        elif r["check"] == "equality":
            lines.append(f"equality: one virtual worker on {r['devices']} vs Keras on one, Nm=1, {r['steps']} steps: "
                         f"max |dw| {r['max_abs_weight_difference']:.2e} (atol {r['atol']:g}): "
                         f"{'EQUAL' if r['equal'] else 'NOT EQUAL'}; {r['images_per_s']} images/s; peak memory "
                         f"{r['peak_memory_bytes']}")
        elif r["check"] == "wsp":
            lines.append(f"wsp: {r.get('virtual_workers')} virtual workers, D=1, launch=processes: "
                         + (f"FAILED ({r['failed']})\n{r['log']}" if "failed" in r else
                            f"{r['allocation']}, Nm={r['num_in_flight']}, {r['images_per_s']} images/s, "
                            f"loss {r['loss']}"))
        elif r["check"] == "skipped":
            lines.append(f"{r['what']}: skipped ({r['why']})")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per check")
    parser.add_argument("--atol", type=float, default=1e-5, help="the equality check's tolerance on weights")
    parser.add_argument("--out", default=None, help="also write the rows there as JSON lines")
    parser.add_argument("--cpu_dry_run", action="store_true", help="run every check on the host CPU")
    parser.add_argument("--checks", default="devices,equality,wsp", help="which checks to run (comma-separated)")
    parser.add_argument("--wsp_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.wsp_child:
        return wsp_child(args.wsp_child, args.steps, args.cpu_dry_run)
    from hetpipe_tf.distributed.gpus import physical_gpus

    gpus = physical_gpus()
    rows = [{"benchmark": BENCHMARK, "check": "listing", "gpus": len(gpus), "found": [g.describe() for g in gpus],
             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "dry_run": args.cpu_dry_run}]
    if not gpus and not args.cpu_dry_run:
        rows.append({"benchmark": BENCHMARK, "check": "skipped", "what": "every check",
                     "why": "no GPU found: TensorFlow lists none here (is the gpu extra installed, and the NVIDIA "
                            "driver?); --cpu_dry_run runs the checks on the host CPU"})
    else:
        checks = set(args.checks.split(","))
        targets = ([("/CPU:0", "host CPU (dry run)")] if args.cpu_dry_run
                   else [(f"/GPU:{g.index}", g.name) for g in gpus])
        devices = [time_device(d, label, args.steps, args.cpu_dry_run) for d, label in targets]
        rows += devices if "devices" in checks else []
        pair = "cpu,cpu" if args.cpu_dry_run else "gpu:0,gpu:1" if len(gpus) > 1 else "gpu:0,gpu:0"
        if "equality" in checks:
            rows.append(equality(pair, args.steps, args.atol, args.cpu_dry_run))
        if "wsp" not in checks:
            pass
        elif args.cpu_dry_run or len(gpus) > 1:
            rows.append(wsp(cluster_of(gpus, devices, args.cpu_dry_run), args.steps, args.cpu_dry_run))
        else:
            rows.append({"benchmark": BENCHMARK, "check": "skipped", "what": "wsp",
                         "why": "two virtual workers of GPUs need two GPUs; one found"})
    print("\n".join(report(rows, args.cpu_dry_run)))
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    failed = any(r["check"] == "equality" and not r["equal"] or r["check"] == "wsp" and "failed" in r for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
