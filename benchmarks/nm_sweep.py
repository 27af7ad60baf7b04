"""One virtual worker's throughput as Nm grows, per allocation policy (HetPipe Fig. 3), MEASURED on EMULATED devices.

The cluster is Fig. 4's four device types, EMULATED on this host: V, R, G and Q of speed
1, 0.67, 0.4 and 0.33 relative to this host running a task alone, with memory in the
paper's proportions (Table 1: 12, 24, 6 and 8 GB, here 48, 96, 24 and 32 MiB), four of each
type on a node of their own. The allocation policies (§8.1: NP a node per virtual worker,
ED one device of every node per worker, HD two node types per worker, balanced in compute
and memory) group the 16 devices into 4 virtual workers; as in Fig. 3, each distinct
virtual worker they make is measured alone: NP's VVVV, RRRR, GGGG and QQQQ, ED's VRGQ and
HD's two (VVQQ and RRGG here, as in the paper's Table 3).

Each virtual worker is the ``cnn`` of the CLI's model zoo on the bundled digits (minibatches
of 32, plain SGD), cut into 4 stages by the planner (§7's partitioner, for that Nm) and
trained in this process with HetPipe's schedule (§4) for ``--steps`` minibatches per run at
Nm = 1 .. ``--max_nm`` (default k + 1 = 5). Every stage's task is padded to
dilation / speed x its own solo time (``hetpipe_tf.pipeline.emulation``), measured once per
cut for the whole run (a solo time on this host does not depend on the emulated device: an
earlier version measured it per worker, and the load of the moment made NP's GGGG, speed
0.4, slower at Nm = 1 than its QQQQ, speed 0.33); one dilation for
every worker, calibrated in the same run on the fastest worker (NP's VVVV) at the largest
Nm, whose stages have the shortest targets and are the busiest (the runners' rule: one step
above the first candidate whose probe overran on fewer than 2.5 % of its tasks; candidates
from 6, as runs beside other jobs on this 2-core machine overran 5-55 % at the 4 and 6 that
probes at 3 and 4 chose). When a worker's sweep still has a row that overran on 5 % of its
tasks or more (the machine's load changes), that worker's sweep runs again at the next
dilation (``--retries`` times at most); each row says its dilation. Normalised throughput
compares a worker with itself at one dilation; absolute images/s compare across workers
only at equal dilations. The configurations of a virtual worker run interleaved, ``--rounds`` rounds, and
each figure is the median over the rounds.

Per row (one virtual worker, one Nm): measured images/s over the whole run (fill and drain
included), normalised to the same worker's Nm = 1 (Fig. 3's y axis; its Nm = 1 images/s is
the number in the paper's boxes), every stage's busy fraction (the time it ran tasks over
the run's wall time, from the executor's report; Fig. 3's "maximum average GPU utilization
among partitions" is the largest), the simulator's prediction of the same schedule from the
measured stage times and the planner's prediction from the profile beside it (predictions
only; the measured figure is the result), ``emulated: true``, the worst round's overrun
fraction and whether the emulation was faithful (fewer than 5 % of paced tasks overran).

    python benchmarks/nm_sweep.py [--steps=20] [--rounds=2] [--retries=1] [--max_nm=5] [--policies=np,ed,hd]
        [--out=benchmarks/results/nm_sweep.jsonl] [--png=benchmarks/results/nm_sweep.png]
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.comparison import emit  # noqa: E402

# The comparison's emulated 4-type cluster: speeds 1, 0.67, 0.4, 0.33; memory in Table 1's proportions.
DEVICE_TYPES = {"V": (1.0, "48M"), "R": (0.67, "96M"), "G": (0.4, "24M"), "Q": (0.33, "32M")}
POLICIES = ("np", "ed", "hd")
BATCH = 32
DILATIONS = (6, 8, 12, 16, 24, 32)


def _emit(out, **fields):
    emit(out, "nm_sweep", **fields)


def cluster_spec():
    """The comparison's cluster as a cluster file's dict: 4 nodes of 4 emulated devices of one type each."""
    return {"name": "issue13-emulated",
            "device_types": {t: {"label": f"emulated {t}", "emulated_speed": v, "memory": m}
                             for t, (v, m) in DEVICE_TYPES.items()},
            "nodes": [{"name": f"node-{t}", "device_type": t, "count": 4} for t in DEVICE_TYPES],
            "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0}}


def distinct_workers(cluster, policy):
    """(label, devices) of each distinct virtual worker `policy` makes of `cluster` (one per
    multiset of device types, in allocation order), as Fig. 3 shows each once."""
    from hetpipe_tf.planning.allocation import allocate

    seen, out = set(), []
    for worker in allocate(cluster, policy):
        types = "".join(sorted((d.type.name for d in worker), key=list(DEVICE_TYPES).index))
        if types not in seen:
            seen.add(types)
            out.append((f"{policy.upper()} {types}", tuple(worker)))
    return out


def normalise(rows):
    """Adds each row's images/s over its worker's Nm = 1 row (``normalised_throughput``)."""
    base = {r["worker"]: r["images_per_s"] for r in rows if r["num_in_flight"] == 1}
    for r in rows:
        r["normalised_throughput"] = round(r["images_per_s"] / base[r["worker"]], 3) if r["worker"] in base else None
    return rows


def next_dilation(dilation):
    """The next larger of DILATIONS (or 1.5x the largest): a sweep's retry when a row overran."""
    return next((d for d in DILATIONS if d > dilation), dilation * 1.5)


