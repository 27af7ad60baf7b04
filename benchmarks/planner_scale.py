"""The planner at scale: wall time and peak memory of `plan` per policy and for `auto`.

Pure prediction: nothing trains. Keras builds VGG-19, ResNet-152 (224x224, 1000 classes, batch 32,
SGD with momentum: one slot per weight) and a GPT-2-medium-sized transformer (keras_hub, random
weights, sequences of 1,024 tokens, 2 per minibatch, AdamW: two slots) once, only to read their
graphs into static profiles; every cell then plans one model on one cluster by one policy in a
child process of its own, which reads the profile from JSON, so that its wall time and peak
resident memory (VmHWM) are the planner's and the Python interpreter's (about 90 MiB), not the
model builder's. Clusters: the paper's (16 GPUs, four nodes of four); nodes of 8 GPUs with the
paper's four types round-robin over the nodes (64, 256, 1,024 GPUs); 256 GPUs of eight types (the
paper's four and A100 40GB, V100 32GB, RTX 3090, T4, from their data sheets). Also timed, at
1,024 GPUs: `hetpipe simulate --policy=hd` of HD's plan for 100 waves under WSP.

Each row is a JSON line; `auto`'s gain over the best of NP, ED and HD is one row per model and
cluster. `--label` names the code measured: with PYTHONPATH at another checkout of the package,
the same script measures another commit (its planner takes the same arguments); cells that overrun
`--timeout_s` or `--memory_GiB` are rows that say so.

    python benchmarks/planner_scale.py [--sizes=16,64,256,1024,e256] [--models=vgg19,resnet152,gpt2_medium]
                                       [--policies=np,ed,hd,auto] [--timeout_s=600] [--memory_GiB=8]
                                       [--simulate_waves=100] [--out=benchmarks/results/planner_scale.jsonl]
                                       [--label=after] [--package_commit=COMMIT]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The paper's four types (Table 1, as the `paper` preset) and four more, from their data sheets:
# FP32 peak TFLOP/s, memory, memory bandwidth.
MORE_TYPES = {
    "A": {"label": "A100 40GB", "peak_tflops": 19.5, "memory": "40G", "memory_bandwidth_GBps": 1555},
    "X": {"label": "V100 32GB", "peak_tflops": 15.7, "memory": "32G", "memory_bandwidth_GBps": 900},
    "B": {"label": "RTX 3090", "peak_tflops": 35.6, "memory": "24G", "memory_bandwidth_GBps": 936},
    "T": {"label": "Tesla T4", "peak_tflops": 8.1, "memory": "16G", "memory_bandwidth_GBps": 320},
}
CLUSTERS = ("16", "64", "256", "1024", "e256")
MODELS = {"vgg19": {"batch_size": 32, "optimizer_slots": 1}, "resnet152": {"batch_size": 32, "optimizer_slots": 1},
          "gpt2_medium": {"batch_size": 2, "optimizer_slots": 2, "sequence_length": 1024}}


def cluster_spec(name):
    """The cluster `name`: "16" is the paper's; "64", "256", "1024" are that many GPUs in nodes of 8
    of the paper's four types, round-robin over the nodes; "e256" is 256 GPUs of eight types."""
    from hetpipe_tf.planning.cluster import PRESETS

    spec = json.loads(json.dumps(PRESETS["paper"]))
    if name == "16":
        return spec
    eight = name.startswith("e")
    gpus = int(name[1:] if eight else name)
    if eight:
        spec["device_types"].update(MORE_TYPES)
    types = list(spec["device_types"])
    spec["name"] = f"{len(types)}types-{gpus}"
    spec["nodes"] = [{"name": f"n{i:03d}-{types[i % len(types)]}", "device_type": types[i % len(types)], "count": 8}
                     for i in range(gpus // 8)]
    return spec


def build_profile(name):
    """The static profile of model `name` at its batch size (MODELS)."""
    from hetpipe_tf.runtime.profiler import model_profile

    if name == "gpt2_medium":
        from hetpipe_tf.cli.hetpipe import build_transformer
        model = build_transformer(name)
    else:
        from hetpipe_tf.cli.models import build_model
        model = build_model(name, (224, 224, 3), 1000)
    return model_profile(model, MODELS[name]["batch_size"], sequence_length=MODELS[name].get("sequence_length"))


def _composition(workers):
    """How many virtual workers of each device-type string a plan has, e.g. {"VVQQ": 2, "RRGG": 2}."""
    out = {}
    for w in workers:
        key = "".join(sorted(w.device_types))
        out[key] = out.get(key, 0) + 1
    return out


def peak_rss_mib():
    """This process's peak resident memory since it started (VmHWM; ru_maxrss would count the
    parent's, which a child inherits across exec)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return round(kib / 1024, 1)


def child(args):
    """One cell, in a process of its own: plan (and simulate) and print one JSON line."""
    from hetpipe_tf.planning.cluster import load_cluster
    from hetpipe_tf.planning.planner import plan, simulate_plan
    from hetpipe_tf.planning.request import PlanRequest
    from hetpipe_tf.planning.profile import Profile

    with open(args.profile) as f:
        profile = Profile.from_json(f.read())
    cluster = load_cluster(cluster_spec(args.cluster))
    t0 = time.perf_counter()
    p = plan(profile, cluster, PlanRequest(policy=args.policy, placement="default"),
             optimizer_slots=args.optimizer_slots)
    row = {"plan_s": round(time.perf_counter() - t0, 3), "predicted_images_per_s": round(p.images_per_s, 2),
           "num_in_flight": p.num_in_flight, "workers": len(p.workers), "allocation": _composition(p.workers),
           "chosen": p.policy}
    if args.simulate_waves:
        t0 = time.perf_counter()
        report = simulate_plan(p, args.simulate_waves * p.num_in_flight)
        row.update(simulate_s=round(time.perf_counter() - t0, 3), waves=args.simulate_waves,
                   simulated_images_per_s=round(report["images_per_s"], 2))
    row["peak_rss_MiB"] = peak_rss_mib()
    print(json.dumps(row), flush=True)


def run_cell(profile_path, cluster, policy, timeout_s, memory_gib, optimizer_slots, simulate_waves=0):
    """A cell's row from its child, or what stopped it (time, memory, an error)."""
    def limit():
        cap = int(memory_gib * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    load = round(os.getloadavg()[0], 2)  # this shared machine's load as the cell starts
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--profile", profile_path, "--cluster", cluster,
           "--policy", policy, "--simulate_waves", str(simulate_waves), "--optimizer_slots", str(optimizer_slots)]
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"stopped": f"timeout after {timeout_s:g} s", "wall_s": round(time.perf_counter() - t0, 1),
                "load_average": load}
    wall = round(time.perf_counter() - t0, 2)
    if run.returncode != 0:
        tail = run.stderr.strip().splitlines()[-1:] or ["(no message)"]
        stopped = "memory limit" if "MemoryError" in run.stderr else "error"
        message = tail[0] if len(tail[0]) <= 300 else f"{tail[0][:100]} ... {tail[0][-200:]}"  # its reason ends it
        return {"stopped": f"{stopped}: {message}", "wall_s": wall, "load_average": load}
    return {**json.loads(run.stdout.strip().splitlines()[-1]), "wall_s": wall, "load_average": load}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(CLUSTERS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--policies", default="np,ed,hd,auto")
    parser.add_argument("--timeout_s", type=float, default=600.0)
    parser.add_argument("--memory_GiB", type=float, default=8.0)
    parser.add_argument("--simulate_waves", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/planner_scale.jsonl")
    parser.add_argument("--label", default="after")
    parser.add_argument("--package_commit", default=None,
                        help="the commit of the package measured (default: this checkout's HEAD), for a run with "
                             "PYTHONPATH at another checkout")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer_slots", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    commit = args.package_commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                   text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    import hetpipe_tf
    base = {"benchmark": "planner_scale", "emulated": False, "label": args.label, "commit": commit,
            "package": os.path.dirname(hetpipe_tf.__file__), "nproc": os.cpu_count(),
            "load_average_at_start": round(os.getloadavg()[0], 2)}
    out = open(args.out, "a") if args.out else None

    def emit(**fields):
        line = json.dumps({**base, **fields})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            t0 = time.perf_counter()
            profile = build_profile(name)
            path = os.path.join(tmp, name + ".json")
            with open(path, "w") as f:
                f.write(profile.to_json())
            emit(model=name, profile_s=round(time.perf_counter() - t0, 2), segments=profile.num_segments,
                 batch_size=profile.batch_size)
            slots = MODELS[name]["optimizer_slots"]
            for size in args.sizes.split(","):
                from hetpipe_tf.planning.cluster import load_cluster
                cluster = load_cluster(cluster_spec(size))
                found = {}
                for policy in args.policies.split(","):
                    row = run_cell(path, size, policy, args.timeout_s, args.memory_GiB, slots)
                    found[policy] = row.get("predicted_images_per_s")
                    emit(model=name, cluster=cluster.name, gpus=len(cluster.devices()), policy=policy, **row)
                fixed = {k: v for k, v in found.items() if k != "auto" and v is not None}
                if "auto" in found and found["auto"] is not None and fixed:
                    best = max(fixed, key=fixed.get)
                    emit(model=name, cluster=cluster.name, auto_images_per_s=found["auto"], best_fixed=best,
                         best_fixed_images_per_s=fixed[best], auto_gain=round(found["auto"] / fixed[best] - 1, 4))
                if size == "1024" and args.simulate_waves:
                    row = run_cell(path, size, "hd", args.timeout_s, args.memory_GiB, slots, args.simulate_waves)
                    emit(model=name, cluster=cluster.name, gpus=len(cluster.devices()), policy="hd", simulate=True,
                         **row)
    if out:
        out.close()


if __name__ == "__main__":
    main()
