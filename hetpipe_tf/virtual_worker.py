"""A virtual worker (HetPipe §3): one Keras model on k devices, trained as a pipeline (§4).

    vw = hetpipe_tf.VirtualWorker(model, devices="1@512M,0.5@256M", num_minibatches=2,
                                  optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = vw.fit(train_ds, epochs=5, validation_data=test_ds)

The model is cut into one stage per device (:mod:`hetpipe_tf.stage_rewrite`), the
HetPipe schedule (:mod:`hetpipe_tf.schedule`) keeps ``num_minibatches`` (Nm)
minibatches in flight, and the executor (:mod:`hetpipe_tf.executor`) runs it.
The trained weights are written back into the Keras model at the end, so
``model.evaluate``, ``predict`` and ``save`` work as usual.
"""
import queue
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from hetpipe_tf.devices import configure_tensorflow_devices, parse_devices
from hetpipe_tf.emulation import EmulationReport, MemoryAccount, Pacer
from hetpipe_tf.executor import PipelineExecutor
from hetpipe_tf.loss_head import LossHead
from hetpipe_tf.optimizers import check_optimizer
from hetpipe_tf.schedule import hetpipe_schedule
from hetpipe_tf.stage_rewrite import split_model
from hetpipe_tf.stage_runtime import StageRuntime, measure_stage_times
from hetpipe_tf.trace import TraceRecorder