def _spec(device):
    from hetpipe_tf.planning.devices import DeviceSpec

    return DeviceSpec("emulated", speed=device.type.emulated_speed, memory=device.type.memory)


def build_workers(keras, model, profile, cluster, devices, nms, dilation, data, references):
    """One VirtualWorker per Nm for the virtual worker `devices`, cut by the planner for that Nm.
    `references` (cut -> the stages' solo times on this host, filled as cuts are first built)
    is shared by every worker of a run: a solo time does not depend on the emulated device, so
    workers of one cut are paced from one measurement, not from several that the load of the
    moment moves apart. Returns {Nm: (VirtualWorker, the planner's predicted minibatches/s)}."""
    from hetpipe_tf.planning.planner import plan
    from hetpipe_tf.planning.request import PlanRequest
    from hetpipe_tf.runtime.virtual_worker import VirtualWorker

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    built = {}
    for nm in nms:
        p = plan(profile, cluster, PlanRequest(workers=[devices], num_in_flight=nm, dilation=dilation))
        order, cut = p.workers[0].devices, p.node_boundaries(0)
        vw = VirtualWorker(model, [_spec(d) for d in order], num_in_flight=nm, boundaries=cut, dilation=dilation,
                           optimizer=keras.optimizers.SGD(0.05), loss=loss)
        vw.references = references.get(cut)
        vw.train(iter(data[:2]), 2)  # build, trace and (first of a cut only) measure the solo times
        references[cut] = vw.references
        built[nm] = (vw, p.minibatches_per_s)
    return built


def measure(vw, data):
    """One measured run of `vw` on `data`: its figures."""
    from hetpipe_tf.pipeline.simulator import simulate

    n = len(data)
    report = vw.train(iter(data), n)

    def duration(stage, ins):
        return vw.task_seconds(stage, type(ins)) if type(ins) in vw.references[stage] else 0.0

    return {"images_per_s": report.minibatches_per_s * BATCH,
            "simulated_images_per_s": simulate(vw.schedule(n), duration).throughput * BATCH,
            "busy_fraction": report.busy_fraction(), "overrun_fraction": report.emulation.overrun_fraction,
            "overran_tasks": report.emulation.overran, "paced_tasks": report.emulation.tasks}


