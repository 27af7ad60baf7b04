"""The Horovod baseline on emulated devices (issue 13): hetpipe_tf's ``cnn`` on the bundled digits
(``--model=gpt``: its ``gpt`` on hetpipe_addition's sums), data parallel with
``hvd.DistributedOptimizer`` over Gloo, in the Horovod venv (TensorFlow 2.15, Keras 2;
``benchmarks/horovod/setup.sh`` builds it):

    V=build/horovod-venv/bin
    $V/horovodrun --gloo -np 4 -H localhost:4 $V/python benchmarks/horovod/train_horovod.py \\
        --speeds=1,0.67,0.4,0.33

Each rank emulates a device (``--speeds`` or ``--slowdowns``, ``--memory``; the rules are
:mod:`benchmarks.baselines.ranks`'s, the loop :mod:`benchmarks.baselines.training`'s, both
shared with the MultiWorkerMirroredStrategy baseline). The first rank admitted prints the
lines about ranks left out and the run's JSON line (``"system": "horovod"``).

A step is split so that its compute alone is paced: the rank's gradients come from a
``tf.GradientTape`` (no communication), then ``DistributedOptimizer.minimize`` of the linear
surrogate sum(g * w), whose gradient is exactly those gradients g, all-reduces (averages) them
over the ranks and applies them (with a Keras 2 optimizer, Horovod all-reduces in
``minimize``/``compute_gradients``, not in ``apply_gradients``). The surrogate costs a
multiply-add per weight, negligible beside the step.

On CPU-quota nodes (``--kernel_thread_groups``, :mod:`benchmarks.quota_nodes`) a rank's threads
that run TensorFlow's kernels run in its device's group, the rest of the rank (Python, Horovod's
background thread and Gloo's, which all-reduce) on the host outside it: a device computes, its
host runs the runtime around it. The kernel threads are those TensorFlow's context makes at its
first op, its inter-op pool (which runs a tf.function's kernels: the step's compute and its
update) and intra-op pool; TensorFlow 2.15 leaves them unnamed, so they are found as the threads
that appear while the model is built.

Ranks left out by the memory rule still start (horovodrun starts -np of them) but train in
no collective: the others train in a Horovod process set of their own, and every rank meets
at a last barrier before exiting.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.baselines import ranks  # noqa: E402


def arguments(argv=None):
    parser = ranks.add_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--kernel_thread_groups", default="",
                        help="cgroup v1 cpu groups (directories), one per rank: each rank's kernel threads run in its "
                             "group, the rest of the rank outside")
    return ranks.check(parser.parse_args(argv))


def threads():
    """The ids of this process's threads."""
    return set(os.listdir("/proc/self/task"))


def kernel_threads_into(group, tids):
    """Moves threads `tids` of this process into the cgroup v1 group `group` (its ``tasks`` file takes
    thread ids); the others stay where the rank started. Raises BaselineOptionError if `tids` is empty."""
    if not tids:
        raise ranks.BaselineOptionError(f"TensorFlow made no thread at its first op here, so no kernel thread can "
                                        f"be put in {group}")
    fd = os.open(os.path.join(group, "tasks"), os.O_WRONLY)
    try:
        for tid in sorted(tids):  # one id per write
            os.write(fd, tid.encode())
    finally:
        os.close(fd)


def horovod_ranks():
    """(this rank, number of ranks) as horovodrun sets them, before hvd.init (whose process sets
    depend on them)."""
    try:
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    except KeyError:
        raise ranks.BaselineOptionError(
            "HOROVOD_RANK and HOROVOD_SIZE are not set: run this script with horovodrun, e.g. "
            "horovodrun --gloo -np 4 -H localhost:4 python benchmarks/horovod/train_horovod.py") from None


def main(argv=None):
    args = arguments(argv)
    rank, size = horovod_ranks()

    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf

    from benchmarks.baselines import training

    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    before = threads()
    tf.keras.utils.set_random_seed(args.seed)
    model = training.build_model(args.model)
    if args.kernel_thread_groups:  # the model's build ran TensorFlow's first op, which made its thread pools
        groups = args.kernel_thread_groups.split(",")
        if rank >= len(groups):
            raise ranks.BaselineOptionError(f"--kernel_thread_groups gives {len(groups)} groups for rank {rank}; "
                                            f"give one per rank")
        kernel_threads_into(groups[rank], threads() - before)
    plan = ranks.plan(args, size, training.model_need(model, args.batch_size))
    index = plan.index(rank)
    if len(plan.admitted) == size:
        hvd.init()
        process_set = hvd.global_process_set
    else:
        os.environ["HOROVOD_STALL_CHECK_DISABLE"] = "1"  # the left-out ranks wait at the last barrier
        process_set = hvd.ProcessSet(list(plan.admitted))
        hvd.init(process_sets=[process_set])

    if index is not None:
        optimizer = hvd_keras.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(args.lr),
                                                   process_set=process_set)
        loss = training.loss(args.model)
        hvd.broadcast_variables(model.variables, root_rank=plan.admitted[0], process_set=process_set)

        @tf.function
        def compute(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            return tape.gradient(value, model.trainable_variables)

        @tf.function
        def apply(gradients):
            weights = model.trainable_variables
            optimizer.minimize(lambda: tf.add_n([tf.reduce_sum(g * w) for g, w in zip(gradients, weights)]),
                               weights)

        def all_sum(values):
            summed = hvd.allreduce(tf.constant(values, tf.float64), op=hvd.Sum, process_set=process_set)
            return [float(v) for v in summed.numpy()]

        line = training.run("horovod", args, plan, index, model, compute, apply, all_sum)
        if args.weights_out:
            training.save_weights(model, args.weights_out, f"rank_{rank}")
        if index == 0:
            ranks.publish(plan, line, args.out)
    hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name="last_barrier")  # every rank, left out or not
    hvd.shutdown()


if __name__ == "__main__":
    try:
        main()
    except ranks.BaselineOptionError as error:
        sys.exit(f"train_horovod.py: {error}")
