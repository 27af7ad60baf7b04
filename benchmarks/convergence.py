"""Time to accuracy (HetPipe Fig. 5/6): Horovod against HetPipe with D = 0, 4 and 32, same EMULATED devices.

Four emulated devices, the ``local`` preset's: two of speed 1 (64 MiB) and two of speed
0.5 (32 MiB), relative to this host running a task alone. Every system in a run emulates
them with one dilation (``--dilation``, default 32) and one reference. The dilation is
large on purpose: on this 2-core machine the ``cnn``'s whole step takes a few ms alone, and
at a dilation of 6 HetPipe's two-process workers ran at about a third of the pace they were
padded to (their time going to gRPC, the parameter servers and the shared cores between
tasks, which the overrun fraction does not see), so that the comparison measured this
host's overheads more than the emulated devices; at 16 the ED-local workers, whose stages
sit on each other's nodes, overran on 10-13 % of their tasks (27 Nov); at 32 on under 0.5 %.
Each row gives its measured images/s beside the pace it was padded to (Horovod:
``emulated_pace_images_per_s`` = ranks x 32 / (dilation / slowest speed x reference);
HetPipe: ``planner_images_per_s``, the planner's prediction).

* **The reference** (the rule of benchmarks/comparison.py): one profile of the model (each
  segment's forward and backward time alone on a worker task's CPU, and a task's fixed cost),
  which the first HetPipe run measures (or reads from the profile cache) and writes beside the
  results (``convergence.profile.json``; ``--profile`` gives one instead). Every HetPipe run
  paces its stages to it (``emulation_references="profile"``) and Horovod's whole step to the
  whole model's time by it, so every system emulates the same devices, not solo times that
  each run measures anew and the load of the moment moves (measured in this script's process, a
  solo step took 5 ms in one run and 37 ms in another).
* **Horovod** (``benchmarks/horovod/train_horovod.py`` by ``horovodrun --gloo``, 4 ranks,
  speeds 1, 1, 0.5, 0.5): each rank trains the whole ``cnn`` on its shard, a step's compute
  padded to dilation / speed x reference (``--reference_ms``); the all-reduce is not padded.
  Two rows: ``Horovod lr x1``, the learning rate as given, and ``Horovod lr x4``, the
  learning rate multiplied by the number of ranks as Horovod's documentation prescribes
  ("scale the learning rate by the number of workers"): ``hvd.DistributedOptimizer``
  averages the 4 ranks' gradients, so an epoch makes 11 updates of a global batch of 128,
  where each HetPipe virtual worker applies every minibatch of 32 to its local weights (44
  updates an epoch in all). The documentation pairs that scaling with a warm-up of the
  learning rate over the first epochs, which the baseline script does not have.
* **HetPipe** (``HetPipeStrategy``, launch "processes": one process per virtual worker)
  under WSP with D = 0, 4 and 32 (§5), one run each in a process of its own, pipelined with
  the planner's cut and Nm. Every stage's task is padded to dilation / speed x its time by
  the profile. Two allocations (§8.1):

  - ``ed``: ED with local placement, as Fig. 6 (ED-local): two equal virtual workers, each
    one device of speed 1 and one of speed 0.5. Equal workers keep pace with each other, so
    at D = 0 a worker hardly waits (each row's ``workers`` gives every worker's measured
    average wait for pulled weights, §8.4) and a larger D has nothing to hide: in the paper
    D = 4 gains 28 % over D = 0 on ED-local from fluctuations and communication between
    nodes that these emulated devices on one host do not have.
  - ``np`` (``--np_bounds``): NP, virtual workers of unequal speed (F, F and S, S). This is
    where D is expected to matter (§8.4: "using larger D has a greater effect for HetPipe
    with NP"); but the bound still holds the fast worker within D + 1 waves of the slow
    one, so once that lead is taken both go at the slow worker's pace whatever D is (the
    ``persistent`` scenario of benchmarks/wsp_straggler.py): D only buys the lead's few
    waves. The measured waits and times say how much that is here.

Same training settings for all: the bundled digits (1437 train / 360 test images), the
``cnn``, minibatches of 32 (one per rank or per pipeline slot), plain SGD (``--lr``), an
epoch = 44 minibatches in all systems (11 steps of 4 ranks for Horovod). Each row: the
accuracy curve (epoch, wall seconds since training began, test accuracy), the time and
epoch at which test accuracy first reached ``--target``, images/s, ``emulated: true``, the
overrun fraction and whether the emulation was faithful (fewer than 5 % of paced tasks
overran). HetPipe's wall time includes its validation, which runs while the workers go on
training; Horovod's leaves its evaluation out (the baseline's ``epoch_wall_s``). A HetPipe
run stops ``--epochs_after_target`` epochs after it reaches the target; a Horovod run
trains ``--horovod_epochs`` epochs (``--horovod_scaled_epochs`` with the scaled learning
rate; the baseline has no early stop), and a row that never
reaches the target says so (``time_to_target_s: null``). With ``--data_dir`` and
``--dataset`` the HetPipe rows train on a prepared TFDS data set (nothing is downloaded);
Horovod's venv has no TFDS, so its rows are then left out, with a line saying so.

    python benchmarks/convergence.py [--epochs=30] [--horovod_epochs=60] [--horovod_scaled_epochs=20]
        [--target=0.9] [--dilation=32] [--lr=0.1] [--bounds=0,4,32] [--np_bounds=0,4] [--profile=PATH]
        [--out=benchmarks/results/convergence.jsonl] [--png=benchmarks/results/convergence.png]
"""
import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.comparison import (  # noqa: E402
    MARK, check_profile_flag, child_rows, emit, given_profile, keep_profile, run_profile, whole_model_reference_ms)

