"""HetPipe against the all-reduce baselines on CPU-quota nodes: real compute, nothing padded.

The pieces ``benchmarks/throughput_vs_horovod.py --cluster=paper_quota`` runs. The nodes are the
``paper_quota`` preset's (:mod:`hetpipe_tf.planning.cluster`): four node types V, R, G, Q of two
devices each, a device of type t being ``cpu_quota`` cores of this host, and a node running its
tasks in a CPU-quota group of its devices' quotas together (:mod:`hetpipe_tf.distributed.cgroups`).
Nothing is emulated: no device is paced, no dilation; a device is as fast as its group lets the
process computing on it be.

Every system runs on the same groups:

* **Speeds** (:func:`measure_speeds`, in a process of its own with one intra-op thread, as a
  worker task computes): the model's profile on this host, unconstrained, and each type's speed
  measured on the model's passes in a group of its quota
  (:func:`hetpipe_tf.distributed.node_speed.measure_quota_speeds`); the profile with the types'
  times (the host's divided by the speeds) is written once and given to every HetPipe run, so
  that every run plans, and every row's bound is computed, on the same measured speeds.
* **HetPipe** (:func:`hetpipe_row`): ``HetPipeStrategy(cluster="paper_quota",
  launch="processes")``, each node's worker task and the virtual workers' processes it starts in
  the node's group; the chief and the parameter servers outside every group.
  Each node's worker task runs in the node's group and computes every stage on the node's devices
  (the home node's too); the virtual workers' own processes (the executor, the remote calls to
  the stages, the wave's pushes and pulls), the chief and the parameter servers run outside every
  group: a device computes, its host runs the runtime that drives it
  (:mod:`hetpipe_tf.distributed.cluster_devices`).
* **Horovod** and **MultiWorkerMirroredStrategy** (:func:`baseline_row`): one rank per device
  (a device too small for the whole model left out, the leave-out rule), its training as the
  emulated runs' but unpaced (``--real_compute``). Horovod by the same rule as HetPipe: a rank's
  threads that run TensorFlow's kernels (its compute and its update) in its device's node's group,
  its Python and the all-reduce (Horovod's and Gloo's threads) outside
  (``train_horovod.py --kernel_thread_groups``; cgroup v1, whose ``tasks`` file takes threads;
  under v2 the whole rank, started in the group by
  :func:`hetpipe_tf.distributed.cgroups.rank_command`). MWMS, whose collectives run on
  TensorFlow's own threads, has each rank's whole process in its group from its first
  instruction. The asymmetry left: a HetPipe worker task's whole process is in its group, its
  gRPC serving of the remote calls too, while a Horovod rank's communication is outside; it
  favours Horovod. The groups are this process's, of the same quotas and period as a HetPipe run's
  nodes, removed after the run.

Bounds (:func:`bound`): what the measured speeds allow at D = 0, a step's or a wave's workers all
waiting for the slowest: n workers x batch / the slowest stage's forward and backward time on
its device, that is its host time over the device's measured speed. One host time for every
system: the whole model's forward and backward pass as one function, unconstrained (the
``free_seconds`` the speeds were measured against); an all-reduce rank is one stage of the whole
model, so its bound is n x batch x min(speed) / that time; a HetPipe stage takes its segments'
share of it by the profile (the profile times each segment as a call of its own, so its sum over
a stage overstates a stage's one call: it fixes the shares, not the time). Communication and the
runtime's own work add to every system's time; each row says the share of its bound it reached,
and a HetPipe row also the simulator's prediction on the same speeds.
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import comparison  # noqa: E402

CLUSTER = "paper_quota"
#: Each node's speed must be within this of its quota's share (node_speed's definitions).
SPEED_TOLERANCE = 0.15
#: Targets: the best HetPipe policy and Horovod each at this share of their bound, and the best
#: policy at TARGET_OVER_HOROVOD x Horovod's images/s.
TARGET_SHARE, TARGET_OVER_HOROVOD = 0.85, 1.3
LABEL = "real compute, CPU-quota nodes"


def cluster():
    """The preset's :class:`hetpipe_tf.planning.cluster.Cluster`."""
    from hetpipe_tf.planning.cluster import load_cluster

    return load_cluster(CLUSTER)


def bound(stage_seconds, batch_size=comparison.BATCH_SIZE):
    """Examples/s the compute allows at D = 0: `stage_seconds[w][s]`, the forward plus backward
    seconds of worker w's stage s on its device (host time / measured speed); every worker goes
    at the slowest stage's pace, so len(stage_seconds) x batch_size / the slowest."""
    slowest = max(t for stages in stage_seconds for t in stages)
    return len(stage_seconds) * batch_size / slowest


