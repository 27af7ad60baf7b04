"""hetpipe-train: trains a model pipelined over the devices of one virtual worker, or over
several virtual workers under Wave Synchronous Parallel.

    hetpipe-train --model=cnn --devices=1@32M,0.5@32M,0.5@32M,0.25@32M --num_in_flight=4
    hetpipe-train --model=cnn --cluster=local --policy=ed --staleness_bound=1

Exit status: 2 for a usage error, 1 for a failed run, each in one line; --verbosity=1 or
HETPIPE_TRACEBACK=1 adds the traceback (:mod:`hetpipe_tf.cli.errors`).
"""
import dataclasses
import json
import os
from typing import Any

from absl import app, flags, logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up banners

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.cli import errors, models, plan_flags, train_flags
from hetpipe_tf.planning.cluster import DISCOVER, Cluster, from_device_specs, load_cluster
from hetpipe_tf.planning.devices import parse_devices
from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices

train_flags.define_flags()
FLAGS = flags.FLAGS


def _devices() -> str:
    if FLAGS.devices:
        return FLAGS.devices
    if FLAGS.num_stages:
        return ",".join(["1"] * FLAGS.num_stages)
    return train_flags.DEFAULT_DEVICES


def _auto_plan(model: Any, devices: str, optimizer: Any, loss: Any,
               batch_size: int) -> tuple[Any, tuple[int, ...], int]:
    """The planner's device order, stage boundaries and Nm for one virtual worker on `devices` (the plan
    assembly of every run, :mod:`hetpipe_tf.runtime.plan_assembly`, with the links measured between
    these devices, which are this process's own)."""
    from hetpipe_tf.runtime import plan_assembly as assembly  # late: defers TensorFlow
    from hetpipe_tf.runtime.discovery import spec_device_type, with_device_speeds  # late: defers TensorFlow
    from hetpipe_tf.runtime.profiler import random_minibatch  # late: defers TensorFlow

    cluster = from_device_specs(devices, name="devices", real=spec_device_type)
    profile = assembly.workload_profile(model, batch_size, assembly.loaded_profile(FLAGS.profile),
                                        assembly.Training(optimizer, loss))
    profile = with_device_speeds(profile, model, lambda: random_minibatch(model, batch_size), cluster, loss)
    names = configure_tensorflow_devices(devices)
    request = dataclasses.replace(plan_flags.plan_request(FLAGS), workers=(tuple(cluster.devices()),))
    chosen = assembly.assemble_plan(cluster, request, optimizer, profile,
                                    assembly.calibrated_links(cluster, names[0], names[-1]))
    print(chosen.format())
    by_type = {}
    for spec, device in zip(devices, cluster.devices_in_spec_order(devices, spec_device_type)):
        by_type.setdefault(device.type.name, []).append(spec)
    ordered = [by_type[d.type.name].pop() for d in chosen.workers[0].devices]
    return ordered, chosen.node_boundaries(0), chosen.num_in_flight


def _data_and_model() -> tuple[Any, Any, Any]:
    """The training and test splits and the model the flags ask for."""
    import keras  # late: defers TensorFlow

    from hetpipe_tf.data import datasets  # late: defers TensorFlow

    keras.utils.set_random_seed(FLAGS.seed)
    keras.config.set_dtype_policy(train_flags.MIXED_PRECISION[FLAGS.mixed_precision])
    if datasets.holds_token_sequences(FLAGS.dataset, FLAGS.data_dir):
        info = datasets.token_sequences_info(FLAGS.dataset, FLAGS.data_dir)
        load = dict(batch_size=FLAGS.batch_size, data_dir=FLAGS.data_dir)
        train = datasets.load_token_sequences(FLAGS.dataset, "train", shuffle=True, seed=FLAGS.seed, **load)
        test = datasets.load_token_sequences(FLAGS.dataset, "test", **load)
        return train, test, models.build_model(FLAGS.model, (info.sequence_length,), len(info.vocabulary))
    info = datasets.dataset_info(FLAGS.dataset, FLAGS.data_dir)
    side, channels = models.input_requirements(FLAGS.model)
    size = FLAGS.image_size or (side if side and side > info.image_shape[0] else None)
    channels = channels or info.image_shape[2]
    load = dict(batch_size=FLAGS.batch_size, data_dir=FLAGS.data_dir, image_size=size, channels=channels)
    train = datasets.load_image_classification(FLAGS.dataset, "train", shuffle=True, seed=FLAGS.seed, **load)
    test = datasets.load_image_classification(FLAGS.dataset, "test", **load)
    shape = tuple(train.element_spec[0].shape[1:])
    return train, test, models.build_model(FLAGS.model, shape, info.num_classes)


