"""HetPipe against the all-reduce baselines on the same EMULATED devices, in one run:
the pieces that benchmarks/throughput_vs_horovod.py (Fig. 4) and benchmarks/whimpy_devices.py
(Table 4) share.

The devices: one emulated device per node, one node per device type (HetPipe §3: a node's
devices are of one type), with the types named as the paper's Table 1 (V, R, Q, G) and their
memories Table 1's in MiB instead of GiB (12, 24, 8, 6). Their speeds are the Fig. 4 example of benchmarks/README.md,
1, 0.67, 0.4 and 0.33 (slowdowns 3 / 4.5 / 7.5 / 9 at a dilation of 3), given in the order of
Table 1's peak FP32 (V and R, then G, then Q: V 1, R 0.67, G 0.4, Q 0.33, as
benchmarks/nm_sweep.py has them): the paper's relative speeds at this machine's scale are not
known, so this example stands in for them.

Every system emulates them with one time rule (:mod:`hetpipe_tf.pipeline.emulation`): a task of
a device of speed v takes max(actual, dilation / v x its solo time on this host), communication
(HetPipe's activations and parameter-server traffic, the baselines' all-reduce) is not padded.
Every system takes its solo times from ONE profile of the model (:mod:`hetpipe_tf.runtime.profiler`:
each segment's forward and backward time and a task's fixed cost, measured alone on a worker
task's CPU), which the first HetPipe run of the script measures (or reads from the profile
cache) and writes into the run's folder, and every later HetPipe run is given
(``HetPipeStrategy(profile=..., emulation_references="profile")``): a stage's reference is its
task cost plus its segments' times (:meth:`hetpipe_tf.planning.planner.Plan.host_pass_seconds`),
and the baselines' reference, a whole step, is the whole model's by the same profile
(:func:`whole_model_reference_ms`, given with ``--reference_ms``). So every system of a run
emulates the same devices: not solo times measured anew by each run and each stage, which the
load of the moment moves (on this shared machine one worker's stage references moved by up to
20 % between two runs of one configuration, and a row's bound with them). Each row gives the
bound its references set (:func:`bound_images_per_s`) and the share of it reached. One
dilation for every system of a run: the first HetPipe run calibrates it
(:func:`hetpipe_tf.pipeline.emulation.calibrate_dilation`: probes until fewer than 2.5 % of
tasks overran, then one step more) unless ``--dilation`` gives it; every row reports its own
overrun fraction and is faithful below 5 %.

HetPipe runs with ``launch="processes"`` (one process per virtual worker, a worker and a
parameter-server task per node), each configuration in a fresh process (a process joins one
cluster), which this module runs as ``python benchmarks/comparison.py --child=JSON``.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# name, relative speed, memory (Table 1's GiB as MiB), the paper's GPU it stands for
DEVICE_TYPES = (("V", 1.0, "12M", "TITAN V"), ("R", 0.6667, "24M", "TITAN RTX"),
                ("Q", 0.3333, "8M", "Quadro P4000"), ("G", 0.4, "6M", "GeForce RTX 2060"))
BATCH_SIZE = 32
MARK = "ROW "
#: Minibatches of BATCH_SIZE an epoch of every system trains, all devices together: the digits'
#: train split (1437 // 32); a `gpt` epoch takes as many of hetpipe_addition's sums.
MINIBATCHES_PER_EPOCH = 44


def arguments(doc, benchmark, calibrated_by, options=None, **switches):
    """The flags both comparison scripts take, parsed and checked; `calibrated_by` names the run
    that calibrates the dilation; `options` are a script's own valued flags (name: (default,
    help)), `switches` its own on/off flags (name: help), off unless given."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs of every run (the first is left out)")
    parser.add_argument("--dilation", type=float, default=None, help=f"default: calibrated by the {calibrated_by} run")
    parser.add_argument("--memory", default="", help="override device memories, e.g. G=4M (Horovod then "
                        "leaves G out: the whole cnn needs 4.9 MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline_s", type=float, default=900.0, help="of each system's run")
    parser.add_argument("--profile", default="", help="emulate every system's devices from this profile (the "
                        ".profile.json an earlier run wrote) instead of the one the first HetPipe run measures")
    parser.add_argument("--out", default=f"benchmarks/results/{benchmark}.jsonl")
    parser.add_argument("--png", default=f"benchmarks/results/{benchmark}.png")
    for name, (default, text) in (options or {}).items():
        parser.add_argument(f"--{name}", default=default, help=text)
    for name, text in switches.items():
        parser.add_argument(f"--{name}", action="store_true", help=text)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error(f"--epochs={args.epochs}: images/s leaves the first epoch out, give at least 2")
    try:
        args.memory = parse_memory(args.memory)
    except ValueError as e:
        parser.error(str(e))
    check_profile_flag(parser, args.profile)
    return args


