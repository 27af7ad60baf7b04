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
    return ranks.check(ranks.add_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
                       .parse_args(argv))


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
    tf.keras.utils.set_random_seed(args.seed)
    model = training.build_model(args.model)
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