def _dataset_defaults() -> None:
    """The data set's own training defaults for the flags not given (hetpipe_addition's
    ``TRAINING_DEFAULTS``: 20 epochs, a global clip norm of 1)."""
    from hetpipe_tf.data import addition  # late: defers TensorFlow

    if FLAGS.dataset == addition.NAME:
        for name, value in addition.TRAINING_DEFAULTS.items():
            if not FLAGS[name].present:
                FLAGS[name].value = value


def _loss_and_metrics() -> tuple[Any, list[Any]]:
    """The loss and metrics of the flags' data set: hetpipe_addition's are its own (the answer
    tokens' cross-entropy, exact match), any other's the cross-entropy of logits and accuracy."""
    import keras  # late: defers TensorFlow

    from hetpipe_tf.data import addition  # late: defers TensorFlow

    if FLAGS.dataset == addition.NAME:
        return addition.loss(), [addition.exact_match]
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


def _show_answers(model: Any, test: Any) -> None:
    """Prints hetpipe_addition's first held-out sums with the model's greedy answers."""
    from hetpipe_tf.data import addition  # late: defers TensorFlow

    if FLAGS.dataset == addition.NAME:
        tokens, targets = next(iter(test))
        print("held-out sums, answered by greedy decoding:\n  " + "\n  ".join(
            addition.answer_lines(model, tokens[:8], targets[:8])))


def _test_metrics(final: dict[str, float]) -> dict[str, float]:
    """The last epoch's test metrics, by their names ("test_accuracy", "test_exact_match")."""
    return {f"test_{k[len('val_'):]}": v for k, v in final.items() if k.startswith("val_") and k != "val_loss"}


def _optimizer() -> Any:
    """The flags' optimizer; under float16, in a LossScaleOptimizer (as Keras's compile wraps it)."""
    import keras  # late: defers TensorFlow

    from hetpipe_tf.runtime.optimizers import by_name  # late: defers TensorFlow

    optimizer = by_name(FLAGS.optimizer, FLAGS.learning_rate, FLAGS.momentum, weight_decay=FLAGS.weight_decay,
                        global_clipnorm=FLAGS.global_clipnorm)
    return keras.optimizers.LossScaleOptimizer(optimizer) if FLAGS.mixed_precision == "fp16" else optimizer