def check_profile_flag(parser, profile):
    """A usage error when --profile names no file."""
    if profile and not os.path.isfile(profile):
        parser.error(f"--profile={profile!r} is no file; give the .profile.json of an earlier run, or leave it "
                     f"out to measure one")


def given_profile(path):
    """What a HetPipe run of a script is given: the run's profile at `path` once an earlier run wrote
    it, else None (the run measures one, and :func:`keep_profile` writes it there)."""
    return path if os.path.exists(path) else None


def keep_profile(path, plan):
    """Writes `plan`'s profile to `path` for the script's later runs and baselines, unless one is there."""
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(plan.profile.to_json())


def run_profile(args, folder):
    """Where this run's profile is (beside --out as .profile.json, else in `folder`), made ready:
    --profile's copied there, or none, for the first HetPipe run to write."""
    path = (os.path.splitext(args.out)[0] + ".profile.json") if args.out else os.path.join(folder, "profile.json")
    if args.profile:
        if os.path.abspath(args.profile) != os.path.abspath(path):
            shutil.copyfile(args.profile, path)
    elif os.path.exists(path):
        os.remove(path)  # an earlier run's
    return path


def emit(out, benchmark, **fields):
    """Prints one JSON line (``"benchmark": benchmark`` first) and writes it to `out` if given."""
    line = json.dumps({"benchmark": benchmark, **fields})
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def machine():
    """This host: logical CPUs, CPU model, load average now."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def device_types(types, memory=None):
    """The DEVICE_TYPES named by `types` (e.g. "VRQ"), in DEVICE_TYPES' order, with memories from
    `memory` ({name: "8M"}) where given."""
    known = {t[0]: t for t in DEVICE_TYPES}
    unknown = [t for t in types if t not in known]
    if unknown or not types or len(set(types)) != len(types):
        raise ValueError(f"device types {types!r}: give each of {''.join(known)} at most once, e.g. 'VRQG'")
    memory = memory or {}
    return tuple((name, speed, memory.get(name, mem), label) for name, speed, mem, label in DEVICE_TYPES
                 if name in types)


def parse_memory(text):
    """--memory='G=4M,Q=6M' as {"G": "4M", "Q": "6M"}."""
    out = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, _, size = item.partition("=")
        if name not in {t[0] for t in DEVICE_TYPES} or not size:
            raise ValueError(f"--memory item {item!r}: write TYPE=SIZE with TYPE one of "
                             f"{''.join(t[0] for t in DEVICE_TYPES)}, e.g. G=4M")
        out[name] = size
    return out


def cluster_spec(types):
    """The HetPipe cluster description of `types` (from :func:`device_types`): one node of one
    device per type, joined by host-memory links (the ``local`` preset's)."""
    return {"name": "emulated-" + "".join(t[0] for t in types),
            "device_types": {name: {"label": f"emulated {label} (speed {speed:g})", "emulated_speed": speed,
                                    "memory": mem} for name, speed, mem, label in types},
            "nodes": [{"name": f"node-{name}", "device_type": name, "count": 1} for name, *_ in types],
            "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0}}


def whole_model_reference_ms(profile_path):
    """The baselines' reference (ms): a whole step's forward and backward pass, one task each, by
    the run's profile (the one HetPipe's rows emulate their stages from)."""
    from hetpipe_tf.planning.profile import Profile

    with open(profile_path) as f:
        profile = Profile.from_json(f.read())
    return 1e3 * sum(profile.times["host"].pass_seconds(0, profile.num_segments))


def bound_images_per_s(pass_ms, speeds, dilation, batch_size=BATCH_SIZE):
    """What emulated devices allow a system at D = 0: `pass_ms[w][s]`, the reference (ms) of a
    forward plus backward pass of worker w's stage s (a baseline's rank: one stage, the whole
    model), `speeds[w][s]` its device's. Each worker goes at its slowest stage's pace, dilation /
    speed x reference, and every worker at the slowest worker's (D = 0: a wave, or a step, waits
    for all), so n workers x batch / that time. Communication and the host's work add to it."""
    slowest = max(dilation / v * t for ts, vs in zip(pass_ms, speeds) for t, v in zip(ts, vs)) / 1e3
    return len(pass_ms) * batch_size / slowest


def _share(images_per_s, bound):
    return round(images_per_s / bound, 3) if images_per_s and bound else None


def _baseline_common(line, system):
    keep = ("ranks", "ranks_started", "speeds", "left_out", "images_per_s", "tokens_per_s", "reference_ms", "emulated", "dilation",
            "paced_tasks", "overran_tasks", "overrun_fraction", "emulation_faithful", "host_cpu_busy",
            "host_saturated", "epoch_wall_s")
    row = {"system": system, "processes": line["ranks_started"], **{k: line[k] for k in keep if k in line}}
    if line.get("speeds") and line.get("reference_ms"):
        bound = bound_images_per_s([[line["reference_ms"]]] * len(line["speeds"]), [[v] for v in line["speeds"]],
                                   line["dilation"])
        row.update(bound_images_per_s=round(bound, 2), share_of_bound=_share(line.get("images_per_s"), bound))
    return row


def baseline_argv(types, dilation, reference_ms, epochs, seed=0, model="cnn"):
    """The baselines' flags for `types` (one rank per device) at this dilation and reference
    (`gpt`: MINIBATCHES_PER_EPOCH an epoch over the ranks, as the digits' split gives the cnn)."""
    argv = [f"--model={model}", f"--speeds={','.join(f'{t[1]:g}' for t in types)}",
            f"--memory={','.join(t[2] for t in types)}", f"--dilation={dilation:g}",
            f"--reference_ms={reference_ms:.3f}", f"--epochs={epochs}", "--warmup_epochs=1",
            f"--batch_size={BATCH_SIZE}", f"--seed={seed}"]
    return argv + ([f"--steps_per_epoch={MINIBATCHES_PER_EPOCH // len(types)}"] if model == "gpt" else [])


def horovod_row(types, dilation, reference_ms, epochs, deadline_s=900, seed=0, model="cnn"):
    """Horovod (horovodrun --gloo, one rank per device; too small ones left out by the leave-out
    rule) on `types`: its row, or a row saying why it could not run."""
    from benchmarks.baselines import horovod_run

    reason = horovod_run.missing()
    if reason:
        return {"system": "Horovod", "skipped": reason}
    started = time.perf_counter()
    line = horovod_run.run(len(types), baseline_argv(types, dilation, reference_ms, epochs, seed, model), deadline_s)
    return {**_baseline_common(line, "Horovod"), "run_s": round(time.perf_counter() - started, 1)}


def mwms_row(types, dilation, reference_ms, epochs, deadline_s=900, seed=0, model="cnn"):
    """TensorFlow's MultiWorkerMirroredStrategy on `types`, as :func:`horovod_row`."""
    from benchmarks.baselines import mwms

    started = time.perf_counter()
    line = mwms.run([f"--workers={len(types)}", f"--deadline_s={deadline_s:g}",
                     *baseline_argv(types, dilation, reference_ms, epochs, seed, model)])
    return {**_baseline_common(line, "MWMS"), "run_s": round(time.perf_counter() - started, 1)}


def child_rows(argv, deadline_s, env=None):
    """Runs `argv` (a script's child mode) in a process of its own; the rows it printed after MARK."""
    from benchmarks.baselines import processes

    (stdout,) = processes.run_all([argv], deadline_s, None if env is None else [env])
    return [json.loads(line[len(MARK):]) for line in stdout.splitlines() if line.startswith(MARK)]


def hetpipe_row(name, types, policy, placement, dilation, epochs, profile_path, vw_size=None, deadline_s=900,
                seed=0, launch="processes", num_in_flight=None, model="cnn"):
    """One HetPipe configuration on `types` in a fresh process (with launch "processes", one
    process per virtual worker under it; "in_process": every stage in that process, a figure to
    stand beside, never instead); `dilation` None: calibrated by that run; `num_in_flight` None:
    the planner's Nm; `model` ``cnn`` (the digits) or ``gpt`` (hetpipe_addition's sums). Its
    stages are emulated from the profile at `profile_path`, which the run writes when there is
    none yet (the first of a script's runs). Returns its row."""
    started = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    with tempfile.TemporaryDirectory(prefix="hetpipe-comparison-") as folder:
        config = {"name": name, "cluster": cluster_spec(types), "policy": policy, "placement": placement,
                  "vw_size": vw_size, "dilation": dilation, "epochs": epochs, "seed": seed, "trace_dir": folder,
                  "launch": launch, "num_in_flight": num_in_flight, "profile_path": profile_path, "model": model}
        (row,) = child_rows([sys.executable, os.path.abspath(__file__), f"--child={json.dumps(config)}"], deadline_s,
                            env)
    return {**row, "run_s": round(time.perf_counter() - started, 1)}


def trace_figures(events, speeds, dilation):
    """From a run's trace (Chrome trace events; pid: virtual worker, tid: stage), per worker and
    stage: the reference (ms) its forward plus backward pass was paced to, as the trace shows it,
    (shortest Forward span + shortest Backward span) x speed / dilation (a paced task lasts at
    least its target, so the shortest shows it; it is the profile's reference unless every task of
    the stage overran), and its busy fraction:
    time in Forward and Backward spans over the worker's traced time. `speeds[w][s]` is the
    speed of worker w's stage s (workers in the order of their pids)."""
    spans = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("Forward", "Backward"):
            spans.setdefault(e["pid"], {}).setdefault(e["tid"], []).append(e)
    if len(spans) != len(speeds):
        raise ValueError(f"the trace has compute spans of {len(spans)} virtual workers, the plan {len(speeds)}")
    traced, busy = [], []
    for (pid, stages), worker_speeds in zip(sorted(spans.items()), speeds):
        every = [e for stage in stages.values() for e in stage]
        wall = max(e["ts"] + e["dur"] for e in every) - min(e["ts"] for e in every)
        traced.append([round(sum(min(e["dur"] for e in stages[s] if e["cat"] == kind)
                                 for kind in ("Forward", "Backward")) / 1e3 * worker_speeds[s] / dilation, 3)
                       for s in sorted(stages)])
        busy.append([round(sum(e["dur"] for e in stages[s]) / wall, 3) for s in sorted(stages)])
    return {"traced_stage_reference_ms": traced, "stage_busy_fraction": busy}


def task(model, seed):
    """(train data, built model, loss, metrics) of `model` for a HetPipe run: the ``cnn`` on the
    digits' train split, or the ``gpt`` on MINIBATCHES_PER_EPOCH minibatches of hetpipe_addition's
    sums (the baselines' losses: :mod:`benchmarks.baselines.training`)."""
    import keras

    from hetpipe_tf.cli.models import build_model
    from hetpipe_tf.data import addition, datasets

    if model == "gpt":
        train = datasets.load_token_sequences(addition.NAME, "train", batch_size=BATCH_SIZE, shuffle=True,
                                              seed=seed).take(MINIBATCHES_PER_EPOCH)
        keras.utils.set_random_seed(seed)
        return (train, build_model("gpt", (addition.SEQUENCE_LENGTH,), len(addition.VOCABULARY)), addition.loss(),
                [addition.exact_match])
    train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=BATCH_SIZE, shuffle=True,
                                               seed=seed)
    keras.utils.set_random_seed(seed)
    return (train, build_model("cnn", tuple(train.element_spec[0].shape[1:]),
                               datasets.dataset_info("hetpipe_digits").num_classes),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])