SPEEDS = (1.0, 1.0, 0.5, 0.5)  # the local preset's devices: F, F, S, S
MEMORY = ("64M", "64M", "32M", "32M")
BOUNDS = (0, 4, 32)


def time_to_target(curve, target):
    """(wall seconds, epoch) at which the test accuracy first reached `target`, or (None, None)."""
    for row in curve:
        if row["test_accuracy"] >= target:
            return row["wall_s"], row["epoch"]
    return None, None


def horovod_row(args, reference_ms, lr_scale):
    """Horovod's row with the learning rate multiplied by `lr_scale` (1: as given; the number of
    ranks: Horovod's documented scaling)."""
    from benchmarks.baselines import horovod_run

    lr = args.lr * lr_scale
    line = horovod_run.run(4, [f"--speeds={','.join(f'{v:g}' for v in SPEEDS)}", f"--memory={','.join(MEMORY)}",
                               f"--dilation={args.dilation:g}", f"--reference_ms={reference_ms:.3f}",
                               f"--epochs={args.horovod_epochs if lr_scale == 1 else args.horovod_scaled_epochs}",
                               f"--lr={lr:g}", "--batch_size=32",
                               f"--seed={args.seed}"], deadline_s=args.deadline_s)
    curve = [{"epoch": i + 1, "wall_s": w, "test_accuracy": a}
             for i, (w, a) in enumerate(zip(line["epoch_wall_s"], line["epoch_test_accuracy"]))]
    return {"system": f"Horovod lr x{lr_scale:g}", "processes": 4, "lr": lr, "lr_scale": lr_scale,
            "lr_rule": "scaled by the number of ranks (Horovod's documentation)" if lr_scale != 1 else "not scaled",
            "images_per_s": line["images_per_s"],
            "emulated_pace_images_per_s": round(len(SPEEDS) * 32 / (args.dilation / min(SPEEDS) * reference_ms / 1e3), 2),
            "curve": curve, **{k: line[k] for k in ("emulated", "dilation", "paced_tasks", "overran_tasks", "overrun_fraction",
                                    "emulation_faithful", "reference_ms", "speeds", "left_out")}}


