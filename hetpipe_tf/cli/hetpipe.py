"""hetpipe: plan, simulate and launch HetPipe training on a cluster, and draw plans and traces.

    hetpipe plan --cluster=paper --model=resnet152 --policy=hd [--json] [--png=plan.png]
    hetpipe plan --cluster=paper --model=gpt2_medium --batch_size=4 --optimizer=adamw --policy=auto
    hetpipe plan --cluster=local --model=mlp --profile=mlp_profile.json   # as hetpipe-train --cluster=local
    hetpipe plan --cluster=discover --model=cnn   # this machine's devices, each type measured on the model
    hetpipe simulate --cluster=paper --model=vgg19 --policy=ed --placement=local --staleness_bound=4
    hetpipe launch --cluster=local -- hetpipe-train --cluster=local --launch=tf_config
    hetpipe trace plot TRACE.json [-o timeline.png]

`plan` prints the virtual workers and their device types, every stage's layer range,
predicted time and memory, Nm and the predicted throughput. Its planning flags are hetpipe-train's
(:mod:`hetpipe_tf.cli.plan_flags`, the same names and defaults) and it plans as a training run does
(:mod:`hetpipe_tf.runtime.plan_assembly`): with a run's flags and its ``--profile``, it prints the
plan that run trains. `simulate` runs the plan's schedules in the discrete-event simulator and
prints throughput, each device's busy fraction, and each worker's wait and idle time under the
staleness bound. `launch` starts the parameter-server and worker tasks of the cluster on this
machine, runs the command after ``--`` as their chief (TF_CONFIG set), and stops every task at its
end.
`--png` and `trace plot` draw a plan and a trace (``hetpipe-train --trace_file``) as PNG
pictures (:mod:`hetpipe_tf.cli.plots`; needs matplotlib: ``pip install 'hetpipe_tf[plot]'``).

Exit status: 2 for a usage error, 1 for a failed run, each in one line; --verbosity=1 or
HETPIPE_TRACEBACK=1 adds the traceback (:mod:`hetpipe_tf.cli.errors`).
"""
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up banners

from hetpipe_tf.cli import errors, hetpipe_flags, models, plan_flags  # noqa: E402 - after the environment TensorFlow reads
from hetpipe_tf.cli.plots import plot_plan, plot_trace  # noqa: E402 - after the environment TensorFlow reads

if TYPE_CHECKING:
    import keras

    from hetpipe_tf.planning.cluster import Cluster
    from hetpipe_tf.planning.planner import Plan
    from hetpipe_tf.planning.profile import Profile

hetpipe_flags.define_flags()
FLAGS = flags.FLAGS
COMMANDS = "plan, simulate, launch -- COMMAND [ARGS...], trace plot TRACE.json [-o PNG]"


def build_transformer(name: str) -> "keras.Model":
    """A GPT-2-sized language model (about 355M parameters for gpt2_medium): keras_hub's GPT2Backbone
    from its config in hetpipe_flags.TRANSFORMERS (random weights, nothing downloaded), with a Dense
    head over the vocabulary on its output (logits per position); its TransformerDecoder layers
    are atomic, so stages are cut between them."""
    import keras  # late: defers TensorFlow
    import keras_hub  # late: optional dependency (and defers TensorFlow)

    backbone = keras_hub.models.GPT2Backbone(**hetpipe_flags.TRANSFORMERS[name])
    logits = keras.layers.Dense(hetpipe_flags.TRANSFORMERS[name]["vocabulary_size"], name="lm_head")(backbone.output)
    return keras.Model(backbone.input, logits, name=name)


def make_plan() -> "Plan":
    """The plan the flags ask for: the plan assembly of every run (:mod:`hetpipe_tf.runtime.plan_assembly`),
    so that the flags of a hetpipe-train run (and its --profile) give that run's plan."""
    from hetpipe_tf.runtime import plan_assembly as assembly  # late: defers TensorFlow
    from hetpipe_tf.runtime.discovery import cluster_for  # late: defers TensorFlow
    from hetpipe_tf.runtime.optimizers import by_name  # late: defers TensorFlow

    cluster = cluster_for(FLAGS.cluster)
    request = dataclasses.replace(plan_flags.plan_request(FLAGS), method=FLAGS.method,
                                  time_budget_s=FLAGS.time_budget_s)
    optimizer = by_name(FLAGS.optimizer, momentum=FLAGS.momentum)  # only its slots matter to a plan
    profile = assembly.loaded_profile(FLAGS.profile) or _model_profile(cluster, optimizer)
    return assembly.assemble_plan(cluster, request, optimizer, profile)