def _train_virtual_workers(cluster: Cluster) -> None:
    """--cluster: several virtual workers under WSP on `cluster` (the flag's, loaded), planned and
    launched by HetPipeStrategy."""
    from hetpipe_tf.api.callbacks import WSPTensorBoard  # late: defers TensorFlow

    strategy = HetPipeStrategy(cluster=cluster, **plan_flags.request_arguments(FLAGS), launch=FLAGS.launch,
                               timeout_s=FLAGS.timeout_s, emulate_links=FLAGS.emulate_links,
                               checkpoint_dir=FLAGS.checkpoint_dir, save_every_epochs=FLAGS.save_every_epochs,
                               resume=FLAGS.resume, on_worker_failure=FLAGS.on_worker_failure, profile=FLAGS.profile,
                               replan=FLAGS.replan)
    with strategy.scope():
        train, test, model = _data_and_model()
        loss, metrics = _loss_and_metrics()
        model.compile(optimizer=_optimizer(), loss=loss, metrics=metrics)
    print(f"{FLAGS.model} on {FLAGS.dataset} {tuple(train.element_spec[0].shape[1:])}, "
          f"{model.count_params():,} parameters")
    callbacks = [WSPTensorBoard(FLAGS.tensorboard_dir, strategy)] if FLAGS.tensorboard_dir else []
    history = model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, validation_data=test,
                        callbacks=callbacks, trace_path=FLAGS.trace_file)
    print(strategy.describe())
    _show_answers(model, test)
    final = {k: round(float(v[-1]), 4) for k, v in history.history.items()}
    runner = strategy.runner
    summary = {"model": FLAGS.model, "dataset": FLAGS.dataset, "cluster": strategy.cluster.name,
               "policy": FLAGS.policy, "allocation": strategy.plan.allocation,
               "staleness_bound": FLAGS.staleness_bound, "num_in_flight": strategy.plan.num_in_flight,
               "minibatch_sizes": list(strategy.plan.sizes),
               **_test_metrics(final), "images_per_s": final.get("images_per_s"),
               "virtual_workers": runner.stats()}
    if strategy.cluster.emulated:
        summary["emulation"] = runner.emulation_report().as_dict()
    print("summary: " + json.dumps(summary))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # TFDS logs every pipeline it builds at INFO
    # What the flags name, checked before TensorFlow starts (a usage error then takes a fraction of a second).
    if FLAGS.cluster == DISCOVER:  # this machine's devices, which TensorFlow lists
        from hetpipe_tf.runtime.discovery import cluster_for  # late: imports TensorFlow, which lists them

        cluster: Cluster | None = cluster_for(FLAGS.cluster, FLAGS.launch)
    else:
        cluster = load_cluster(FLAGS.cluster) if FLAGS.cluster else None
    devices = None if cluster else parse_devices(_devices())
    import tensorflow as tf  # late: after the flags' checks, and threading is set before TensorFlow starts

    _dataset_defaults()
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
    if cluster:
        _train_virtual_workers(cluster)
        return
    from hetpipe_tf.api.callbacks import PipelineTensorBoard  # late: defers TensorFlow
    from hetpipe_tf.runtime.virtual_worker import VirtualWorker  # late: defers TensorFlow

    configure_tensorflow_devices(devices)  # before anything starts TensorFlow's runtime
    train, test, model = _data_and_model()
    shape = tuple(train.element_spec[0].shape[1:])
    optimizer = _optimizer()
    loss, metrics = _loss_and_metrics()
    boundaries = [int(b) for b in FLAGS.boundaries] if FLAGS.boundaries else None
    num_in_flight = FLAGS.num_in_flight
    if FLAGS.plan == "auto":
        devices, boundaries, num_in_flight = _auto_plan(model, devices, optimizer, loss, FLAGS.batch_size)
    vw = VirtualWorker(
        model, devices, num_in_flight=num_in_flight, boundaries=boundaries, optimizer=optimizer, loss=loss,
        metrics=metrics, dilation=FLAGS.dilation, timeout_s=FLAGS.timeout_s, schedule=FLAGS.schedule)
    print(f"{FLAGS.model} on {FLAGS.dataset} {shape}, {model.count_params():,} parameters")
    print(vw.describe())
    if FLAGS.show_schedule:
        print(vw.schedule(FLAGS.epochs * (FLAGS.steps_per_epoch or int(train.cardinality()))).format(3))
    callbacks = [PipelineTensorBoard(FLAGS.tensorboard_dir, vw)] if FLAGS.tensorboard_dir else []
    history = vw.fit(train, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch,
                     validation_data=test, callbacks=callbacks, trace_path=FLAGS.trace_file)
    _show_answers(model, test)
    final = {k: round(float(v[-1]), 4) for k, v in history.history.items()}
    summary = {"model": FLAGS.model, "dataset": FLAGS.dataset, "devices": [str(d) for d in vw.device_specs],
               "num_in_flight": vw.num_in_flight, **_test_metrics(final),
               "images_per_s": final.get("images_per_s"),
               "busy_fraction": [round(b, 3) for b in vw.report.busy_fraction()]}
    if vw.emulated:
        summary["emulation"] = vw.emulation_report().as_dict()
    print("summary: " + json.dumps(summary))
    if FLAGS.trace_file:
        print(f"pipeline trace written to {FLAGS.trace_file} (open it in https://ui.perfetto.dev)")


def run() -> None:
    errors.run(main, "hetpipe-train")


if __name__ == "__main__":
    run()
