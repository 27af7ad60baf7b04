"""HetPipe, Pipe-SGD, TaylorPipe and the classic pipelines side by side: throughput, time per epoch and time to accuracy on the same EMULATED devices.

One run trains every scheme this checkout registers, each in a process of its own, on the
bundled digits (1437 train / 360 test images) with the ``cnn``, minibatches of 32, SGD
(``--lr``, ``--momentum``; none by default: in trial runs at momentum 0.5 and 0.9 HetPipe's
two workers at D = 4 stayed near chance for 6-8 epochs while one device's SGD learnt) and a
fixed number of epochs (``--epochs``; an epoch is 44 minibatches of all workers together), on the ``local`` preset's four EMULATED devices: two
of speed 1 (64 MiB) and two of speed 0.5 (32 MiB). Every task of a device of speed v takes
max(actual, dilation / v x its solo time), communication is not padded
(``hetpipe_tf.pipeline.emulation``); one dilation for every scheme, ``--dilation`` (default 16;
0: calibrated by the first scheme, ``HetPipe pipeline``, in one process: probes from 4 until
fewer than 2.5 % of tasks overran, then one step more). The default is large on purpose: in a
run of this script at the 8 that calibration chose, the one-process pipelines overran on fewer
than 0.3 % of their tasks but the multi-process schemes on 29-38 % (their servers, gRPC and
the chief's validation share the two cores with the paced tasks, which the one-process probe
does not see). Each row reports its own overrun fraction and
whether the emulation was faithful (fewer than 5 % of paced tasks overran).

The schemes (the registries are asked at run time, ``hetpipe_tf.pipeline.schedule``):

* one pipeline on the four devices (one process; ``VirtualWorker``, Nm = 4, cut by FLOPs over
  the speeds): ``HetPipe pipeline`` (§4), ``GPipe`` (4 microbatches per minibatch, a flush),
  ``PipeDream`` (1F1B, weight stashing), ``NaivePipe`` (no stashing) and ``TaylorPipe``
  (the TaylorPipe paper's Taylor compensation, when registered);
* virtual workers under a scheme between them (``HetPipeStrategy``, launch "processes": one
  process per virtual worker, parameter servers on every node), ED with local placement, 2
  workers of one fast and one slow device: ``HetPipe (WSP)`` with D = ``--staleness_bound``
  (§5), ``BSP``, ``SSP`` (``--ssp_bound`` minibatches) and ``ASP`` with HetPipe's pipelines
  inside, ``TaylorPipe inside WSP`` (the ``hetpipe-taylor`` schedule: the compensation
  applied to the staleness of pulled global weights) and ``Pipe-SGD between virtual
  workers`` (HetPipe's pipelines, Pipe-SGD's all-reduce with staleness k = 1 between them),
  when registered; ``Pipe-SGD`` itself (the Pipe-SGD paper's: plain data parallelism, staleness k = 1) as
  four workers of one device each (NP, ``vw_size=1``); HetPipe on NP (one worker per node:
  unequal workers, F F and S S) with even minibatches and with uneven ones
  (``uneven_minibatches=True``: a minibatch size per worker in proportion to its predicted
  throughput, pushes weighted by it);
* ``SGD (1 device)``: plain SGD on one device of speed 1 (TaylorPipe's baseline).

A scheme that fails (an unregistered name included: the registry's error says which exist)
gets a row that says so with its error (``failed``), never a number. Per row: images/s (44 x 32 over the median epoch time, first epoch left out: it
builds and traces), the median time per epoch, the wall time and epoch at which the test
accuracy first reached ``--target`` (null when it did not), the final and best test
accuracy, the accuracy curve, the processes, ``emulated: true`` and the overrun fraction.

TaylorPipe's Tables 2-3 (CIFAR-10, VGG-16, 2-8 GPUs) have this shape, stated
beside the measured rows in the summary line: NaivePipe is the fastest per epoch but does
not converge (72-82 % error); PipeDream, SpecTrain and TaylorPipe reach error rates close to
SGD's (6.6-8.0 % against 6.73 %) while taking 1.4-2.7x less time per epoch than SGD. The
summary says which of these shapes this run shows.

    python benchmarks/schemes_comparison.py [--epochs=15] [--target=0.9] [--lr=0.1] [--momentum=0]
        [--staleness_bound=4] [--dilation=16] [--only=GPipe,BSP]
        [--out=benchmarks/results/schemes_comparison.jsonl] [--png=benchmarks/results/schemes_comparison.png]
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.comparison import MARK, child_rows, emit  # noqa: E402
from benchmarks.convergence import time_to_target  # noqa: E402

PIPELINE_DEVICES = "1@64M,1@64M,0.5@32M,0.5@32M"  # the local preset's devices, F F S S
SGD_DEVICE = "1@64M"
BATCH = 32
DILATIONS = (4, 6, 8, 12, 16)  # the calibration's candidates (--dilation=0)


def schemes(staleness_bound, ssp_bound):
    """Every scheme of the comparison: name, kind (pipeline, strategy, single) and its options."""
    strategy = {"kind": "strategy", "schedule": "hetpipe", "policy": "ed", "staleness_bound": 0}
    return [
        {"scheme": "HetPipe pipeline", "kind": "pipeline", "schedule": "hetpipe"},
        {"scheme": "GPipe", "kind": "pipeline", "schedule": "gpipe"},
        {"scheme": "PipeDream", "kind": "pipeline", "schedule": "pipedream"},
        {"scheme": "NaivePipe", "kind": "pipeline", "schedule": "naivepipe"},
        {"scheme": "TaylorPipe", "kind": "pipeline", "schedule": "taylorpipe"},
        {"scheme": f"HetPipe (WSP, D={staleness_bound})", **strategy, "sync": "wsp", "staleness_bound": staleness_bound},
        {"scheme": "BSP", **strategy, "sync": "bsp", "staleness_bound": 0},
        {"scheme": f"SSP (s={ssp_bound})", **strategy, "sync": "ssp", "staleness_bound": ssp_bound},
        {"scheme": "ASP", **strategy, "sync": "asp", "staleness_bound": 0},
        {"scheme": f"TaylorPipe inside WSP (D={staleness_bound})", **strategy, "schedule": "hetpipe-taylor",
         "sync": "wsp", "staleness_bound": staleness_bound},
        {"scheme": "Pipe-SGD", **strategy, "policy": "np", "sync": "pipe-sgd", "vw_size": 1},
        {"scheme": "Pipe-SGD between virtual workers", **strategy, "sync": "pipe-sgd"},
        {"scheme": f"HetPipe NP even minibatches (D={staleness_bound})", **strategy, "policy": "np",
         "sync": "wsp", "staleness_bound": staleness_bound},
        {"scheme": f"HetPipe NP uneven minibatches (D={staleness_bound})", **strategy, "policy": "np",
         "sync": "wsp", "staleness_bound": staleness_bound, "uneven": True},
        {"scheme": "SGD (1 device)", "kind": "single", "schedule": "hetpipe"},
    ]


def summarise_curve(curve, target, images_per_epoch=44 * BATCH):
    """Time per epoch (median, first epoch left out), images/s from it, time and epoch to `target`."""
    walls = [0.0] + [r["wall_s"] for r in curve]
    epochs = [b - a for a, b in zip(walls, walls[1:])]
    steady = epochs[1:] or epochs
    per_epoch = statistics.median(steady)
    reached_s, reached_epoch = time_to_target(curve, target)
    return {"time_per_epoch_s": round(per_epoch, 3),
            "time_per_first_epoch_s": round(epochs[0], 3),
            "images_per_s": round(images_per_epoch / per_epoch, 2),
            "time_to_target_s": reached_s, "epochs_to_target": reached_epoch,
            "final_test_accuracy": curve[-1]["test_accuracy"],
            "best_test_accuracy": max(r["test_accuracy"] for r in curve)}


def shapes(rows, target):
    """Which of TaylorPipe's Tables 2-3 shapes this run's rows show (None: a row is missing)."""
    by = {r["scheme"]: r for r in rows if "final_test_accuracy" in r}
    sgd, naive = by.get("SGD (1 device)"), by.get("NaivePipe")
    others = [by[n] for n in ("PipeDream", "TaylorPipe", "GPipe", "HetPipe pipeline") if n in by]
    out = {"paper": "TaylorPipe Tables 2-3: NaivePipe fastest per epoch but not converging (72-82 % error); "
                    "PipeDream, SpecTrain, TaylorPipe within 1.3 points of SGD's 6.73 % error, 1.4-2.7x faster "
                    "per epoch than SGD"}
    pipelines = [r for r in by.values() if r.get("kind") == "pipeline"]
    if naive and pipelines:
        out["NaivePipe fastest pipeline per epoch"] = naive["time_per_epoch_s"] <= min(
            r["time_per_epoch_s"] for r in pipelines)
        out["NaivePipe does not reach the target"] = naive["time_to_target_s"] is None
    if sgd and others:
        out["pipelines within 0.02 of SGD's final accuracy"] = {
            r["scheme"]: abs(r["final_test_accuracy"] - sgd["final_test_accuracy"]) <= 0.02 for r in others}
        out["pipelines faster per epoch than SGD"] = {
            r["scheme"]: round(sgd["time_per_epoch_s"] / r["time_per_epoch_s"], 2) for r in others}
    return out


def child(config):
    """One scheme's run in this process; prints its row as a JSON line after MARK."""
    import keras

    from hetpipe_tf.cli.models import build_model
    from hetpipe_tf.data import datasets

    keras.utils.set_random_seed(config["seed"])
    strategy = None
    if config["kind"] == "strategy":
        from hetpipe_tf.api.strategy import HetPipeStrategy

        strategy = HetPipeStrategy(cluster="local", policy=config["policy"], staleness_bound=config["staleness_bound"],
                                   vw_size=config.get("vw_size"), schedule=config["schedule"], sync=config["sync"],
                                   launch="processes", dilation=config["dilation"],
                                   uneven_minibatches=config.get("uneven", False))
    # A strategy's datasets are made in its scope: this process joins the cluster first.
    with strategy.scope() if strategy else contextlib.nullcontext():
        train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=BATCH, shuffle=True,
                                                   seed=config["seed"])
        test = datasets.load_image_classification("hetpipe_digits", "test", batch_size=BATCH)
        shape = tuple(train.element_spec[0].shape[1:])
        model = build_model("cnn", shape, 10)

    def optimizer():
        return keras.optimizers.SGD(config["lr"], momentum=config["momentum"])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    curve = []

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            curve.append({"epoch": epoch + 1, "wall_s": round(time.perf_counter() - self.t0, 3),
                          "test_accuracy": round(float(logs["val_accuracy"]), 4)})

    row = {"scheme": config["scheme"], "kind": config["kind"], "schedule": config["schedule"]}
    if strategy:
        with strategy.scope():
            model.compile(optimizer=optimizer(), loss=loss, metrics=["accuracy"])
        model.fit(train, epochs=config["epochs"], validation_data=test, callbacks=[Clock()], verbose=0)
        report = strategy.runner.emulation_report()
        plan = strategy.plan
        row.update(sync=config["sync"], staleness_bound=config["staleness_bound"], policy=config["policy"],
                   processes=len(plan.workers), virtual_workers=[w.device_types for w in plan.workers],
                   minibatch_sizes=list(plan.sizes), num_in_flight=plan.num_in_flight)
    else:
        from hetpipe_tf.runtime.virtual_worker import VirtualWorker

        devices = PIPELINE_DEVICES if config["kind"] == "pipeline" else SGD_DEVICE
        k = devices.count(",") + 1
        vw = VirtualWorker(model, devices, num_in_flight=k, schedule=config["schedule"], dilation=config["dilation"],
                           optimizer=optimizer(), loss=loss, metrics=["accuracy"])
        if config["dilation"] is None:
            first = next(iter(train))
            vw.prepare(*first)
            vw.calibrate_dilation(first, candidates=DILATIONS)
        vw.fit(train, epochs=config["epochs"], validation_data=test, callbacks=[Clock()], verbose=0)
        report = vw.emulation_report()
        row.update(processes=1, devices=devices, num_in_flight=k)
    row.update(summarise_curve(curve, config["target"]), curve=curve, **report.as_dict())
    print(MARK + json.dumps(row), flush=True)