def _model_profile(cluster: "Cluster", optimizer: "keras.optimizers.Optimizer") -> "Profile":
    """The profile of the model the flags name: measured on this host for a cluster whose devices this
    host serves or measures (as hetpipe-train measures it), else read from the model's graph (analytic
    times)."""
    measured = cluster.on_host or cluster.measured
    if measured and FLAGS.model in hetpipe_flags.TRANSFORMERS:
        raise app.UsageError(f"--model={FLAGS.model} can be planned for real GPUs (a cluster file or the paper "
                             f"preset), not for cluster '{cluster.name}', whose devices this host serves and measures")
    from hetpipe_tf.runtime import plan_assembly as assembly  # late: defers TensorFlow
    from hetpipe_tf.runtime.profiler import model_profile  # late: defers TensorFlow

    if FLAGS.model in hetpipe_flags.TRANSFORMERS:
        model = build_transformer(FLAGS.model)
    else:
        big = models.input_requirements(FLAGS.model)[0] is not None
        shape = tuple(int(x) for x in FLAGS.input_shape) if FLAGS.input_shape else ((224, 224, 3) if big else (8, 8, 1))
        classes = FLAGS.num_classes or (1000 if big else 10)
        model = models.build_model(FLAGS.model, shape, classes)
    if measured:
        import keras  # late: defers TensorFlow

        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        profile = assembly.workload_profile(model, FLAGS.batch_size, None, assembly.Training(optimizer, loss))
        from hetpipe_tf.distributed.node_speed import with_measured_speeds  # late: defers TensorFlow

        rng = np.random.default_rng(0)
        return with_measured_speeds(profile, model, lambda: (rng.random((FLAGS.batch_size, *shape), dtype="float32"),
                                                             rng.integers(0, classes, FLAGS.batch_size)), cluster, loss)
    length = FLAGS.sequence_length or hetpipe_flags.TRANSFORMERS.get(FLAGS.model, {}).get("max_sequence_length")
    return model_profile(model, FLAGS.batch_size, sequence_length=length)


def simulate_plan(p: "Plan", steps: int) -> dict[str, Any]:
    """Simulation of a plan: throughput, busy fractions, per-worker wait and idle (§8.4)."""
    from hetpipe_tf.planning.planner import simulate_plan as run  # late: loads for this command only (fast usage errors)
    return run(p, steps)


def trace_plot(trace_path: str) -> None:
    """`hetpipe trace plot`: the trace as a Gantt chart, into -o or beside the trace."""
    output = FLAGS.output or os.path.splitext(trace_path)[0] + ".png"
    drawn = plot_trace(trace_path, output)
    print(f"timeline of {drawn['spans']} spans on {len(drawn['rows'])} rows, {drawn['duration_s']:.2f} s"
          f"{' (EMULATED devices)' if drawn['emulated'] else ''}, written to {output}")


def main(argv: Sequence[str]) -> None:
    command = argv[1:]
    if command[:1] == ["launch"]:
        if len(command) < 2:
            raise app.UsageError("launch needs the command to run after --: hetpipe launch --cluster=... -- "
                                 "COMMAND [ARGS...]")
        from hetpipe_tf.distributed.launch import launch  # late: loads for this command only (fast usage errors)
        sys.exit(launch(FLAGS.cluster, command[1:], log_dir=FLAGS.task_log_dir, host=FLAGS.host,
                        timeout_s=FLAGS.timeout_s, emulate_links=FLAGS.emulate_links))
    if command[:2] == ["trace", "plot"]:
        if len(command) != 3:
            raise app.UsageError(f"trace plot takes one trace file, got {command[2:]}: "
                                 f"hetpipe trace plot TRACE.json [-o timeline.png]")
        trace_plot(command[2])
        return
    if command not in (["plan"], ["simulate"]):
        given = f"unknown command {' '.join(command)!r}" if command else "no command given"
        raise app.UsageError(f"{given}; the commands are: {COMMANDS} (flags: hetpipe --helpfull)")
    p = make_plan()
    if command == ["plan"]:
        print(json.dumps(p.to_dict(), indent=1) if FLAGS.json else p.format())
        if FLAGS.png:
            plot_plan(p, FLAGS.png)
            print(f"plan drawn to {FLAGS.png}")
        return
    report = simulate_plan(p, FLAGS.steps)
    if FLAGS.json:
        print(json.dumps(report, indent=1))
        return
    print(p.format().split("\n\n")[0])
    print(f"\nsimulated {FLAGS.steps} minibatches per worker, D={p.staleness_bound}: "
          f"{report['images_per_s']:.1f} images/s")
    for w in report["virtual_workers"]:
        print(f"  worker {w['index']} ({''.join(w['device_types'])}): busy "
              f"{', '.join(f'{b:.2f}' for b in w['busy_fraction'])}; average wait {w['average_wait_s'] * 1e3:.1f} ms, "
              f"idle {w['average_idle_s'] * 1e3:.1f} ms per wave")


def run() -> None:

    errors.run(main, "hetpipe")


if __name__ == "__main__":
    run()
