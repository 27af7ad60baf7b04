"""The training of an all-reduce baseline on emulated devices, whatever does the all-reduce
(Horovod, MultiWorkerMirroredStrategy): TensorFlow with Keras 2 or 3, so both venvs use it.

The system gives each rank a `compute(x, y)` that returns the rank's gradients (forward and
backward, no communication), an `apply(gradients)` that all-reduces them and updates the
weights, and `all_sum(values)`, the sum over ranks of a list of numbers (also the barrier).
Splitting the step in two is what lets the compute alone be paced. A run, on every rank alike
(the collectives must meet):

1. Reference: each rank in turn, the others waiting at a barrier, times its compute step alone,
   the minimum of REFERENCE_RUNS runs after warm-up ones; the run's reference is the minimum
   over ranks (the host's solo time, as :mod:`hetpipe_tf.pipeline.emulation` wants). Or the
   given ``--reference_ms``, so that two systems emulate devices of the same absolute speed
   even where their TensorFlow builds compute the step at different speeds.
2. Dilation: the given one, or ``emulation.calibrate_dilation`` over probes of
   ``--probe_steps`` paced steps on every rank, each probe's overrun counted over all ranks;
   the weights the probes trained are put back afterwards.
3. Training: ``--epochs`` epochs; a step is compute, paced to ``dilation / speed * reference``,
   then all-reduce and apply, not paced. An epoch's time runs from a barrier to the barrier
   after its last step; the test accuracy after it is not timed.

Models and data (``--model``, :data:`benchmarks.baselines.ranks.DATASETS`): ``cnn`` on the
bundled digits (``hetpipe_tf/data/digits.npz``) read as ``hetpipe_tf.data`` reads them (train:
the first NUM_TRAIN examples; pixels 0..16 times 16, clipped to 255, over 255), its test
accuracy after each epoch; ``gpt`` on the sums of ``hetpipe_addition``
(:mod:`hetpipe_tf.data.addition`, generated as TFDS generates them), the answer tokens'
cross-entropy, exact match on the held-out sums. Both without TensorFlow Datasets, which the
Horovod venv lacks. Rank i of n trains on examples i, i + n, ... of the train split, shuffled
anew each epoch.
"""
import os
import time

import numpy as np
import tensorflow as tf

from benchmarks.baselines import ranks

NUM_TRAIN = 1437  # hetpipe_tf.data.digits.NUM_TRAIN (the test split is the last 360)
REFERENCE_RUNS = 10
WARMUP_RUNS = 3
OPTIMIZER_SLOTS = 0  # plain SGD (no momentum) keeps no slot per weight


def load_digits():
    """(x_train, y_train, x_test, y_test): float32 images (N, 8, 8, 1) in [0, 1], int32 labels."""
    with np.load(os.path.join(ranks.ROOT, "hetpipe_tf", "data", "digits.npz")) as data:
        images, labels = data["images"], data["labels"]
    x = (np.minimum(images.astype(np.int32) * 16, 255).astype(np.float32) / 255.0)[..., None]
    y = labels.astype(np.int32)
    return x[:NUM_TRAIN], y[:NUM_TRAIN], x[NUM_TRAIN:], y[NUM_TRAIN:]


def _addition():
    """:mod:`hetpipe_tf.data.addition`, loaded by path (NumPy and TensorFlow only)."""
    return ranks.load_source("hetpipe_addition", "hetpipe_tf/data/addition.py")


def load_data(model="cnn"):
    """(x_train, y_train, x_test, y_test) of `model`'s data set as NumPy arrays: the digits'
    images and labels, or the sums' tokens and next-token targets."""
    if model == "gpt":
        addition = _addition()
        return (*addition.examples(0, addition.NUM_TRAIN), *addition.examples(addition.NUM_TRAIN, addition.NUM_TEST))
    return load_digits()


def build_model(model="cnn"):
    """hetpipe_tf's `model` (``cnn`` or ``gpt``) for its data set, from its model zoo (loaded by path)."""
    models = ranks.load_source("hetpipe_models", "hetpipe_tf/cli/models.py")
    if model == "gpt":
        addition = _addition()
        return models.build_model("gpt", (addition.SEQUENCE_LENGTH,), len(addition.VOCABULARY))
    return models.build_model(model, (8, 8, 1), 10)


