"""Re-planning when a device slows down for good: static plan, re-planning and oracle (JSON lines).

On the ``local`` cluster (two EMULATED fast devices, two slow ones, policy ED: two virtual
workers of a fast and a slow device each, D = 0), one fast device becomes 3x slower for good once
a third of the run's minibatches are done (:class:`hetpipe_tf.pipeline.emulation.PersistentSlowdown`).
Three runs, side by side, alternated, the same profile and dilation for each:

* ``static``: the plan made before training, kept to the end;
* ``replan``: the same plan, re-planning on (:class:`hetpipe_tf.runtime.replan.runner.ReplanningRunner`);
* ``oracle``: the plan of the slowed device's speed, known from the start (the same planner).

The static and oracle runs are ReplanningRunners with re-planning off: one chunk per epoch, as a
checkpointing run trains. Per run: images/s over the whole run and steady after the switch
(between the completions of the run's minibatch `STEADY_FROM` and its last), images/s in each
tenth of the run (the series of the plot), the re-planning run's decisions and its switch's wall
time by parts (``retrace_s``: the first chunk after the switch over the next, the traces its new
stages make after their first update), and the emulation's overrun fraction. The last row gives the ratios the targets
name: replan steady / oracle steady (>= 0.9), replan / static over the whole run (>= 1.3),
the switch's wall time (<= 5 s).

    python benchmarks/replanning.py [--minibatches=1200] [--dilation=8] [--repeats=1] [--plot=PATH]
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BATCH, WIDTH, FACTOR, SLOWED = 32, 512, 3.0, "host-F:1"
STEADY_FROM = 0.6  # steady images/s from this share of a run's minibatches (after the switch)
BINS = 10


def _emit(**fields):
    print(json.dumps({"benchmark": "replanning", **fields}), flush=True)


def _model(keras):
    layers = [keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(6)]
    return keras.Sequential(layers + [keras.layers.Dense(10)])


def _data(tf, n=64):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n * BATCH, WIDTH)).astype("float32")
    y = rng.integers(0, 10, n * BATCH)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True).repeat()


def setup(dilation):
    """The model and its initial weights (every run starts from them), the cluster's devices in this
    process, the plan request, the static plan (of the model's measured profile) and the data."""
    import keras
    import tensorflow as tf

    from hetpipe_tf.distributed.cluster_devices import ClusterDevices
    from hetpipe_tf.planning.cluster import load_cluster
    from hetpipe_tf.planning.request import PlanRequest
    from hetpipe_tf.runtime import plan_assembly as assembly

    cluster = load_cluster("local")
    devices = ClusterDevices(cluster, "in_process")
    keras.utils.set_random_seed(0)
    model = _model(keras)
    initial = model.get_weights()
    training = assembly.Training(keras.optimizers.SGD(0.01, momentum=0.9),
                                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = _data(tf)
    profile = assembly.workload_profile(model, BATCH, None, training, lambda: next(iter(data)))
    request = PlanRequest(policy="ed", staleness_bound=0, dilation=dilation)
    static = assembly.assemble_plan(cluster, request, training.optimizer, profile)
    return model, initial, training, devices, request, static, data


def make_factory(model, devices, slowdowns):
    """Builds a WSPRunner of a plan: each worker on the cluster's devices (at their nominal speed,
    paced to the plan's profile), with the persistent slowdowns of its devices."""
    from hetpipe_tf.pipeline.emulation import PersistentSlowdown
    from hetpipe_tf.runtime.replan.decide import nominal_devices
    from hetpipe_tf.runtime.wsp_runner import WSPRunner

    def make(plan, config):
        specs = []
        for w in range(len(plan.workers)):
            own = nominal_devices(plan, w)
            spec, _ = devices.worker(w, own, plan.node_boundaries(w), plan.host_pass_seconds(w))
            slow = PersistentSlowdown.for_devices(slowdowns, [d.name for d in own])
            specs.append(spec if not any(slow) else _with_slowdown(spec, slow))
        return WSPRunner(model, specs, config, devices.ps)

    return make


def _with_slowdown(spec, slow):
    import dataclasses

    return dataclasses.replace(spec, slowdown=slow)


def run_one(kind, setup_, minibatches, dilation, options_on):
    import keras

    from hetpipe_tf.pipeline.emulation import PersistentSlowdown, RunProgress
    from hetpipe_tf.runtime import plan_assembly as assembly
    from hetpipe_tf.runtime.checkpoint import PlanCuts
    from hetpipe_tf.runtime.fit_loop import FitOptions, fit
    from hetpipe_tf.runtime.replan.decide import replanned
    from hetpipe_tf.runtime.replan.runner import ReplanningRunner, ReplanOptions
    from hetpipe_tf.runtime.optimizers import slots_per_weight

    model, initial, training, devices, request, static, data = setup_
    import dataclasses

    progress = RunProgress(record=True)
    slow = [PersistentSlowdown(SLOWED, FACTOR, progress, after_minibatches=minibatches // 3)]
    slots = slots_per_weight(training.optimizer)
    plan = static
    if kind == "oracle":
        plan = replanned(static, request, {SLOWED: 1.0 / FACTOR}, dilation, slots)
    fresh = keras.optimizers.SGD(0.01, momentum=0.9)
    config = assembly.resolved_config(request, plan, PlanCuts.of_plan(plan),
                                      dataclasses.replace(training, optimizer=fresh))
    options = ReplanOptions(enabled=(kind == "replan"), **options_on)
    runner = ReplanningRunner(plan, request, config, make_factory(model, devices, slow), options, slots, progress)
    workers = len(plan.workers)
    epochs = 3
    per_epoch = minibatches // epochs
    runner.set_fit_length(per_epoch * epochs)
    model.set_weights(initial)
    model.compile(optimizer=fresh, loss=training.loss)
    started = time.perf_counter()
    fit(runner, data, FitOptions(epochs=epochs, steps_per_epoch=per_epoch, verbose=0))
    wall = time.perf_counter() - started
    times = sorted(progress.completions)
    first = times[0] - (times[1] - times[0])
    n = len(times)
    total = n * BATCH / (times[-1] - first)
    k = int(n * STEADY_FROM)
    steady = (n - 1 - k) * BATCH / (times[-1] - times[k])
    edges = [first + (times[-1] - first) * i / BINS for i in range(BINS + 1)]
    series = [sum(1 for t in times if a < t <= b) * BATCH / (b - a) for a, b in zip(edges, edges[1:])]
    slowed_at = (times[minibatches // 3] - first) / (times[-1] - first)  # share of this run's wall time
    report = runner.emulation_report()
    for switch in runner.switches:  # traces made after its first update: its chunk's excess over the next
        i, log, took = switch["after_chunks"], runner.chunk_log, runner.chunk_seconds
        if i + 1 < len(log) and log[i] == log[i + 1]:
            switch["retrace_s"] = round(took[i] - took[i + 1], 4)
    row = {"run": kind, "images_per_s": total, "steady_images_per_s": steady, "minibatches": n,
           "images_per_s_by_tenth": [round(v, 1) for v in series], "slowdown_at_share": round(slowed_at, 3),
           "wall_s": round(wall, 2),
           "num_in_flight": plan.num_in_flight, "boundaries": [list(plan.node_boundaries(w)) for w in range(workers)],
           "predicted_images_per_s": plan.images_per_s,
           "decisions": runner.decisions, "switches": runner.switches,
           "emulated": True, "emulation": f"EMULATED devices (local cluster, dilation {dilation:g}), {SLOWED} "
                                         f"{FACTOR:g}x slower after {minibatches // 3} minibatches",
           "emulation_overrun_fraction": report.overrun_fraction if report else None}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatches", type=int, default=1200, help="of the run, every worker together")
    parser.add_argument("--dilation", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--chunk_minibatches", type=int, default=32)
    parser.add_argument("--window_waves", type=int, default=12)
    parser.add_argument("--plot", default=None, help="where to write the plot of images/s over time (PNG)")
    args = parser.parse_args()
    from hetpipe_tf.runtime.replan.watch import WatchRule

    setup_ = setup(args.dilation)
    options = {"chunk_minibatches": args.chunk_minibatches, "watch": WatchRule(window_waves=args.window_waves)}
    rows = {}
    for r in range(args.repeats):
        for kind in ("static", "replan", "oracle"):
            row = run_one(kind, setup_, args.minibatches, args.dilation, options)
            _emit(repeat=r, **row)
            rows.setdefault(kind, []).append(row)

    def mean(kind, key):
        return sum(x[key] for x in rows[kind]) / len(rows[kind])

    switches = [s for x in rows["replan"] for s in x["switches"]]
    parts = ("drain_s", "plan_s", "state_s", "rebuild_s", "retrace_s")
    _emit(summary=True,
          replan_steady_over_oracle=mean("replan", "steady_images_per_s") / mean("oracle", "steady_images_per_s"),
          replan_over_static=mean("replan", "images_per_s") / mean("static", "images_per_s"),
          oracle_over_static=mean("oracle", "images_per_s") / mean("static", "images_per_s"),
          switch_s=[round(sum(s.get(p, 0.0) for p in parts), 3) for s in switches],
          switch_parts=[{p: s.get(p) for p in parts} for s in switches],
          targets={"replan_steady_over_oracle": 0.9, "replan_over_static": 1.3, "switch_s": 5.0})
    if args.plot:
        _plot(rows, args.plot)


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for kind, xs in rows.items():
        series = xs[0]["images_per_s_by_tenth"]
        line, = ax.plot([(i + 0.5) / len(series) for i in range(len(series))], series, marker="o", label=kind)
        ax.axvline(xs[0]["slowdown_at_share"], color=line.get_color(), linestyle=":")  # when its third was done
    ax.plot([], [], color="grey", linestyle=":", label="slowdown (a third of the minibatches), per run")
    ax.set_xlabel("share of the run's wall time")
    ax.set_ylabel("images/s (EMULATED devices)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