def rank_types(quota_cluster):
    """The device type of every rank of an all-reduce baseline: one rank per device, node by node."""
    return [d.type.name for d in quota_cluster.devices()]


def allreduce_bound(whole_pass_s, speeds, types, batch_size=comparison.BATCH_SIZE):
    """The bound of ranks of `types` (one stage each, the whole model): n x batch x min(speed) /
    `whole_pass_s`, the whole model's forward and backward seconds on this host."""
    return bound([[whole_pass_s / speeds[t]] for t in types], batch_size)


def speed_row(speeds):
    """The speeds line: per type its QuotaSpeed's fields, speed, share and whether the speed is
    within SPEED_TOLERANCE of the share."""
    out = {}
    for name, s in speeds.items():
        ratio = s["speed"] / s["share"]
        out[name] = {**s, "speed_over_share": round(ratio, 3), "within_tolerance": abs(ratio - 1) <= SPEED_TOLERANCE}
    return {"node_speeds": out, "speed_tolerance": SPEED_TOLERANCE,
            "all_within_tolerance": all(v["within_tolerance"] for v in out.values())}


def _child_env():
    return dict(os.environ, PYTHONPATH=comparison.ROOT, TF_CPP_MIN_LOG_LEVEL="2")


def _child(kind, config, deadline_s):
    (row,) = comparison.child_rows([sys.executable, os.path.abspath(__file__), kind, json.dumps(config)], deadline_s,
                                   _child_env())
    return row


def failed_row(system, error):
    """The row of a system whose run failed: what failed, the end of its stderr (the others still run)."""
    return {"system": system, "failed": str(error)[-1500:]}


def measure_speeds(model, profile_path, seed=0, deadline_s=600):
    """Measures `model`'s profile and every quota type's speed (in a process of its own) and writes
    the profile with the types' times to `profile_path`; returns the speeds line (speed_row)."""
    return speed_row(_child("--speeds", {"model": model, "seed": seed, "profile_path": profile_path}, deadline_s))


def hetpipe_row(name, policy, placement, vw_size, epochs, profile_path, speeds, whole_pass_s, deadline_s=900, seed=0,
                num_in_flight=None, model="cnn"):
    """One HetPipe configuration on the quota nodes (launch "processes"), in a fresh process; its row.
    `speeds`: each type's measured speed; `whole_pass_s`: the whole model's pass on this host."""
    started = time.perf_counter()
    config = {"name": name, "policy": policy, "placement": placement, "vw_size": vw_size, "epochs": epochs,
              "seed": seed, "num_in_flight": num_in_flight, "profile_path": profile_path, "model": model,
              "speeds": speeds, "whole_pass_s": whole_pass_s}
    return {**_child("--hetpipe", config, deadline_s), "run_s": round(time.perf_counter() - started, 1)}


def baseline_argv(types, epochs, seed=0, model="cnn"):
    """The baselines' flags on the quota nodes: real compute, each rank's memory its device's."""
    from hetpipe_tf.planning.cluster import PRESETS

    memory = {name: t["memory"] for name, t in PRESETS[CLUSTER]["device_types"].items()}
    argv = ["--real_compute", f"--model={model}", f"--memory={','.join(memory[t] for t in types)}",
            f"--epochs={epochs}", "--warmup_epochs=1", f"--batch_size={comparison.BATCH_SIZE}", f"--seed={seed}"]
    return argv + ([f"--steps_per_epoch={comparison.MINIBATCHES_PER_EPOCH // len(types)}"] if model == "gpt" else [])


class NodeGroups:
    """This process's CPU-quota group of every node of the quota cluster (the quotas and period a
    HetPipe run's nodes get), for the ranks of a baseline; removed at the end of the block (and by
    a reaper if this process is killed)."""

    def __init__(self, quota_cluster):
        self.cluster = quota_cluster

    def __enter__(self):
        from hetpipe_tf.distributed.cgroups import CpuGroups, reap_orphans

        self.groups = CpuGroups()
        reap_orphans(self.groups.controller)
        self.reaper = self.groups.start_reaper()
        self.by_node = {n.name: self.groups.create(n.name, q) for n, q in zip(self.cluster.nodes,
                                                                               self.cluster.node_quotas())}
        return self

    def of_ranks(self):
        """The group of every rank (one per device, node by node)."""
        return [self.by_node[d.node] for d in self.cluster.devices()]

    def __exit__(self, *exc):
        self.groups.remove_all()
        self.reaper.kill()
        self.reaper.wait()