def loss(model="cnn", **reduction):
    """`model`'s training loss: the cross-entropy of logits (of the answer tokens only, for ``gpt``)."""
    if model == "gpt":
        return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=_addition().IGNORED,
                                                             **reduction)
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, **reduction)


def tokens_per_example(model):
    """The tokens a ``gpt`` example holds (its sequence length), None for images."""
    return _addition().SEQUENCE_LENGTH if model == "gpt" else None


def model_need(model, batch_size):
    """What a rank holds to train `model` on minibatches of `batch_size` (ranks.model_need)."""
    def nbytes(variables):
        return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)

    outputs = sum(int(np.prod([int(d) for d in layer.output.shape[1:]])) for layer in model.layers
                  if type(layer).__name__ != "InputLayer")
    return ranks.model_need(nbytes(model.trainable_weights), nbytes(model.non_trainable_weights),
                            batch_size * outputs * 4, OPTIMIZER_SLOTS)


def steps_per_epoch(args, count, examples=NUM_TRAIN):
    """Steps every rank takes per epoch: the full minibatches of the smallest shard of `examples`, or fewer."""
    available = (examples // count) // args.batch_size
    if args.steps_per_epoch > available:
        raise ranks.BaselineOptionError(
            f"--steps_per_epoch={args.steps_per_epoch} exceeds the {available} full minibatches of "
            f"{args.batch_size} in a shard of {examples // count} examples ({count} ranks)")
    if available == 0:
        raise ranks.BaselineOptionError(f"--batch_size={args.batch_size} exceeds a shard of "
                                        f"{examples // count} examples ({count} ranks)")
    return args.steps_per_epoch or available


def epoch_batches(x, y, index, count, args, epoch, steps):
    """The minibatches rank `index` of `count` trains on in `epoch`, as tensors."""
    shard = np.arange(index, len(x), count)
    order = np.random.default_rng([args.seed, epoch, index]).permutation(shard)
    b = args.batch_size
    return [(tf.constant(x[order[s * b:(s + 1) * b]]), tf.constant(y[order[s * b:(s + 1) * b]]))
            for s in range(steps)]


def paced_step(compute, apply, batch, pacer, reference):
    """One step: the compute paced to its emulated time, then the all-reduce and update, not paced."""
    started = time.perf_counter()
    gradients = compute(*batch)
    pacer.pace(started, reference)
    apply(gradients)


def solo_reference(compute, batch):
    """The minimum time of REFERENCE_RUNS compute steps on `batch`, after WARMUP_RUNS."""
    times = []
    for i in range(WARMUP_RUNS + REFERENCE_RUNS):
        started = time.perf_counter()
        compute(*batch)
        if i >= WARMUP_RUNS:
            times.append(time.perf_counter() - started)
    return min(times)


def accuracy(model, x, y):
    """The test metric: the share of images classified right, or of sums (int token arrays)
    whose every answer token is predicted right (exact match)."""
    if x.dtype.kind == "i":
        return float(np.mean(_addition().exact_match(y, model(x, training=False))))
    return float(np.mean(np.argmax(np.asarray(model(x, training=False)), axis=-1) == y))


def run(system, args, plan, index, model, compute, apply, all_sum):
    """Trains as the admitted rank `index` of `plan` (ranks.Plan); returns the run's JSON line
    (ranks.record) on every rank."""
    speeds = plan.speeds
    count = len(speeds)
    x, y, x_test, y_test = load_data(args.model)
    steps = steps_per_epoch(args, count, len(x))

    def barrier():
        all_sum([0.0])

    if getattr(args, "real_compute", False):
        return _real_compute_run(system, args, plan, index, model, compute, apply, all_sum, (x, y, x_test, y_test),
                                 steps)
    if args.reference_ms is None:
        references = [0.0] * count
        first = epoch_batches(x, y, index, count, args, 0, 1)[0]
        for turn in range(count):
            if turn == index:
                references[index] = solo_reference(compute, first)
            barrier()
        reference = min(all_sum(references))
    else:
        reference = args.reference_ms / 1e3

    def paced_epochs(dilation, epochs, steps_each, evaluate):
        pacer = ranks.emulation.Pacer(speeds[index], dilation)
        seconds, accuracies, host = [], [], ranks.emulation.HostCpu()
        for epoch in range(epochs):
            batches = epoch_batches(x, y, index, count, args, epoch, steps_each)
            barrier()
            if epoch == args.warmup_epochs:  # the epochs images/s counts
                host.start()
            started = time.perf_counter()
            for batch in batches:
                paced_step(compute, apply, batch, pacer, reference)
            barrier()
            seconds.append(time.perf_counter() - started)
            if evaluate:
                accuracies.append(accuracy(model, x_test, y_test))
        tasks, overran = all_sum([pacer.tasks, pacer.overran])
        report = ranks.emulation.EmulationReport(dilation, int(tasks), int(overran))
        return report, seconds, accuracies, host.busy_fraction()

    dilation, calibration = plan.dilation, ()
    if dilation is None:
        initial = [w.copy() for w in model.get_weights()]
        probe_steps = min(args.probe_steps, len(x) // count // args.batch_size)
        probe_epochs = -(-args.probe_steps // probe_steps)
        dilation, calibration = ranks.emulation.calibrate_dilation(
            lambda d: paced_epochs(d, probe_epochs, probe_steps, evaluate=False)[0])
        model.set_weights(initial)
    report, seconds, accuracies, host_busy = paced_epochs(dilation, args.epochs, steps, evaluate=index == 0)
    report = ranks.emulation.EmulationReport(dilation, report.tasks, report.overran, calibration)
    return ranks.record(system, args, plan, reference, report, seconds, accuracies,
                        images_per_epoch=steps * args.batch_size * count, steps_per_epoch=steps,
                        host_cpu_busy=host_busy, tokens_per_example=tokens_per_example(args.model))


def _real_compute_run(system, args, plan, index, model, compute, apply, all_sum, data, steps):
    """:func:`run` with ``--real_compute``: nothing paced, no reference, no dilation; the line also
    gives every rank's mean compute time of a step (forward and backward, timed on the rank) over
    the epochs images/s counts, and its share of the rank's wall time."""
    count = len(plan.speeds)
    x, y, x_test, y_test = data
    seconds, accuracies, host = [], [], ranks.emulation.HostCpu()
    compute_s, measured_s = 0.0, 0.0
    for epoch in range(args.epochs):
        batches = epoch_batches(x, y, index, count, args, epoch, steps)
        all_sum([0.0])
        if epoch == args.warmup_epochs:
            host.start()
        started = time.perf_counter()
        for batch in batches:
            step_started = time.perf_counter()
            gradients = compute(*batch)
            if epoch >= args.warmup_epochs:
                compute_s += time.perf_counter() - step_started
            apply(gradients)
        all_sum([0.0])
        seconds.append(time.perf_counter() - started)
        if epoch >= args.warmup_epochs:
            measured_s += seconds[-1]
        if index == 0:
            accuracies.append(accuracy(model, x_test, y_test))
    mine = [0.0] * (2 * count)
    mine[index], mine[count + index] = compute_s, measured_s
    totals = all_sum(mine)
    measured_steps = steps * (args.epochs - args.warmup_epochs)
    line = ranks.record(system, args, plan, None, None, seconds, accuracies,
                        images_per_epoch=steps * args.batch_size * count, steps_per_epoch=steps,
                        host_cpu_busy=host.busy_fraction(), tokens_per_example=tokens_per_example(args.model))
    line["compute_ms_per_step"] = [round(1e3 * c / measured_steps, 2) for c in totals[:count]]
    line["compute_share_of_wall"] = [round(c / w, 3) for c, w in zip(totals[:count], totals[count:])]
    return line


def save_weights(model, folder, name):
    """Writes the model's trainable weights (trainable_I) and non-trainable state (state_I) to
    folder/name.npz, to compare the ranks' copies."""
    os.makedirs(folder, exist_ok=True)
    arrays = {f"trainable_{i}": np.asarray(v.numpy()) for i, v in enumerate(model.trainable_weights)}
    arrays.update({f"state_{i}": np.asarray(v.numpy()) for i, v in enumerate(model.non_trainable_weights)})
    np.savez(os.path.join(folder, f"{name}.npz"), **arrays)