class VirtualWorker:
    """Trains a Keras model pipelined over k devices with Nm minibatches in flight.

    Args:
      model: a built Sequential or functional Keras model.
      devices: one device per stage: DeviceSpecs or a string such as "1@512M,0.5@256M"
        (see :mod:`hetpipe_tf.devices`).
      num_minibatches: Nm, minibatches in flight (default: the number of stages). Nm = 1 is
        naive model parallelism.
      boundaries: the first layer call of each stage (default: balance a FLOP estimate over
        the devices' speeds).
      optimizer, loss, metrics, loss_weights: as for Keras ``compile``.
      dilation: multiplies every emulated device's slowdown (see :mod:`hetpipe_tf.emulation`).
      timeout_s: the longest the pipeline may go without progress before it fails.
      record_provenance: record which local updates each minibatch's weight version held.
      single_threaded_stages: run each stage's kernels on its own thread only (one core per
        stage on a CPU host). TensorFlow's single-threaded executor cannot move tensors between
        devices, so this needs every stage on the same device (e.g. devices="cpu,cpu").
    """

    def __init__(self, model, devices, num_minibatches=None, boundaries=None, optimizer="sgd",
                 loss=None, metrics=(), loss_weights=None, dilation=1.0, timeout_s=300.0,
                 record_provenance=False, single_threaded_stages=False):
        self.model = model
        self.device_specs = parse_devices(devices)
        self.device_names = configure_tensorflow_devices(self.device_specs)
        k = len(self.device_specs)
        self.num_in_flight = int(num_minibatches) if num_minibatches is not None else k
        if self.num_in_flight < 1:
            raise ValueError(f"num_minibatches (Nm) must be >= 1, got {num_minibatches}")
        self.optimizer = check_optimizer(optimizer)
        self.staged = split_model(model, boundaries=boundaries, num_stages=k,
                                  devices=self.device_names,
                                  speeds=[d.speed for d in self.device_specs])
        self.loss_head = LossHead(loss, self.staged.keras_graph.model.output_names,
                                  loss_weights=loss_weights, metrics=metrics)
        self.dilation = float(dilation)
        self.timeout_s = float(timeout_s)
        self.record_provenance = record_provenance
        if single_threaded_stages and len(set(self.device_names)) > 1:
            raise ValueError(f"single_threaded_stages needs every stage on one device, got "
                             f"{list(self.device_names)}: TensorFlow's single-threaded executor "
                             f"cannot move tensors between devices")
        self.single_threaded_stages = single_threaded_stages
        self.runtimes = None
        self.references = None
        self.report = None
        self.trace = None
        self._executor = None
        self._pacers = []  # of the current (or last) run

    @property
    def num_stages(self):
        return self.staged.num_stages

    @property
    def emulated(self):
        return any(d.emulated for d in self.device_specs)

    def emulation_report(self):
        """How faithful the time emulation was in the current (or last) run (None without emulated devices)."""
        return EmulationReport.combine(p.report() for p in self._pacers if p is not None)

    def busy_seconds(self):
        """Seconds each stage has spent running tasks in the current (or last) run."""
        return [r.busy_s for r in self._executor.reports] if self._executor else None

    def describe(self):
        lines = [f"virtual worker: {self.num_stages} stages, Nm={self.num_in_flight}"]
        for s, spec in zip(self.staged.stages, self.device_specs):
            lines.append(f"  {spec}: " + self.staged.describe().splitlines()[s.index])
        if self.emulated:
            lines.append(f"  EMULATED devices (dilation {self.dilation:g}): task times are padded, "
                         f"memory is accounted; see hetpipe_tf.emulation")
        return "\n".join(lines)

    def schedule(self, num_minibatches, snapshot_after=()):
        """The HetPipe schedule this worker runs for `num_minibatches` minibatches."""
        return hetpipe_schedule(self.num_stages, num_minibatches, self.num_in_flight,
                                input_stages=self.staged.input_stages(), snapshot_after=snapshot_after)

    # Building --------------------------------------------------------------------------
    def _build(self, batch_size):
        if self.runtimes is not None:
            return
        act = self.staged.graph.stage_activation_bytes(self.staged.boundaries, batch_size)
        last = self.num_stages - 1
        self.runtimes = []
        for s, (stage, spec, name) in enumerate(zip(self.staged.stages, self.device_specs, self.device_names)):
            memory = MemoryAccount(f"stage {s} ({spec})", spec.memory if spec.emulated else None)
            self.runtimes.append(StageRuntime(
                stage, name, self.num_in_flight, self.optimizer,
                loss_head=self.loss_head if s == last else None, memory=memory,
                activation_bytes=act[s], record_provenance=self.record_provenance,
                single_threaded=self.single_threaded_stages))

    def _calibrate(self, x, y):
        """Each stage's forward and backward time, measured alone: the emulation's references."""
        self.references = measure_stage_times(self.runtimes, self.staged.split_inputs, x, y)

    # Training --------------------------------------------------------------------------
    def train(self, data, num_minibatches, trace=False, on_minibatch_done=None, snapshot_after=(),
              on_snapshot=None, executor_hook=None):
        """Trains on `num_minibatches` minibatches from `data` (a tf.data.Dataset or an iterator
        of (inputs, labels)); returns the :class:`ExecutionReport`. Weights are written back into
        the Keras model at the end."""
        iterator = iter(data)
        first = next(iterator)
        x, y = first
        batch_size = int(tf.nest.flatten(x)[0].shape[0])
        self._build(batch_size)
        if self.references is None:
            self._calibrate(x, y)
        self._pacers = [Pacer(d.speed, self.dilation) if d.emulated else None for d in self.device_specs]
        recorder = None
        if trace:
            recorder = TraceRecorder(metadata=self._trace_metadata())
            self._name_trace(recorder)
        executor = PipelineExecutor(
            self.schedule(num_minibatches, snapshot_after=snapshot_after), self.runtimes,
            _chain(first, iterator), self.staged.split_inputs, pacers=self._pacers,
            references=self.references, timeout_s=self.timeout_s, trace=recorder,
            on_minibatch_done=on_minibatch_done, on_snapshot=on_snapshot)
        self._executor = executor
        if executor_hook:
            executor_hook(executor)
        try:
            self.report = executor.run()
        finally:
            self.trace = recorder
        self.report.batch_size = batch_size
        for rt in self.runtimes:
            rt.write_back()
        return self.report

    def _trace_metadata(self):
        meta = {"hetpipe_tf": "virtual worker", "num_in_flight": self.num_in_flight,
                "devices": [str(d) for d in self.device_specs]}
        if self.emulated:
            meta["emulation"] = (f"EMULATED devices: task times padded to max(actual, "
                                 f"{self.dilation:g} / speed * reference); memory accounted")
        return meta

    def _name_trace(self, recorder):
        label = " (EMULATED devices)" if self.emulated else ""
        recorder.name_process(0, f"virtual worker 0, Nm={self.num_in_flight}{label}")
        for s, spec in enumerate(self.device_specs):
            recorder.name_thread(0, s, f"stage {s}: {spec} [{self.device_names[s]}]")

    def fit(self, x, epochs=1, steps_per_epoch=None, callbacks=None, verbose="auto",
            validation_data=None, trace_path=None):
        """Trains like ``keras.Model.fit``: callbacks, History, progress bar, validation.

        The pipeline runs across epoch boundaries without draining. At the end of each
        epoch every stage records its state right after the epoch's last update, and that
        consistent state is written into the Keras model before validation and
        ``on_epoch_end`` (so ModelCheckpoint and friends see it).
        """
        dataset = x
        if steps_per_epoch is None:
            steps_per_epoch = int(dataset.cardinality())
            if steps_per_epoch <= 0:
                raise ValueError("steps_per_epoch is needed: the dataset's length is unknown or infinite")
        total = epochs * steps_per_epoch
        verbose = 1 if verbose == "auto" else verbose
        cbs = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                           model=self.model, verbose=verbose, epochs=epochs,
                                           steps=steps_per_epoch)
        events = queue.Queue()
        epoch_ends = [e * steps_per_epoch for e in range(1, epochs + 1)]
        holder = {}
        runner = threading.Thread(
            target=self._fit_runner, name="hetpipe-fit",
            args=(dataset.repeat(), total, epoch_ends, events, holder, trace_path is not None), daemon=True)
        self.model.stop_training = False
        if getattr(self.model, "optimizer", None) is None:
            self.model.optimizer = self.optimizer  # callbacks read and set its learning rate
        cbs.on_train_begin()
        runner.start()
        try:
            history_logs = self._fit_loop(cbs, events, holder, epochs, steps_per_epoch, validation_data)
        except BaseException:
            # A callback failed or the user interrupted: stop every stage before leaving.
            if "executor" in holder:
                holder["executor"].abort()
            runner.join(timeout=self.timeout_s)
            raise
        while runner.is_alive():
            runner.join(timeout=0.5)
        if "error" in holder:
            raise holder["error"]
        if trace_path and self.trace:
            self.trace.write(trace_path)
        cbs.on_train_end(history_logs)
        return self.model.history

    def _fit_runner(self, data, total, epoch_ends, events, holder, trace):
        def done(p, logs):
            events.put(("done", p, (logs, time.perf_counter())))

        def snapshot(p, states):
            events.put(("snapshot", p, states))

        def keep(executor):
            holder["executor"] = executor
            events.put(("started", None, time.perf_counter()))

        try:
            it = iter(data)
            first = next(it)
            holder["batch_size"] = int(tf.nest.flatten(first[0])[0].shape[0])
            self.train(_chain(first, it), total, trace=trace, on_minibatch_done=done,
                       snapshot_after=epoch_ends, on_snapshot=snapshot, executor_hook=keep)
        except BaseException as exc:  # noqa: BLE001 - re-raised in fit()
            holder["error"] = exc
        finally:
            events.put(("finished", None, None))

    def _fit_loop(self, cbs, events, holder, epochs, steps_per_epoch, validation_data):
        """fit()'s epochs and steps on this thread, fed by the training thread's events."""
        history_logs = {}
        stopped_at = None
        _, t_epoch = self._next_event(events, "started", holder)
        for epoch in range(epochs):
            cbs.on_epoch_begin(epoch)
            self._sync_optimizer(epoch * steps_per_epoch)
            sums, count = {}, 0
            for step in range(steps_per_epoch):
                cbs.on_train_batch_begin(step)
                p, (logs, t_done) = self._next_event(events, "done", holder)
                for k, v in logs.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
                running = {k: v / count for k, v in sums.items()}
                cbs.on_train_batch_end(step, running)
                self._sync_optimizer(p)
                if self.model.stop_training and stopped_at is None:
                    stopped_at = holder["executor"].request_stop()
                if stopped_at is not None and p >= stopped_at:
                    break
            epoch_logs = {k: v / max(count, 1) for k, v in sums.items()}
            # Throughput from when the updates completed, not from when this loop saw them.
            epoch_logs["images_per_s"] = count * holder["batch_size"] / (t_done - t_epoch)
            t_epoch = t_done
            if stopped_at is None:
                _, states = self._next_event(events, "snapshot", holder)
                for rt, state in zip(self.runtimes, states):
                    rt.write_back(state)
            if validation_data is not None:
                epoch_logs.update({f"val_{k}": v for k, v in self.evaluate(validation_data).items()})
            if self.emulated:
                epoch_logs["emulated_overrun_fraction"] = self.emulation_report().overrun_fraction
            cbs.on_epoch_end(epoch, epoch_logs)
            self._sync_optimizer(p)
            history_logs = epoch_logs
            if self.model.stop_training and stopped_at is None:
                stopped_at = holder["executor"].request_stop()
            if stopped_at is not None:
                break
        return history_logs

    def _sync_optimizer(self, completed):
        """Keeps the user's optimizer, which callbacks see as model.optimizer, and the stages'
        copies in step: its iteration count follows the completed updates (so a schedule's
        learning rate reads right), and a learning rate a callback set reaches every stage."""
        template = self.model.optimizer if self.model.optimizer is not None else self.optimizer
        template.iterations.assign(completed)
        if isinstance(template.get_config().get("learning_rate"), dict):
            return  # a schedule: every stage's copy computes it from its own iterations
        lr = float(template.learning_rate)
        for rt in self.runtimes:
            if float(rt.optimizer.learning_rate) != lr:
                rt.optimizer.learning_rate = lr

    @staticmethod
    def _next_event(events, kind, holder):
        """The payload of the next `kind` event from the training thread, or its error."""
        while True:
            got, p, payload = events.get()
            if got == kind:
                return p, payload
            if got == "finished":
                if "error" in holder:
                    raise holder["error"]
                raise RuntimeError(f"the pipeline finished while fit() waited for a {kind!r} event")

    def evaluate(self, dataset):
        """Loss and metrics of the Keras model's current weights on `dataset`, in inference mode."""
        sums, n = {}, 0
        for x, y in dataset:
            outputs = self.model(x, training=False)
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            labels = self.loss_head.split_labels(y)
            values = dict(self.loss_head.metrics(labels, outputs), loss=self.loss_head.loss(labels, outputs))
            b = int(tf.nest.flatten(x)[0].shape[0])
            for k, v in values.items():
                sums[k] = sums.get(k, 0.0) + float(v) * b
            n += b
        return {k: v / n for k, v in sums.items()}


def _chain(first, rest):
    yield first
    yield from rest
