"""TensorFlow's MultiWorkerMirroredStrategy baseline on emulated devices, in the main
venv (TensorFlow 2.21, Keras 3): hetpipe_tf's ``cnn`` on the bundled digits (``--model=gpt``: its
``gpt`` on hetpipe_addition's sums), one worker process per rank on loopback, each with its
TF_CONFIG, started by this script.

    .venv/bin/python benchmarks/baselines/mwms.py --workers=4 --speeds=1,0.67,0.4,0.33

The emulation, the leave-out rule, the training and the JSON line (``"system": "mwms"``,
printed by worker 0) are :mod:`benchmarks.baselines.ranks` and
:mod:`benchmarks.baselines.training`, as for Horovod. Workers whose memory cannot hold the
model are not started (TF_CONFIG lists the others).

Keras 3's ``model.fit`` is not used: the emulation paces the compute of a step apart from its
all-reduce, which fit runs as one function. The loop is ``strategy.run`` of a gradient step,
paced, then ``strategy.run`` of ``optimizer.apply_gradients``, where Keras 3's optimizer sums
the gradients over the replicas (each replica's loss is divided by the global batch, so the sum
is the mean over it).

Every process ends when this script does (:mod:`benchmarks.baselines.processes`); every wait
has a deadline: ``--deadline_s`` for the whole run, and each collective times out after it.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.baselines import processes, ranks  # noqa: E402


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (ranks) to start")
    p.add_argument("--deadline_s", type=float, default=1800, help="the most seconds the whole run may take")
    p.add_argument("--worker_rank", type=int, help=argparse.SUPPRESS)  # set by the launcher in each worker
    args = ranks.check(ranks.add_arguments(p).parse_args(argv))
    if args.workers < 1:
        raise ranks.BaselineOptionError(f"--workers={args.workers} must be >= 1")
    if args.deadline_s <= 0:
        raise ranks.BaselineOptionError(f"--deadline_s={args.deadline_s} must be > 0")
    ranks.speeds_and_dilation(args, args.workers)  # their errors before TensorFlow loads
    ranks.memories(args, args.workers)
    return args


def _plan(args, model):
    from benchmarks.baselines import training
    return ranks.plan(args, args.workers, training.model_need(model, args.batch_size))


def launch(argv, wrap=None):
    """Starts the admitted workers of `argv` (this script's flags), waits for them and returns
    worker 0's stdout (the lines about ranks left out and the JSON line). `wrap(rank, command)`,
    if given, is the command that starts worker `rank` (e.g. in a CPU-quota group:
    :meth:`hetpipe_tf.distributed.cgroups.CpuGroup.command`)."""
    args = arguments(argv)
    from benchmarks.baselines import training
    plan = _plan(args, training.build_model(args.model))
    ports = ranks.load_source("hetpipe_ports", "hetpipe_tf/distributed/ports.py").free_ports(len(plan.admitted))
    commands, envs = [], []
    for index, rank in enumerate(plan.admitted):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                   TF_CONFIG=json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                         "task": {"type": "worker", "index": index}}))
        command = [sys.executable, os.path.abspath(__file__), *argv, f"--worker_rank={rank}"]
        commands.append(wrap(rank, command) if wrap else command)
        envs.append(env)
    return processes.run_all(commands, args.deadline_s, envs)[0]


def run(argv, wrap=None):
    """Runs the baseline with `argv` (this script's flags) and returns its JSON line as a dict;
    `wrap` as :func:`launch`'s."""
    (line,) = processes.json_lines(launch(argv, wrap))
    return line


def worker(args):
    """One worker process: joins the cluster of TF_CONFIG, trains, and (worker 0) reports."""
    import keras
    import tensorflow as tf

    from benchmarks.baselines import training

    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    keras.utils.set_random_seed(args.seed)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=args.deadline_s))
    with strategy.scope():
        model = training.build_model(args.model)
        optimizer = keras.optimizers.SGD(args.lr)
        optimizer.build(model.trainable_variables)
    plan = _plan(args, model)
    index = plan.index(args.worker_rank)
    global_batch = args.batch_size * len(plan.admitted)
    loss = training.loss(args.model, reduction=None)

    def gradients(x, y):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(loss(y, model(x, training=True))) / global_batch
        return tape.gradient(total, model.trainable_variables)

    @tf.function
    def compute(x, y):
        return strategy.run(gradients, args=(x, y))

    # MWMS's all-reduce takes its destinations from the device of the value it reduces, and a
    # tensor that enters a tf.function as an argument has none: tf.identity gives it this one.
    @tf.function
    def apply(grads):
        strategy.run(lambda g: optimizer.apply_gradients(zip([tf.identity(t) for t in g],
                                                             model.trainable_variables)), args=(grads,))

    @tf.function
    def summed(values):
        return strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", tf.identity(v)),
                            args=(values,))

    def all_sum(values):
        return [float(v) for v in summed(tf.constant(values, tf.float64)).numpy()]

    line = training.run("mwms", args, plan, index, model, compute, apply, all_sum)
    if args.weights_out:
        training.save_weights(model, args.weights_out, f"rank_{args.worker_rank}")
    if index == 0:
        ranks.publish(plan, line, args.out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    if args.worker_rank is None:
        print(launch(argv), end="")
    else:
        worker(args)


if __name__ == "__main__":
    try:
        main()
    except (ranks.BaselineOptionError, processes.BaselineRunError) as error:
        sys.exit(f"mwms.py: {error}")