def sweep(label, built, data, rounds, dilation):
    """Runs every Nm of one virtual worker `rounds` times, interleaved; one row per Nm."""
    from hetpipe_tf.pipeline.emulation import FAITHFUL_OVERRUN

    runs = {nm: [] for nm in built}
    for _ in range(rounds):
        for nm, (vw, _) in built.items():
            runs[nm].append(measure(vw, data))
    rows = []
    for nm, rs in runs.items():
        vw, planned = built[nm]
        busy = [statistics.median(r["busy_fraction"][s] for r in rs) for s in range(vw.num_stages)]
        worst = max(r["overrun_fraction"] for r in rs)
        rows.append({"worker": label, "devices": [f"{d.speed:g}" for d in vw.device_specs], "num_in_flight": nm,
                     "steps": len(data), "rounds": rounds,
                     "images_per_s": round(statistics.median(r["images_per_s"] for r in rs), 2),
                     "images_per_s_per_round": [round(r["images_per_s"], 2) for r in rs],
                     "busy_fraction": [round(b, 3) for b in busy], "max_busy_fraction": round(max(busy), 3),
                     "simulated_images_per_s": round(statistics.median(r["simulated_images_per_s"] for r in rs), 2),
                     "planner_images_per_s": round(planned * BATCH, 2),
                     "boundaries": list(vw.staged.boundaries),
                     "emulated": True, "dilation": dilation, "overrun_fraction": round(worst, 4),
                     "overran_tasks": sum(r["overran_tasks"] for r in rs),
                     "paced_tasks": sum(r["paced_tasks"] for r in rs), "emulation_faithful": worst < FAITHFUL_OVERRUN})
    return normalise(rows)