def hetpipe_child(args):
    """One HetPipe run (this process is its chief); prints its row as a JSON line."""
    from hetpipe_tf.api.strategy import HetPipeStrategy

    given = given_profile(args.profile)
    strategy = HetPipeStrategy(cluster="local", policy=args.child_policy, staleness_bound=args.child_d,
                               launch="processes", dilation=args.dilation, profile=given,
                               emulation_references="profile")
    import keras

    from hetpipe_tf.cli.models import build_model
    from hetpipe_tf.data import datasets

    info = datasets.dataset_info(args.dataset, args.data_dir)
    with strategy.scope():
        train = datasets.load_image_classification(args.dataset, "train", batch_size=32, shuffle=True,
                                                   seed=args.seed, data_dir=args.data_dir)
        test = datasets.load_image_classification(args.dataset, "test", batch_size=32, data_dir=args.data_dir)
        keras.utils.set_random_seed(args.seed)
        model = build_model("cnn", tuple(train.element_spec[0].shape[1:]), info.num_classes)
        model.compile(optimizer=keras.optimizers.SGD(args.lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    curve, reached = [], []

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            curve.append({"epoch": epoch + 1, "wall_s": round(time.perf_counter() - self.t0, 3),
                          "test_accuracy": round(float(logs["val_accuracy"]), 4),
                          "images_per_s": round(float(logs.get("images_per_s", 0.0)), 2)})
            if logs["val_accuracy"] >= args.target:
                reached.append(epoch)
            if reached and epoch - reached[0] >= args.epochs_after_target:
                self.model.stop_training = True

    model.fit(train, epochs=args.epochs, validation_data=test, callbacks=[Clock()], verbose=0)
    report = strategy.runner.emulation_report().as_dict()
    workers = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in w.items()} for w in strategy.stats()]
    plan = strategy.plan
    keep_profile(args.profile, plan)
    images = [r["images_per_s"] for r in curve[1:]] or [curve[0]["images_per_s"]]
    row = {"system": system_name(args.child_policy, args.child_d), "policy": args.child_policy,
           "staleness_bound": args.child_d, "lr": args.lr, "workers": workers,
           "processes": len(plan.workers), "virtual_workers": [w.device_types for w in plan.workers],
           "num_in_flight": plan.num_in_flight, "placement": plan.placement,
           "images_per_s": round(sum(images) / len(images), 2),
           "planner_images_per_s": round(plan.images_per_s, 2), "curve": curve, "emulation_references": "profile",
           **report}
    print(MARK + json.dumps(row), flush=True)


def system_name(policy, d):
    return f"HetPipe D={d}" if policy == "ed" else f"HetPipe {policy.upper()} D={d}"


def hetpipe_row(args, policy, d, profile):
    """One HetPipe run in a process of its own, its devices emulated from the profile at `profile`
    (which it writes when there is none yet: the run's first)."""
    argv = [sys.executable, os.path.abspath(__file__), f"--child_d={d}", f"--child_policy={policy}",
            f"--epochs={args.epochs}", f"--profile={profile}",
            f"--dilation={args.dilation:g}", f"--lr={args.lr:g}", f"--target={args.target:g}",
            f"--epochs_after_target={args.epochs_after_target}", f"--seed={args.seed}", f"--dataset={args.dataset}"]
    if args.data_dir:
        argv.append(f"--data_dir={args.data_dir}")
    (row,) = child_rows(argv, args.deadline_s)
    return row


def title(dataset, dilation):
    return f"{dataset} cnn: Horovod vs HetPipe (ED-local, NP; 2 VWs)\n4 EMULATED devices 1/1/0.5/0.5, dilation {dilation:g}"