def baseline_row(system, epochs, whole_pass_s, speeds, deadline_s=900, seed=0, model="cnn"):
    """Horovod (`system` "Horovod": each rank's kernel threads in its node's group under cgroup v1,
    the whole rank under v2) or MWMS ("MWMS": each whole rank in its node's group); its row
    with its bound, or a row saying why it could not run."""
    from hetpipe_tf.distributed.cgroups import rank_command
    from benchmarks.baselines import horovod_run, mwms

    quota_cluster = cluster()
    types = rank_types(quota_cluster)
    if system == "Horovod" and horovod_run.missing():
        return {"system": system, "skipped": horovod_run.missing()}
    argv = baseline_argv(types, epochs, seed, model)
    started = time.perf_counter()
    with NodeGroups(quota_cluster) as groups:
        ranks = groups.of_ranks()
        threads = groups.groups.controller.version == 1
        in_group = "whole rank"
        if system == "Horovod" and threads:
            in_group = "kernel threads"
            line = horovod_run.run(len(types), [*argv, f"--kernel_thread_groups={','.join(g.path for g in ranks)}"],
                                   deadline_s)
        elif system == "Horovod":
            line = horovod_run.run(len(types), argv, deadline_s,
                                   wrap=lambda cmd: rank_command(ranks, cmd, "HOROVOD_RANK"))
        else:
            line = mwms.run([f"--workers={len(types)}", f"--deadline_s={deadline_s:g}", *argv],
                            wrap=lambda rank, cmd: ranks[rank].command(cmd))
    admitted = [types[i] for i in range(len(types)) if not any(f"rank {i} left out" in x for x in line["left_out"])]
    keep = ("ranks", "ranks_started", "left_out", "images_per_s", "tokens_per_s", "emulated", "compute_ms_per_step",
            "compute_share_of_wall", "host_cpu_busy", "epoch_wall_s")
    b = allreduce_bound(whole_pass_s, speeds, admitted)
    own = bound([[ms / 1e3] for ms in line["compute_ms_per_step"]])
    return {"system": system, "processes": line["ranks_started"], "rank_types": admitted, "in_group": in_group,
            **{k: line[k] for k in keep if k in line}, "bound_images_per_s": round(b, 2),
            "share_of_bound": comparison.ratio(line["images_per_s"], b),
            "bound_by_its_own_compute": round(own, 2), "run_s": round(time.perf_counter() - started, 1)}