def _hetpipe_child(config):
    """Runs one HetPipe configuration in this process (the chief) and prints its row."""
    import keras

    from hetpipe_tf import HetPipeStrategy
    from hetpipe_tf.data import addition
    from hetpipe_tf.planning.planner import PlanError, simulate_plan
    from benchmarks.baselines import ranks

    given = given_profile(config["profile_path"])
    strategy = HetPipeStrategy(cluster=config["cluster"], policy=config["policy"], placement=config["placement"],
                               vw_size=config["vw_size"], staleness_bound=0, launch=config["launch"],
                               num_in_flight=config["num_in_flight"], dilation=config["dilation"], timeout_s=300,
                               profile=given, emulation_references="profile")
    with strategy.scope():
        train, model, loss, metrics = task(config["model"], config["seed"])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=metrics)
    seconds, host = [], ranks.emulation.HostCpu()

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:  # the epochs images/s counts
                host.start()
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.t0)

    trace_path = os.path.join(config["trace_dir"], "trace.json")
    try:
        model.fit(train, epochs=config["epochs"], callbacks=[Clock()], verbose=0, trace_path=trace_path)
    except PlanError as e:  # a Nm asked for that some worker's memory does not admit
        print(MARK + json.dumps({"system": f"HetPipe {config['name']}", "launch": config["launch"],
                                 "policy": config["policy"], "num_in_flight": config["num_in_flight"],
                                 "does_not_fit": str(e)}), flush=True)
        return
    plan = strategy.plan
    keep_profile(config["profile_path"], plan)
    predicted = simulate_plan(plan)  # at dilation 1 unless one was given (the planner's rule)
    workers = [{k: round(v, 4) if isinstance(v, float) else v for k, v in st.items()}
               for st in strategy.runner.stats()]
    images_per_epoch = int(train.cardinality()) * BATCH_SIZE
    report = strategy.runner.emulation_report().as_dict()
    plan_dilation = config["dilation"] or 1.0
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    wall, elapsed = [], 0.0
    for s in seconds:
        elapsed += s
        wall.append(round(elapsed, 3))
    speeds = [[d.type.emulated_speed for d in w.devices] for w in plan.workers]
    pass_ms = [[1e3 * (f + b) for f, b in plan.host_pass_seconds(w)] for w in range(len(plan.workers))]
    images_per_s = ranks.images_per_second(images_per_epoch, seconds, 1)
    bound = bound_images_per_s(pass_ms, speeds, report["dilation"])
    row = {"system": f"HetPipe {config['name']}", "launch": config["launch"], "policy": config["policy"],
           "placement": plan.placement,
           "processes": len(plan.workers), "virtual_workers": [w.device_types for w in plan.workers],
           "num_in_flight": plan.num_in_flight, "concurrent_minibatches": plan.num_in_flight * len(plan.workers),
           "images_per_s": round(images_per_s, 2), "emulation_references": "profile",
           "profile_stage_reference_ms": [[round(t, 3) for t in w] for w in pass_ms],
           "bound_images_per_s": round(bound, 2), "share_of_bound": _share(images_per_s, bound),
           "planned_at_dilation": plan_dilation,
           "predicted_images_per_s": round(predicted["images_per_s"] * plan_dilation / report["dilation"], 2),
           "predicted_busy_fraction": [[round(b, 3) for b in w["busy_fraction"]] for w in predicted["virtual_workers"]],
           "stage_segments": [[list(s.segments) for s in w.partition.stages] for w in plan.workers],
           **trace_figures(events, speeds, report["dilation"]),
           "worker_stats": workers, "epoch_wall_s": wall, **report, **ranks.host_fields(host.busy_fraction())}
    if config["model"] == "gpt":
        row["tokens_per_s"] = round(images_per_s * addition.SEQUENCE_LENGTH, 1)
    print(MARK + json.dumps(row), flush=True)