def plot(rows, path, title):
    """Fig. 3's two panels per policy: normalised throughput (measured, and the simulator's
    prediction dotted) and the largest stage busy fraction, against Nm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    policies = list(dict.fromkeys(r["worker"].split()[0] for r in rows))
    fig = Figure(figsize=(4 * len(policies), 6.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(policies), squeeze=False)
    for col, policy in enumerate(policies):
        top, bottom = axes[0][col], axes[1][col]
        workers = list(dict.fromkeys(r["worker"] for r in rows if r["worker"].split()[0] == policy))
        for worker in workers:
            rs = sorted((r for r in rows if r["worker"] == worker), key=lambda r: r["num_in_flight"])
            nms = [r["num_in_flight"] for r in rs]
            base = next((r for r in rs if r["num_in_flight"] == 1), rs[0])
            faithful = "" if all(r["emulation_faithful"] for r in rs) else ", NOT faithful"
            line, = top.plot(nms, [r["normalised_throughput"] for r in rs], marker="o",
                             label=f"{worker.split()[1]} ({base['images_per_s']:.0f} img/s at Nm=1, "
                                   f"dilation {base['dilation']:g}{faithful})")
            top.plot(nms, [r["simulated_images_per_s"] / base["simulated_images_per_s"] for r in rs],
                     linestyle=":", color=line.get_color())
            bottom.plot(nms, [r["max_busy_fraction"] for r in rs], marker="s", color=line.get_color())
        top.set_title(f"{policy} (dotted: simulator)", fontsize=9)
        top.set_ylabel("throughput / throughput at Nm=1")
        top.legend(fontsize=7)
        bottom.set_ylim(0, 1.05)
        bottom.set_xlabel("Nm")
        bottom.set_ylabel("largest stage busy fraction")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="minibatches per measured run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max_nm", type=int, default=5, help="largest Nm (default k + 1)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--dilation", type=float, default=None, help="default: calibrated in this run")
    parser.add_argument("--retries", type=int, default=1, help="sweeps again at a larger dilation if a row overran")
    parser.add_argument("--out", default="benchmarks/results/nm_sweep.jsonl")
    parser.add_argument("--png", default="benchmarks/results/nm_sweep.png")
    args = parser.parse_args()
    policies = [p.strip().lower() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"--policies: unknown {unknown}; allowed: {', '.join(POLICIES)}")
    load, started = os.getloadavg(), time.perf_counter()

    import tensorflow as tf

    from hetpipe_tf.planning.devices import parse_devices
    from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices

    tf.config.threading.set_intra_op_parallelism_threads(1)
    configure_tensorflow_devices(parse_devices("1,1,1,1"))  # a logical CPU per stage, before TensorFlow starts
    import keras

    from hetpipe_tf.cli.models import build_model
    from hetpipe_tf.data import datasets
    from hetpipe_tf.pipeline.emulation import calibrate_dilation
    from hetpipe_tf.planning.cluster import from_dict
    from hetpipe_tf.runtime.profiler import measure_profile

    cluster = from_dict(cluster_spec())
    train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=BATCH, shuffle=True, seed=0)
    data = [(x.numpy(), y.numpy()) for x, y in train.take(args.steps)]
    keras.utils.set_random_seed(0)
    model = build_model("cnn", tuple(data[0][0].shape[1:]), 10)
    profile = measure_profile(model, BATCH, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              sample=data[0])
    nms = tuple(range(1, args.max_nm + 1))
    workers = [w for policy in policies for w in distinct_workers(cluster, policy)]
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out:
        dilation, references = args.dilation, {}
        if dilation is None:
            # Calibrated on the fastest worker at the largest Nm: the shortest targets, the busiest stages.
            label, devices = max(workers, key=lambda w: min(d.type.emulated_speed for d in w[1]))
            (probe, _), = build_workers(keras, model, profile, cluster, devices, (nms[-1],), 1.0, data,
                                        references).values()
            dilation, tried = calibrate_dilation(lambda d: probe.probe_emulation(data[0], d), candidates=DILATIONS)
            for d, overrun in tried:
                _emit(out, calibrating_dilation=d, on=f"{label} Nm={nms[-1]}", overrun_fraction=round(overrun, 4))
        _emit(out, setup={"cluster": cluster_spec(), "model": "cnn", "dataset": "hetpipe_digits", "batch_size": BATCH,
                          "schedule": "hetpipe", "steps": args.steps, "rounds": args.rounds, "num_in_flight": nms,
                          "dilation": dilation, "emulated": True, "in_process": True,
                          "load_average_at_start": [round(x, 2) for x in load]})
        rows = []
        for label, devices in workers:
            worker_dilation = dilation
            for attempt in range(args.retries + 1):
                built = build_workers(keras, model, profile, cluster, devices, nms, worker_dilation, data, references)
                swept = sweep(label, built, data, args.rounds, worker_dilation)
                unfaithful = [r["num_in_flight"] for r in swept if not r["emulation_faithful"]]
                if not unfaithful or attempt == args.retries:
                    break
                _emit(out, worker=label, dilation=worker_dilation, not_faithful_at_nm=unfaithful,
                      retried_at_dilation=next_dilation(worker_dilation))
                worker_dilation = next_dilation(worker_dilation)
            for row in swept:
                _emit(out, **row)
                rows.append(row)
        best = {w: max((r for r in rows if r["worker"] == w), key=lambda r: r["normalised_throughput"])
                for w in dict.fromkeys(r["worker"] for r in rows)}
        _emit(out, summary=True, emulated=True, dilation=dilation,
              dilation_per_worker={w: r["dilation"] for w, r in best.items()},
              all_faithful=all(r["emulation_faithful"] for r in rows),
              overrun_fraction_max=max(r["overrun_fraction"] for r in rows),
              best_nm={w: r["num_in_flight"] for w, r in best.items()},
              best_normalised_throughput={w: r["normalised_throughput"] for w, r in best.items()},
              run_wall_s=round(time.perf_counter() - started, 1))
    if args.png:
        plot(rows, args.png, f"one virtual worker, cnn on digits, 4 stages, EMULATED devices V/R/G/Q = "
                             f"1/0.67/0.4/0.33, dilation calibrated {dilation:g}, {args.steps} minibatches per run")


if __name__ == "__main__":
    main()
