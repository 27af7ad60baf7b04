"""Discovery plus planning of the main job's model: `hetpipe plan --cluster=discover --model=cnn`
(this machine's devices listed, grouped, each type's passes timed, the CNN profiled on this host
and planned), beside `hetpipe plan --cluster=local_cpu --model=cnn` (the same profile and plan on a
preset of this host's CPU, nothing discovered), alternated, each in a fresh process with an empty
profile cache. JSON lines: per run its wall seconds, its CPU seconds and the load average before it;
a summary with the medians, discovery's extra seconds over the preset and the target (discovery
plus planning at most 30 s).

    python benchmarks/discovery.py [--rounds=2] [--out=benchmarks/results/discovery.jsonl]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {"discover": ["--cluster=discover"], "local_cpu": ["--cluster=local_cpu"]}
TARGET_S = 30.0


def run_once(cluster_flags):
    """(wall seconds, CPU seconds, stderr: what was found) of one `hetpipe plan` of the CNN, its profile not cached."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as home:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "plan", *cluster_flags, "--model=cnn"],
                              capture_output=True, text=True, timeout=900, env={**os.environ, "HOME": home})
        wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"hetpipe plan {' '.join(cluster_flags)} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="append the JSON lines here too")
    args = parser.parse_args()
    rows, walls = [], {name: [] for name in COMMANDS}
    for r in range(args.rounds):
        for name, flags in COMMANDS.items():
            load = os.getloadavg()[0]
            wall, cpu, out = run_once(flags)
            walls[name].append(wall)
            row = {"benchmark": "discovery", "round": r, "command": f"hetpipe plan {' '.join(flags)} --model=cnn",
                   "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_average_1min": round(load, 2),
                   "found": next((line for line in out.splitlines() if "discovered on this machine" in line), None)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    discover, preset = statistics.median(walls["discover"]), statistics.median(walls["local_cpu"])
    summary = {"benchmark": "discovery", "summary": True, "rounds": args.rounds, "discover_wall_s": round(discover, 2),
               "local_cpu_wall_s": round(preset, 2), "discovery_extra_s": round(discover - preset, 2),
               "met": discover <= TARGET_S, "targets": {"discover_wall_s": f"<= {TARGET_S:g}"}}
    rows.append(summary)
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