def quiet():
    """Whether the machine's other processes were held at a low priority for the run (the notes'
    quiet_run helper: a cpu group named in HETPIPE_QUIET_GROUP), and how many, with the load average."""
    group = os.environ.get("HETPIPE_QUIET_GROUP")
    held = None
    if group:
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                held = len(f.read().split())
        except OSError:
            held = None
    return {"others_at_low_priority": held is not None, "others_held": held,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def summary(rows, speeds):
    """The best HetPipe row (by images/s) and Horovod's against their bounds and the targets, and
    whether every node's speed was within SPEED_TOLERANCE of its share."""
    hetpipe = [r for r in rows if r["system"].startswith("HetPipe") and r.get("images_per_s")]
    best = max(hetpipe, key=lambda r: r["images_per_s"], default=None)
    horovod = next((r for r in rows if r["system"] == "Horovod" and r.get("images_per_s")), None)
    best_share = best["share_of_bound"] if best else None
    horovod_share = horovod["share_of_bound"] if horovod else None
    over = comparison.ratio(best and best["images_per_s"], horovod and horovod["images_per_s"])

    def short(value, target):
        return None if value is None else round(max(0.0, target - value), 3)

    return {"summary": True, "label": LABEL, "emulated": False, "best_policy": best["system"] if best else None,
            "best_images_per_s": best["images_per_s"] if best else None, "best_share_of_bound": best_share,
            "best_over_horovod": over, "horovod_share_of_bound": horovod_share,
            "target_share": TARGET_SHARE, "target_over_horovod": TARGET_OVER_HOROVOD,
            "best_share_met": bool(best_share is not None and best_share >= TARGET_SHARE),
            "best_over_horovod_met": bool(over is not None and over >= TARGET_OVER_HOROVOD),
            "horovod_share_met": bool(horovod_share is not None and horovod_share >= TARGET_SHARE),
            "short": {"best_share": short(best_share, TARGET_SHARE), "best_over_horovod": short(over, TARGET_OVER_HOROVOD),
                      "horovod_share": short(horovod_share, TARGET_SHARE)},
            "node_speeds_within_tolerance": speeds["all_within_tolerance"],
            "ceiling_over_horovod": round(ceiling(speeds), 3)}


def ceiling(speeds):
    """What an ideal heterogeneous pipeline gains over data parallelism on the measured speeds:
    sum of the devices' speeds over (devices x the slowest)."""
    per_device = [speeds["node_speeds"][t]["speed"] for t in rank_types(cluster())]
    return sum(per_device) / (len(per_device) * min(per_device))


# Children ----------------------------------------------------------------------------------------
def _speeds_child(config):
    """Measures the profile (one intra-op thread, unconstrained) and the quota types' speeds; writes
    the profile with their times; prints the speeds."""
    import dataclasses

    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    from hetpipe_tf.distributed.node_speed import measure_quota_speeds, quota_profile
    from hetpipe_tf.runtime.profiler import measure_profile

    train, model, loss, _ = comparison.task(config["model"], config["seed"])
    optimizer = keras.optimizers.SGD(0.1)
    sample = next(iter(train))
    profile = measure_profile(model, comparison.BATCH_SIZE, loss=loss, optimizer=optimizer, sample=sample,
                              cache_dir=None)
    speeds = measure_quota_speeds(model, sample, cluster(), loss=loss)
    with open(config["profile_path"], "w") as f:
        f.write(quota_profile(profile, speeds).to_json())
    whole = sum(profile.times["host"].pass_seconds(0, profile.num_segments))
    print(comparison.MARK + json.dumps({
        name: {**dataclasses.asdict(s), "speed": round(s.speed, 4), "share": round(s.share, 4),
               "profile_whole_pass_ms": round(whole * 1e3, 3)} for name, s in speeds.items()}), flush=True)


def _hetpipe_child(config):
    """Runs one HetPipe configuration on the quota nodes in this process (the chief); prints its row."""
    import keras

    from hetpipe_tf import HetPipeStrategy
    from hetpipe_tf.data import addition
    from hetpipe_tf.planning.planner import PlanError, simulate_plan
    from benchmarks.baselines import ranks

    strategy = HetPipeStrategy(cluster=CLUSTER, policy=config["policy"], placement=config["placement"],
                               vw_size=config["vw_size"], staleness_bound=0, launch="processes",
                               num_in_flight=config["num_in_flight"], timeout_s=300, profile=config["profile_path"])
    with strategy.scope():
        train, model, loss, metrics = comparison.task(config["model"], config["seed"])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=metrics)
    seconds, host = [], ranks.emulation.HostCpu()

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                host.start()
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.t0)

    trace_path = os.path.join(os.path.dirname(config["profile_path"]), f"trace-{os.getpid()}.json")
    system = f"HetPipe {config['name']}"
    try:
        model.fit(train, epochs=config["epochs"], callbacks=[Clock()], verbose=0, trace_path=trace_path)
    except PlanError as e:  # a Nm that some worker's memory does not admit
        print(comparison.MARK + json.dumps({"system": system, "policy": config["policy"],
                                            "num_in_flight": config["num_in_flight"], "does_not_fit": str(e)}))
        return
    plan = strategy.plan
    speeds = [[config["speeds"][d.type.name] for d in w.devices] for w in plan.workers]
    whole = sum(plan.profile.times["host"].pass_seconds(0, plan.profile.num_segments))
    stage_s = [[(f + b) / whole * config["whole_pass_s"] / v for (f, b), v in zip(plan.host_pass_seconds(w), speeds[w])]
               for w in range(len(plan.workers))]
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(trace_path)
    images_per_s = ranks.images_per_second(int(train.cardinality()) * comparison.BATCH_SIZE, seconds, 1)
    b = bound(stage_s)
    predicted = simulate_plan(plan)["images_per_s"]
    wall = [round(sum(seconds[:i + 1]), 3) for i in range(len(seconds))]
    row = {"system": system, "launch": "processes", "policy": config["policy"], "placement": plan.placement,
           "processes": len(plan.workers), "virtual_workers": [w.device_types for w in plan.workers],
           "num_in_flight": plan.num_in_flight, "images_per_s": round(images_per_s, 2), "emulated": False,
           "stage_ms_at_measured_speed": [[round(1e3 * t, 2) for t in w] for w in stage_s],
           "bound_images_per_s": round(b, 2), "share_of_bound": comparison.ratio(images_per_s, b),
           "predicted_images_per_s": round(predicted, 2), "share_of_predicted": comparison.ratio(images_per_s, predicted),
           "stage_segments": [[list(s.segments) for s in w.partition.stages] for w in plan.workers],
           **comparison.trace_figures(events, speeds, 1.0),
           "worker_stats": [{k: round(v, 4) if isinstance(v, float) else v for k, v in st.items()}
                            for st in strategy.runner.stats()],
           "epoch_wall_s": wall, **ranks.host_fields(host.busy_fraction())}
    if config["model"] == "gpt":
        row["tokens_per_s"] = round(images_per_s * addition.SEQUENCE_LENGTH, 1)
    print(comparison.MARK + json.dumps(row), flush=True)


if __name__ == "__main__":
    {"--speeds": _speeds_child, "--hetpipe": _hetpipe_child}[sys.argv[1]](json.loads(sys.argv[2]))
