"""Time to accuracy (HetPipe Fig. 5/6): Horovod against HetPipe with D = 0, 4 and 32, same EMULATED devices.

Four emulated devices, the ``local`` preset's: two of speed 1 (64 MiB) and two of speed
0.5 (32 MiB), relative to this host running a task alone. Every system in a run emulates
them with one dilation (``--dilation``) and one reference:

* **Horovod** (``benchmarks/horovod/train_horovod.py`` by ``horovodrun --gloo``, 4 ranks,
  speeds 1, 1, 0.5, 0.5): each rank trains the whole ``cnn`` on its shard, a step's compute
  padded to dilation / speed x reference, where reference is the solo compute time of a
  whole step, measured once by this script in the main venv (``--reference_ms``, the
  baselines' rule, benchmarks/horovod/README.md); the all-reduce is not padded.
* **HetPipe** (``HetPipeStrategy``, launch "processes": one process per virtual worker),
  ED with local placement (§8.1, as Fig. 6: ED-local): two virtual workers, each one device
  of speed 1 and one of speed 0.5, pipelined with the planner's cut and Nm, under WSP with
  D = 0, 4 and 32 (§5), one run each in a process of its own. Every stage's task is padded
  to dilation / speed x its own solo time, which the executor measures in the same
  TensorFlow as the reference above.

Same training settings for all: the bundled digits (1437 train / 360 test images), the
``cnn``, minibatches of 32 (one per rank or per pipeline slot), plain SGD with one learning
rate (``--lr``; Horovod averages the 4 ranks' gradients, as ``hvd.DistributedOptimizer``
does, and its learning rate is not scaled), an epoch = 44 minibatches in all systems (11
steps of 4 ranks for Horovod). Each row: the accuracy curve (epoch, wall seconds since
training began, test accuracy), the time and epoch at which test accuracy first reached
``--target``, images/s, ``emulated: true``, the overrun fraction and whether the emulation
was faithful (fewer than 5 % of paced tasks overran). HetPipe's wall time includes its
validation, which runs while the workers go on training; Horovod's leaves its evaluation
out (the baseline's ``epoch_wall_s``). A HetPipe run stops ``--epochs_after_target``
epochs after it reaches the target. With ``--data_dir`` and ``--dataset`` the HetPipe rows
train on a prepared TFDS data set (nothing is downloaded); Horovod's venv has no TFDS, so
its row is then left out, with a line saying so.

    python benchmarks/convergence.py [--epochs=40] [--horovod_epochs=60] [--target=0.9]
        [--dilation=6] [--lr=0.1] [--out=benchmarks/results/convergence.jsonl]
        [--png=benchmarks/results/convergence.png]
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SPEEDS = (1.0, 1.0, 0.5, 0.5)  # the local preset's devices: F, F, S, S
MEMORY = ("64M", "64M", "32M", "32M")
BOUNDS = (0, 4, 32)


def _emit(out, **fields):
    line = json.dumps({"benchmark": "convergence", **fields})
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def time_to_target(curve, target):
    """(wall seconds, epoch) at which the test accuracy first reached `target`, or (None, None)."""
    for row in curve:
        if row["test_accuracy"] >= target:
            return row["wall_s"], row["epoch"]
    return None, None


def measure_reference_ms(seed=0):
    """The solo compute time (ms) of one whole step of the cnn on a minibatch of 32 digits in this
    venv's TensorFlow, one intra-op thread (the baselines' rule: minimum of 10 runs after 3)."""
    import tensorflow as tf

    from benchmarks.baselines import training

    import keras

    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(seed)
    x, y, _, _ = training.load_digits()
    model = training.build_model()

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def compute(images, labels):
        with tf.GradientTape() as tape:
            value = loss(labels, model(images, training=True))
        return tape.gradient(value, model.trainable_variables)

    return training.solo_reference(compute, (tf.constant(x[:32]), tf.constant(y[:32]))) * 1e3


def horovod_row(args, reference_ms):
    from benchmarks.baselines import horovod_run

    line = horovod_run.run(4, [f"--speeds={','.join(f'{v:g}' for v in SPEEDS)}", f"--memory={','.join(MEMORY)}",
                               f"--dilation={args.dilation:g}", f"--reference_ms={reference_ms:.3f}",
                               f"--epochs={args.horovod_epochs}", f"--lr={args.lr:g}", "--batch_size=32",
                               f"--seed={args.seed}"], deadline_s=args.deadline_s)
    curve = [{"epoch": i + 1, "wall_s": w, "test_accuracy": a}
             for i, (w, a) in enumerate(zip(line["epoch_wall_s"], line["epoch_test_accuracy"]))]
    return {"system": "Horovod", "processes": 4, "images_per_s": line["images_per_s"], "curve": curve,
            **{k: line[k] for k in ("emulated", "dilation", "paced_tasks", "overran_tasks", "overrun_fraction",
                                    "emulation_faithful", "reference_ms", "speeds", "left_out")}}


def hetpipe_child(args):
    """One HetPipe run (this process is its chief); prints its row as a JSON line."""
    from hetpipe_tf.api.strategy import HetPipeStrategy

    strategy = HetPipeStrategy(cluster="local", policy="ed", staleness_bound=args.child_d, launch="processes",
                               dilation=args.dilation)
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
    plan = strategy.plan
    images = [r["images_per_s"] for r in curve[1:]] or [curve[0]["images_per_s"]]
    row = {"system": f"HetPipe D={args.child_d}", "staleness_bound": args.child_d,
           "processes": len(plan.workers), "virtual_workers": [w.device_types for w in plan.workers],
           "num_in_flight": plan.num_in_flight, "placement": plan.placement,
           "images_per_s": round(sum(images) / len(images), 2), "curve": curve, **report}
    print("ROW " + json.dumps(row), flush=True)


def hetpipe_row(args, d):
    argv = [sys.executable, os.path.abspath(__file__), f"--child_d={d}", f"--epochs={args.epochs}",
            f"--dilation={args.dilation:g}", f"--lr={args.lr:g}", f"--target={args.target:g}",
            f"--epochs_after_target={args.epochs_after_target}", f"--seed={args.seed}", f"--dataset={args.dataset}"]
    if args.data_dir:
        argv.append(f"--data_dir={args.data_dir}")
    from benchmarks.baselines import processes

    (stdout,) = processes.run_all([argv], args.deadline_s)
    (row,) = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
    return row


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40, help="most epochs of a HetPipe run")
    parser.add_argument("--horovod_epochs", type=int, default=60)
    parser.add_argument("--epochs_after_target", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--dilation", type=float, default=6.0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="hetpipe_digits")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--bounds", default=",".join(map(str, BOUNDS)), help="HetPipe's D values")
    parser.add_argument("--skip_horovod", action="store_true")
    parser.add_argument("--deadline_s", type=float, default=1800.0, help="of each system's run")
    parser.add_argument("--out", default="benchmarks/results/convergence.jsonl")
    parser.add_argument("--png", default="benchmarks/results/convergence.png")
    parser.add_argument("--child_d", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_d is not None:
        return hetpipe_child(args)

    reference_ms = measure_reference_ms(args.seed)
    rows = []
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out:
        _emit(out, setup={"devices": {"speeds": SPEEDS, "memory": MEMORY}, "dilation": args.dilation,
                          "reference_ms": round(reference_ms, 3), "model": "cnn", "dataset": args.dataset,
                          "batch_size": 32, "optimizer": f"SGD lr={args.lr:g}, no momentum", "target": args.target,
                          "emulated": True, "load_average_at_start": os.getloadavg()})
        if args.skip_horovod or args.dataset != "hetpipe_digits":
            _emit(out, system="Horovod", skipped=("--skip_horovod" if args.skip_horovod else
                                                  "the Horovod baseline trains on the bundled digits only"))
        else:
            rows.append(horovod_row(args, reference_ms))
        for d in (int(x) for x in args.bounds.split(",") if x.strip()):
            rows.append(hetpipe_row(args, d))
        for row in rows:
            row["time_to_target_s"], row["epochs_to_target"] = time_to_target(row["curve"], args.target)
            _emit(out, **row)
        times = {r["system"]: r["time_to_target_s"] for r in rows}
        summary = {"time_to_target_s": times, "target": args.target,
                   "emulated": True, "all_faithful": all(r["emulation_faithful"] for r in rows)}
        d4, d0, hv = times.get("HetPipe D=4"), times.get("HetPipe D=0"), times.get("Horovod")
        if d4 is not None:
            if hv is not None:
                summary["D4_over_horovod"] = round(d4 / hv, 3)
            if d0 is not None:
                summary["D4_over_D0"] = round(d4 / d0, 3)
        summary["target_met"] = bool(d4 is not None and (hv is None or d4 < hv) and (d0 is None or d4 < d0))
        _emit(out, summary=True, **summary)
    if args.png:
        plot(rows, args.target, args.png, f"{args.dataset} cnn: Horovod vs HetPipe (ED-local, 2 virtual workers), "
                                          f"4 EMULATED devices 1/1/0.5/0.5, dilation {args.dilation:g}")


if __name__ == "__main__":
    main()