def run_child(config, deadline_s):
    """Runs one scheme in a process of its own; its row, or a row saying how it failed."""
    from benchmarks.baselines import processes

    argv = [sys.executable, os.path.abspath(__file__), "--child=" + json.dumps(config)]
    try:
        rows = child_rows(argv, deadline_s)
    except processes.BaselineRunError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return {"scheme": config["scheme"], "kind": config["kind"], "failed": " | ".join(lines[-3:])[-600:]}
    if len(rows) != 1:
        return {"scheme": config["scheme"], "kind": config["kind"], "failed": "the run printed no row"}
    return rows[0]


def plot(rows, target, path, title):
    """Accuracy against wall time per scheme, and images/s per scheme."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in rows if "curve" in r]
    fig = Figure(figsize=(13, 5))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for r in done:
        faithful = "" if r["emulation_faithful"] else ", NOT faithful"
        left.plot([c["wall_s"] for c in r["curve"]], [c["test_accuracy"] for c in r["curve"]], marker=".",
                  linestyle="--" if r["kind"] == "pipeline" else "-",
                  label=f"{r['scheme']} ({r['overrun_fraction']:.1%}{faithful})")
    left.axhline(target, color="grey", linestyle=":")
    left.set_xlabel("wall time since training began (s), EMULATED devices")
    left.set_ylabel("test accuracy")
    left.legend(fontsize=6)
    names = [r["scheme"] for r in done]
    right.barh(names, [r["images_per_s"] for r in done],
               color=["tab:orange" if r["kind"] == "pipeline" else "tab:blue" for r in done])
    right.set_xlabel("images/s (median epoch, first left out)")
    right.tick_params(axis="y", labelsize=7)
    failed = [r["scheme"] for r in rows if "curve" not in r]
    if failed:
        right.set_title("failed: " + "; ".join(failed), fontsize=6, wrap=True)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--staleness_bound", type=int, default=4, help="D of WSP (waves)")
    parser.add_argument("--ssp_bound", type=int, default=4, help="s of SSP (minibatches)")
    parser.add_argument("--dilation", type=float, default=16.0, help="0: calibrated by the first scheme")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated scheme names (default: all)")
    parser.add_argument("--deadline_s", type=float, default=600.0, help="of each scheme's run")
    parser.add_argument("--out", default="benchmarks/results/schemes_comparison.jsonl")
    parser.add_argument("--png", default="benchmarks/results/schemes_comparison.png")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    import hetpipe_tf.api.strategy  # noqa: F401 - everything the strategy registers
    import hetpipe_tf.pipeline  # noqa: F401 - registers the schedules
    import hetpipe_tf.sync  # noqa: F401 - and the synchronisation schemes
    from hetpipe_tf.pipeline.schedule import combinations

    load, started = os.getloadavg(), time.perf_counter()
    pairs = set(combinations())
    chosen = schemes(args.staleness_bound, args.ssp_bound)
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        chosen = [s for s in chosen if any(s["scheme"].startswith(n) for n in names)]
    rows, dilation = [], args.dilation or None
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out:
        def line(**fields):
            emit(out, "schemes_comparison", **fields)

        line(setup={"devices": PIPELINE_DEVICES, "cluster": "local", "model": "cnn", "dataset": "hetpipe_digits",
                    "batch_size": BATCH, "optimizer": f"SGD lr={args.lr:g} momentum={args.momentum:g}",
                    "epochs": args.epochs, "target": args.target, "registered": sorted(map(list, pairs)),
                    "emulated": True, "load_average_at_start": [round(x, 2) for x in load]})
        for scheme in chosen:
            config = {**scheme, "epochs": args.epochs, "target": args.target, "lr": args.lr,
                      "momentum": args.momentum, "seed": args.seed, "dilation": dilation}
            row = run_child(config, args.deadline_s)
            if dilation is None and "dilation" in row:
                dilation = row["dilation"]  # the first scheme's calibration holds for the rest
            line(**row)
            rows.append(row)
        done = [r for r in rows if "curve" in r]
        line(summary=True, emulated=True, dilation=dilation, all_faithful=all(r["emulation_faithful"] for r in done),
             overrun_fraction_max=max((r["overrun_fraction"] for r in done), default=None),
             images_per_s={r["scheme"]: r["images_per_s"] for r in done},
             time_to_target_s={r["scheme"]: r["time_to_target_s"] for r in done},
             final_test_accuracy={r["scheme"]: r["final_test_accuracy"] for r in done},
             failed={r["scheme"]: r["failed"] for r in rows if "curve" not in r},
             taylorpipe_tables_2_3=shapes(rows, args.target), run_wall_s=round(time.perf_counter() - started, 1))
    if args.png and done:
        plot(rows, args.target, args.png, f"digits cnn, {args.epochs} epochs, EMULATED devices 1/1/0.5/0.5 "
                                          f"(local preset), dilation {dilation:g}")


if __name__ == "__main__":
    main()