def plot(rows, target, path, title):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for row in rows:
        c = row["curve"]
        faithful = "" if row["emulation_faithful"] else ", NOT faithful"
        ax.plot([r["wall_s"] for r in c], [r["test_accuracy"] for r in c], marker=".",
                label=f"{row['system']} (overrun {row['overrun_fraction']:.1%}{faithful})")
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:g}")
    ax.set_xlabel("wall time since training began (s), EMULATED devices")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def summarise(rows, target):
    """The summary line: every row's time to target and the targets: D = 4 sooner than
    Horovod (at each learning rate, and at the better of the two, the fair comparison) and
    sooner than D = 0, ED-local; NP's D = 4 against its D = 0 beside. A row that never reached
    the target loses to one that did; a comparison with a row missing from the run is None."""
    times = {r["system"]: r["time_to_target_s"] for r in rows}
    horovod = [t for name, t in times.items() if name.startswith("Horovod")]
    if horovod:
        reached = [t for t in horovod if t is not None]
        times["Horovod best lr"] = min(reached) if reached else None

    def sooner(a, b):
        if a not in times or b not in times:
            return None
        return times[a] is not None and (times[b] is None or times[a] < times[b])

    def ratio(a, b):
        return round(times[a] / times[b], 3) if times.get(a) and times.get(b) else None

    pairs = {"D=4 sooner than Horovod (best lr)": ("HetPipe D=4", "Horovod best lr"),
             "D=4 sooner than Horovod lr x4": ("HetPipe D=4", "Horovod lr x4"),
             "D=4 sooner than Horovod lr x1": ("HetPipe D=4", "Horovod lr x1"),
             "D=4 sooner than D=0 (ED-local)": ("HetPipe D=4", "HetPipe D=0"),
             "NP D=4 sooner than NP D=0": ("HetPipe NP D=4", "HetPipe NP D=0")}
    targets = {name: sooner(a, b) for name, (a, b) in pairs.items()}
    ratios = {f"{a} / {b}": ratio(a, b) for a, b in pairs.values() if a in times and b in times}
    return {"summary": True, "time_to_target_s": times, "target": target, "ratios": ratios, "targets": targets,
            "emulated": True, "all_faithful": all(r["emulation_faithful"] for r in rows),
            "overrun_fraction_max": max((r["overrun_fraction"] for r in rows), default=None),
            "target_met": bool(targets["D=4 sooner than Horovod (best lr)"]
                               and targets["D=4 sooner than D=0 (ED-local)"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30, help="most epochs of a HetPipe run")
    parser.add_argument("--horovod_epochs", type=int, default=60, help="epochs of Horovod with the lr as given")
    parser.add_argument("--horovod_scaled_epochs", type=int, default=20, help="epochs of Horovod with lr x ranks")
    parser.add_argument("--epochs_after_target", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--dilation", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="hetpipe_digits")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--bounds", default=",".join(map(str, BOUNDS)), help="D values of HetPipe ED-local")
    parser.add_argument("--np_bounds", default="0,4", help="D values of HetPipe NP (unequal workers); '' for none")
    parser.add_argument("--skip_horovod", action="store_true")
    parser.add_argument("--deadline_s", type=float, default=1800.0, help="of each system's run")
    parser.add_argument("--out", default="benchmarks/results/convergence.jsonl")
    parser.add_argument("--png", default="benchmarks/results/convergence.png")
    parser.add_argument("--child_d", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_policy", default="ed", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default="", help="emulate every system's devices from this profile (the "
                        ".profile.json an earlier run wrote) instead of the one the first HetPipe run measures")
    args = parser.parse_args()
    if args.child_d is not None:
        return hetpipe_child(args)
    check_profile_flag(parser, args.profile)

    load = os.getloadavg()
    started = time.perf_counter()
    rows = []
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out, \
            tempfile.TemporaryDirectory(prefix="convergence-") as folder:
        profile = run_profile(args, folder)
        runs = [("ed", int(x)) for x in args.bounds.split(",") if x.strip()]
        runs += [("np", int(x)) for x in args.np_bounds.split(",") if x.strip()]
        rows += [hetpipe_row(args, policy, d, profile) for policy, d in runs]  # the first measures the profile
        reference_ms = whole_model_reference_ms(profile)
        emit(out, "convergence", setup={"devices": {"speeds": SPEEDS, "memory": MEMORY}, "dilation": args.dilation,
                          "profile": args.profile or f"the first HetPipe run's (measured, or this machine's cached one), written to {profile}",
                          "reference_ms": round(reference_ms, 3), "model": "cnn", "dataset": args.dataset,
                          "batch_size": 32, "optimizer": f"SGD lr={args.lr:g}, no momentum", "target": args.target,
                          "horovod_lr": {"x1": args.lr, "x4": args.lr * 4},
                          "emulated": True, "load_average_at_start": [round(x, 2) for x in load]})
        if args.skip_horovod or args.dataset != "hetpipe_digits":
            emit(out, "convergence", system="Horovod", skipped=("--skip_horovod" if args.skip_horovod else
                                                  "the Horovod baseline trains on the bundled digits only"))
        else:
            rows = [horovod_row(args, reference_ms, scale) for scale in (1, len(SPEEDS))] + rows
        for row in rows:
            row["time_to_target_s"], row["epochs_to_target"] = time_to_target(row["curve"], args.target)
            emit(out, "convergence", **row)
        emit(out, "convergence", **summarise(rows, args.target), run_wall_s=round(time.perf_counter() - started, 1))
    if args.png:
        plot(rows, args.target, args.png, title(args.dataset, args.dilation))


if __name__ == "__main__":
    main()