def ratio(numerator, denominator):
    """numerator / denominator images/s, rounded, or None when either is missing."""
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


def bar_plot(rows, path, title, label=lambda r: r["system"], unit="images/s", devices="EMULATED devices"):
    """Bars of images/s (examples of another `unit`), one per row, each labelled with its overrun
    fraction (and NOT faithful where it was not), or, for rows of real compute (``"emulated":
    false``), the share of its bound; `devices` says what ran (the axis and the file's metadata)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in rows if r.get("images_per_s")]
    fig = Figure(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = ["tab:grey" if not r["system"].startswith("HetPipe") else "tab:blue" for r in rows]
    bars = ax.bar(range(len(rows)), [r["images_per_s"] for r in rows], color=colours)
    for bar, r in zip(bars, rows):
        if r.get("emulated") is False:
            share = r.get("share_of_bound")
            note = f"{r['images_per_s']:.0f}" + ("" if share is None else f"\n{share:.0%} of bound")
        else:
            note = f"{r['images_per_s']:.0f}\noverrun {r['overrun_fraction']:.1%}"
        if r.get("emulated") is not False and not r["emulation_faithful"]:
            note += "\nNOT faithful"
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([label(r) for r in rows], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel(f"{unit} ({devices})")
    ax.set_ylim(0, 1.25 * max([r["images_per_s"] for r in rows] or [1]))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130, metadata={"Title": title, "Description": devices})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one HetPipe configuration (run by the comparison scripts)")
    parser.add_argument("--child", required=True, help="the configuration as JSON")
    _hetpipe_child(json.loads(parser.parse_args().child))
