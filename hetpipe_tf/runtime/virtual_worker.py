"""A virtual worker (HetPipe §3): one Keras model on k devices, trained as a pipeline (§4).

    vw = hetpipe_tf.VirtualWorker(model, devices="1@512M,0.5@256M", num_in_flight=2,
                                  optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = vw.fit(train_ds, epochs=5, validation_data=test_ds)

The model is cut into one stage per device (:mod:`hetpipe_tf.runtime.stage_rewrite`), the
schedule (HetPipe's by default, :mod:`hetpipe_tf.pipeline.hetpipe`) keeps ``num_in_flight``
(Nm) minibatches in flight, and the executor (:mod:`hetpipe_tf.pipeline.executor`) runs it.
The trained weights are written back into the Keras model at the end, so
``model.evaluate``, ``predict`` and ``save`` work as usual.
"""
import dataclasses
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from hetpipe_tf.pipeline.emulation import EmulationReport, MemoryAccount, Pacer, calibrate_dilation
from hetpipe_tf.pipeline.executor import ExecutionReport, PipelineExecutor
from hetpipe_tf.pipeline.instructions import Backward, Forward, Instruction
from hetpipe_tf.pipeline.schedule import NO_SYNC, PipelineSchedule, Schedule, WorkerUpdate, check_worker_update
from hetpipe_tf.planning.model_graph import SharedLayerError
from hetpipe_tf.pipeline.trace import TraceRecorder
from hetpipe_tf.planning.devices import DeviceSpec, parse_devices
from hetpipe_tf.runtime.checkpoint import skip_consumed
from hetpipe_tf.runtime.fit_loop import Events, FitOptions, done_event, fit
from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices
from hetpipe_tf.runtime.loss_head import LossHead
from hetpipe_tf.runtime.run_config import LossArgument, LossWeightsArgument, MetricsArgument, RunConfig, WorkerSpec
from hetpipe_tf.runtime.stage_rewrite import StagedModel, TiedVariable, split_model

from hetpipe_tf.runtime.stage import StageRuntime
from hetpipe_tf.runtime.stage.timing import measure_stage_times
from hetpipe_tf.sync.pipe_sgd import AllReduceBinding
from hetpipe_tf.sync.wsp import WorkerSync


class VirtualWorker:
    """Trains a Keras model pipelined over k devices with Nm minibatches in flight.

    Args:
      model: a built Sequential or functional Keras model.
      devices: one device per stage: DeviceSpecs or a string such as "1@512M,0.5@256M"
        (see :mod:`hetpipe_tf.planning.devices`).
      num_in_flight: Nm, minibatches in flight (default: the number of stages). Nm = 1 is
        naive model parallelism.
      boundaries: the first layer call of each stage (default: balance a FLOP estimate over
        the devices' speeds).
      optimizer, loss, metrics, loss_weights: as for Keras ``compile``.
      dilation: multiplies every emulated device's slowdown (see :mod:`hetpipe_tf.pipeline.emulation`);
        None (default): chosen by probe runs before the first training, so that the emulation
        stays faithful (:meth:`calibrate_dilation`); the worker then keeps it.
      timeout_s: the longest the pipeline may go without progress before it fails.
      record_provenance: record which local updates each minibatch's weight version held.
      single_threaded_stages: run each stage's kernels on its own thread only (one core per
        stage on a CPU host). TensorFlow's single-threaded executor cannot move tensors between
        devices, so this needs every stage on the same device (e.g. devices="cpu,cpu").
      tf_devices: the TensorFlow device of each stage, when not this process's own (e.g.
        "/job:worker/task:1/device:CPU:0" on TensorFlow's distributed runtime).
      sync: this worker's binding to the others when it is one of several (for Wave Synchronous
        Parallel, §5, a :class:`hetpipe_tf.sync.wsp.WorkerSync`); its ``scheme`` is the
        :class:`hetpipe_tf.pipeline.schedule.SyncScheme` that adds instructions to the schedule
        and carries them out.
      schedule: the pipelining schedule, a registered name or a
        :class:`hetpipe_tf.pipeline.schedule.PipelineSchedule` (default: HetPipe's, §4).
      references: per stage, the (forward, backward) seconds of its passes on this host that its
        emulated device's pace is scaled from (:mod:`hetpipe_tf.pipeline.emulation`), such as
        :meth:`hetpipe_tf.planning.planner.Plan.host_pass_seconds` gives from a profile. None
        (default): each stage's passes are timed alone before training (:meth:`prepare`).
      slowdown: minibatch id -> factor >= 1 by which every emulated device of this worker is
        slower for that minibatch (a transient straggler; see :class:`hetpipe_tf.pipeline.emulation.Pacer`),
        or a tuple of such (or None), one per device in stage order (a device's own slowdown:
        :meth:`hetpipe_tf.pipeline.emulation.PersistentSlowdown.for_devices`).
    """

    def __init__(self, model: keras.Model, devices: Sequence[DeviceSpec] | str, num_in_flight: int | None = None,
                 boundaries: tuple[int, ...] | None = None, optimizer: keras.optimizers.Optimizer | str = "sgd",
                 loss: LossArgument = None, metrics: MetricsArgument = (), loss_weights: LossWeightsArgument = None,
                 dilation: float | None = None, timeout_s: float = 300.0, record_provenance: bool = False,
                 single_threaded_stages: bool = False, tf_devices: tuple[str, ...] | None = None,
                 sync: WorkerSync | AllReduceBinding | None = None,
                 slowdown: Callable[[int], float] | tuple[Callable[[int], float] | None, ...] | None = None,
                 schedule: PipelineSchedule | str = "hetpipe",
                 references: Sequence[tuple[float, float]] | None = None) -> None:
        # Nm defaults to the number of stages, one per device (§4): resolved here, once.
        num_in_flight = len(parse_devices(devices)) if num_in_flight is None else num_in_flight
        config = RunConfig(num_in_flight=num_in_flight, schedule=schedule, optimizer=optimizer, loss=loss,
                           metrics=metrics, loss_weights=loss_weights, dilation=dilation, timeout_s=timeout_s,
                           record_provenance=record_provenance, single_threaded_stages=single_threaded_stages)
        self._setup(model, WorkerSpec(devices, tf_devices=tf_devices, boundaries=boundaries, slowdown=slowdown,
                                      references=references), config, sync)

    @classmethod
    def from_config(cls, model: keras.Model, spec: WorkerSpec, config: RunConfig,
                    sync: WorkerSync | AllReduceBinding | None = None) -> "VirtualWorker":
        """The virtual worker `spec` of a run configured by `config` (resolved: its Nm an integer);
        `sync`: its binding to the other workers, if any."""
        if config.num_in_flight is None:
            raise ValueError("a run's RunConfig gives num_in_flight (Nm) as an integer, got None: the plan "
                             "decides it (VirtualWorker(num_in_flight=None) takes the number of stages)")
        vw = cls.__new__(cls)
        vw._setup(model, spec, config, sync)
        return vw

    def _setup(self, model: keras.Model, spec: WorkerSpec, config: RunConfig,
               sync: WorkerSync | AllReduceBinding | None) -> None:
        self.model = model
        self.device_specs = parse_devices(spec.devices)
        k = len(self.device_specs)
        if spec.tf_devices is not None and len(spec.tf_devices) != k:
            raise ValueError(f"{k} devices but {len(spec.tf_devices)} TensorFlow devices")
        self.device_names = tuple(spec.tf_devices) if spec.tf_devices is not None else configure_tensorflow_devices(
            self.device_specs)
        if config.single_threaded_stages and len(set(self.device_names)) > 1:
            raise ValueError(f"single_threaded_stages needs every stage on one device, got "
                             f"{list(self.device_names)}: TensorFlow's single-threaded executor "
                             f"cannot move tensors between devices")
        self.config = config
        self.spec = spec
        self.sync = sync
        self.slowdown = spec.slowdown
        self.staged = split_model(model, boundaries=spec.boundaries, num_stages=k, devices=self.device_names,
                                  speeds=[d.speed for d in self.device_specs])
        #: The weights several stages hold a replica of (a layer several stages call): each replica
        #: applies the replicas' summed gradient (hetpipe_tf.runtime.update_terms).
        self.ties = tuple(t for t in self.staged.tied if t.trainable)
        _refuse_untrainable_ties(self.staged)
        #: What the stages share before an update (hetpipe_tf.pipeline.schedule.WorkerUpdate).
        self.worker_update = worker_update_of(self.config, self.ties, k)
        self.loss_head = LossHead(config.loss, self.staged.keras_graph.model.output_names,
                                  loss_weights=config.loss_weights, metrics=config.metrics)
        # This worker's own run's dilation, decided once (given, or calibrated at the first train).
        self._dilation = None if config.dilation is None else Dilation(config.dilation)
        self.runtimes: list[StageRuntime] | None = None
        self.references: list[dict[type[Instruction], float]] | None = (
            None if spec.references is None else _given_references(spec.references, k))
        self.report: ExecutionReport | None = None
        self.trace: TraceRecorder | None = None
        self._executor: PipelineExecutor | None = None
        self._pacers: list[Pacer | None] = []  # of the current (or last) run
        self._stash_capacity = 0  # the versions each stage's stash holds, once built (the Nm it was built for)

    @property
    def num_in_flight(self) -> int:
        """Nm, the minibatches in this worker's pipeline at once (§4)."""
        return self.config.num_in_flight

    @property
    def optimizer(self) -> keras.optimizers.Optimizer | str:
        return self.config.optimizer

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        return self.config.schedule

    @property
    def num_stages(self) -> int:
        return self.staged.num_stages

    @property
    def emulated(self) -> bool:
        return any(d.emulated for d in self.device_specs)

    @property
    def dilation(self) -> "Dilation | None":
        """This worker's own dilation, once decided (given, or calibrated); a runner of several
        workers decides theirs (their train's `dilation`)."""
        return self._dilation

    def emulation_report(self) -> EmulationReport | None:
        """How faithful the time emulation was in the current (or last) run (None without emulated
        devices), with this worker's own calibration when it was calibrated."""
        report = EmulationReport.combine(p.report() for p in self._pacers if p is not None)
        probes = self._dilation.probes if self._dilation is not None else ()
        return report and dataclasses.replace(report, calibration=probes)

    def task_seconds(self, stage: int, kind: type[Instruction]) -> float:
        """The time a task of instruction type `kind` (Forward, Backward) takes on `stage` in the
        current (or last) run: its solo reference time, padded to the emulated device's target."""
        if self.references is None:
            raise ValueError("no solo task times: a worker of real devices measures them only when asked "
                             f"(measure_solo_times); this one's are {list(self.device_names)}")
        reference = self.references[stage][kind]
        pacer = self._pacers[stage] if self._pacers else None
        return pacer.target(reference) if pacer is not None else reference

    def busy_seconds(self) -> list[float] | None:
        """Seconds each stage has spent running tasks in the current (or last) run."""
        return [r.busy_s for r in self._executor.reports] if self._executor else None

    def describe(self) -> str:
        lines = [f"virtual worker: {self.num_stages} stages, Nm={self.num_in_flight}"]
        for s, spec in zip(self.staged.stages, self.device_specs):
            lines.append(f"  {spec}: " + self.staged.describe().splitlines()[s.index])
        if self.emulated:
            dilation = "calibrated before training" if self.config.dilation is None else f"{self.config.dilation:g}"
            lines.append(f"  EMULATED devices (dilation {dilation}): task times are padded, "
                         f"memory is accounted; see hetpipe_tf.pipeline.emulation")
        return "\n".join(lines)

    def schedule(self, steps: int, snapshot_after: Collection[int] = (), synchronised: bool = True) -> Schedule:
        """The schedule this worker runs for `steps` minibatches."""
        sync = self.sync.scheme if synchronised and self.sync is not None else NO_SYNC
        worker_update = {"worker_update": self.worker_update} if self.worker_update else {}
        return self.pipeline_schedule.programs(self.num_stages, steps, self.num_in_flight,
                                               input_stages=self.staged.input_stages(),
                                               snapshot_after=snapshot_after, sync=sync, **worker_update)

    # Building --------------------------------------------------------------------------
    def can_go_on_as(self, other: "VirtualWorker") -> bool:
        """Whether this worker, built and drained, trains as `other` (the same worker of another
        plan, not built) would once built: the same devices, stages, slowdowns and emulation
        references, and a configuration that differs at most in Nm (up to the versions this
        worker's stashes hold), the placement of the global weights and the dilation. A stage's
        state is then what `other`'s would be built with (the global weights, its optimizer's
        state), and the calls it traced serve as they are."""
        if self.runtimes is None or other.num_in_flight > self._stash_capacity:
            return False
        return self.config.same_run(other.config) and self.spec.same_stages(other.spec)

    def go_on_under(self, config: RunConfig) -> None:
        """Trains on under `config` (see :meth:`can_go_on_as`): its Nm, placement and dilation."""
        self.config = config
        self._dilation = None if config.dilation is None else Dilation(config.dilation)

    def _build(self, batch_size: int) -> None:
        if self.runtimes is not None:
            return
        self._stash_capacity = self.num_in_flight
        act = self.staged.graph.stage_activation_bytes(self.staged.boundaries, batch_size)
        last = self.num_stages - 1
        paths = [[v.path for v in stage.trainable_variables] for stage in self.staged.stages]
        self.runtimes = []
        for s, (stage, spec, name) in enumerate(zip(self.staged.stages, self.device_specs, self.device_names)):
            memory = MemoryAccount(f"stage {s} ({spec})", spec.memory if spec.emulated else None)
            self.runtimes.append(StageRuntime(
                stage, name, self.config, loss_head=self.loss_head if s == last else None, memory=memory,
                activation_bytes=act[s], sync=self.sync.scheme if self.sync is not None else NO_SYNC,
                variable_paths=paths, worker_update=self.worker_update, ties=self.ties))

    def measure_solo_times(self, x: Any, y: Any) -> None:
        """Each stage's forward and backward time on minibatches like (x, y), measured alone: the
        references an emulated device paces to (taken before training, :meth:`prepare`), or a real
        worker's durations for the simulator. The minimum of 63 runs (the minimum of a few varies
        by a tenth or more between workers on a shared host)."""
        self.references = measure_stage_times(self.runtimes, self.staged.split_inputs, x, y, repeats=63)

    def prepare(self, x: Any, y: Any) -> int:
        """Builds the stages for minibatches like (x, y) and, when a device is emulated, measures
        their solo times (once: what the emulation paces to); returns the batch size."""
        batch_size = int(tf.nest.flatten(x)[0].shape[0])
        self._build(batch_size)
        self.loss_head.check(y, self.staged.keras_graph.model.outputs)
        if self.references is None and self.emulated:
            self.measure_solo_times(x, y)
        return batch_size

    # Training --------------------------------------------------------------------------
    def train(self, data: Iterable[Any], steps: int, trace: bool | TraceRecorder = False,
              on_minibatch_done: Callable[[int, dict[str, Any]], None] | None = None,
              snapshot_after: Collection[int] = (), on_snapshot: Callable[[int, list[Any]], None] | None = None,
              executor_hook: Callable[[PipelineExecutor], None] | None = None,
              dilation: "Dilation | None" = None) -> ExecutionReport:
        """Trains on `steps` minibatches from `data` (a tf.data.Dataset or an iterator
        of (inputs, labels)); returns the :class:`ExecutionReport`. Weights are written back into
        the Keras model at the end. `trace` is True or a TraceRecorder to add to. `dilation`: the
        run's, when a runner of several workers decided it; None: this worker's own (calibrated
        before its first training when not given)."""
        iterator = iter(data)
        first = next(iterator)
        batch_size = self.prepare(*first)
        if dilation is None:
            if self._dilation is None:
                self.calibrate_dilation(first)
            dilation = self._dilation
        self.report = self._run(_chain(first, iterator), steps, dilation, trace=trace,
                                on_minibatch_done=on_minibatch_done, snapshot_after=snapshot_after,
                                on_snapshot=on_snapshot, executor_hook=executor_hook)
        self.report.batch_size = batch_size
        if self.sync is None:  # under WSP the global weights are what the model gets
            for rt in self.runtimes:
                rt.write_back()
        return self.report

    def _run(self, iterator: Iterator[Any], steps: int, dilation: "Dilation", trace: bool | TraceRecorder = False,
             on_minibatch_done: Callable[[int, dict[str, Any]], None] | None = None,
             snapshot_after: Collection[int] = (), on_snapshot: Callable[[int, list[Any]], None] | None = None,
             executor_hook: Callable[[PipelineExecutor], None] | None = None, synchronised: bool = True,
             dry: bool = False) -> ExecutionReport:
        slowdowns = self.slowdown if isinstance(self.slowdown, tuple) else (self.slowdown,) * len(self.device_specs)
        self._pacers = [Pacer(d.speed, dilation.value, slowdown=f) if d.emulated else None
                        for d, f in zip(self.device_specs, slowdowns)]
        recorder = None
        if trace:
            recorder = trace if isinstance(trace, TraceRecorder) else TraceRecorder(
                metadata=self.trace_metadata(dilation))
            self._name_trace(recorder)
        sync = self.sync if synchronised else None
        handlers = None if sync is None else sync.scheme.dry_handlers() if dry else sync.scheme.handlers(sync)
        executor = PipelineExecutor(
            self.schedule(steps, snapshot_after=snapshot_after, synchronised=synchronised),
            self.runtimes, iterator, self.staged.split_inputs, pacers=self._pacers,
            references=self.references, timeout_s=self.config.timeout_s, trace=recorder,
            on_minibatch_done=on_minibatch_done, on_snapshot=on_snapshot,
            sync_handlers=handlers,
            pid=self.sync.worker if self.sync else 0)
        self._executor = executor
        if executor_hook:
            executor_hook(executor)
        try:
            report = executor.run()
        finally:
            self.trace = recorder
        if sync is not None and not dry:
            sync.scheme.run_ended(sync)
        return report

    # Emulation -------------------------------------------------------------------------
    def probe_minibatches(self, workers: int = 1) -> int:
        """How many minibatches a calibration probe runs: at least 3 waves, and about 120 paced
        tasks over `workers` such workers running together."""
        return max(3 * self.num_in_flight, -(-120 // (2 * self.num_stages * workers)))

    def probe_emulation(self, minibatch: Any, dilation: float, steps: int | None = None) -> EmulationReport | None:
        """Runs the pipeline on copies of `minibatch` at `dilation` and keeps nothing of it
        (every stage's state is restored); returns the run's EmulationReport. A synchronised
        worker runs its scheme's dry handlers (the same work on the stages, no server)."""
        steps = steps or self.probe_minibatches()
        states = [rt.snapshot() for rt in self.runtimes]
        try:
            dry = self.sync is not None and self.sync.scheme.dry_handlers() is not None
            report = self._run(iter([minibatch] * steps), steps, Dilation(dilation), synchronised=dry, dry=dry)
        finally:
            for rt, state in zip(self.runtimes, states):
                rt.restore(state)
        return report.emulation

    def calibrate_dilation(self, minibatch: Any, **calibration: Any) -> "Dilation":
        """Decides this worker's own dilation, when none was given, by probe runs on copies of
        `minibatch` (:func:`decide_dilation`; `calibration`: the arguments of
        :func:`hetpipe_tf.pipeline.emulation.calibrate_dilation`, such as its candidates)."""
        if self._dilation is not None:
            raise ValueError(f"this virtual worker's dilation is decided ({self._dilation.value:g}): a worker "
                             f"calibrates once, before its first training; give VirtualWorker(dilation=None) to "
                             f"calibrate")
        self._dilation = decide_dilation(None, self.emulated, lambda d: self.probe_emulation(minibatch, d),
                                         **calibration)
        return self._dilation

    def trace_metadata(self, dilation: "Dilation | None") -> dict:
        """What a trace of this worker says about it (devices, Nm, and the emulation's rule at
        `dilation` when emulated)."""
        meta = {"hetpipe_tf": "virtual worker", "num_in_flight": self.num_in_flight,
                "devices": [str(d) for d in self.device_specs]}
        if self.emulated:
            meta["emulation"] = (f"EMULATED devices: task times padded to max(actual, "
                                 f"{dilation.value:g} / speed * reference); memory accounted")
        return meta

    def _name_trace(self, recorder: TraceRecorder) -> None:
        label = " (EMULATED devices)" if self.emulated else ""
        pid = self.sync.worker if self.sync else 0
        recorder.name_process(pid, f"virtual worker {pid}, Nm={self.num_in_flight}{label}")
        for s, spec in enumerate(self.device_specs):
            recorder.name_thread(pid, s, f"stage {s}: {spec} [{self.device_names[s]}]")
            if self.sync:
                recorder.name_thread(pid, 100 + s, f"stage {s}: waits for pulled weights")
                recorder.name_thread(pid, 200 + s, f"stage {s}: pushes to the parameter servers")

    def fit(self, x: Any, epochs: int = 1, steps_per_epoch: int | None = None,
            callbacks: Sequence[keras.callbacks.Callback] | None = None, verbose: str | int = "auto",
            validation_data: Any = None, trace_path: str | None = None) -> keras.callbacks.History:
        """Trains like ``keras.Model.fit``: callbacks, History, progress bar, validation
        (:func:`hetpipe_tf.runtime.fit_loop.fit`).

        The pipeline runs across epoch boundaries without draining. At the end of each
        epoch every stage records its state right after the epoch's last update, and that
        consistent state is written into the Keras model before validation and
        ``on_epoch_end`` (so ModelCheckpoint and friends see it).
        """
        return fit(self, x, FitOptions(epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks,
                                       verbose=verbose, validation_data=validation_data, trace_path=trace_path))

    # What fit asks of a runner (hetpipe_tf.runtime.fit_loop.Runner) ------------------------
    num_workers = 1

    def begin_fit(self, shards: Sequence[tf.data.Dataset], positions: Sequence[int]) -> None:
        # The next minibatch is made while the first stage runs the last one's passes: the first
        # stage's thread then takes a minibatch that is ready instead of waiting, on every
        # minibatch, for the input pipeline's threads to make it.
        self._fit_data = iter(skip_consumed(shards, positions)[0].prefetch(1))

    def release_fit_data(self) -> None:
        self._fit_data = None

    def train_segment(self, steps: Sequence[int], events: Events, first: bool, trace: bool,
                      epoch_ends: Sequence[int]) -> None:

        def started(executor: PipelineExecutor) -> None:
            self._executor = executor
            if first:
                events.put("started", time.perf_counter())

        self.train(self._fit_data, steps[0], trace=trace, on_minibatch_done=done_event(events), snapshot_after=epoch_ends,
                   on_snapshot=lambda p, states: events.put("snapshot", states), executor_hook=started)

    def epoch_weights(self, events: Events, stopped: bool) -> None:
        if not stopped:
            for rt, state in zip(self.runtimes, events.get("snapshot")):
                rt.write_back(state)

    def stage_optimizers(self) -> list[keras.optimizers.Optimizer]:
        return [rt.optimizer for rt in self.runtimes or []]

    def request_stop(self) -> None:
        if self._executor is not None:
            self._executor.request_stop()

    def abort(self) -> None:
        if self._executor is not None:
            self._executor.abort()

    def evaluate(self, dataset: tf.data.Dataset) -> dict:
        """Loss and metrics of the Keras model's current weights on `dataset`, in inference mode."""
        return self.loss_head.evaluate(self.model, dataset)


@dataclasses.dataclass(frozen=True)
class Dilation:
    """A run's dilation of its emulated devices (:mod:`hetpipe_tf.pipeline.emulation`), decided once
    before it trains: `value`, given or chosen by calibration probes (`probes`: each probe's
    (dilation, overrun fraction))."""
    value: float
    probes: tuple[tuple[float, float], ...] = ()


def decide_dilation(given: float | None, emulated: bool, probe: Callable[[float], EmulationReport],
                    **calibration: Any) -> Dilation:
    """A run's one dilation: `given`, or, when None and a device is emulated, the one that probe
    runs choose (probe(dilation) -> the probe's EmulationReport;
    :func:`hetpipe_tf.pipeline.emulation.calibrate_dilation` with `calibration`: two steps above the
    smallest at which fewer than 2.5 % of the tasks overran their target). Without an emulated
    device nothing is paced and the value is the given one, or 1."""
    if given is not None or not emulated:
        return Dilation(1.0 if given is None else float(given))
    value, tried = calibrate_dilation(probe, **calibration)
    return Dilation(value, tuple((float(d), float(f)) for d, f in tried))


def worker_update_of(config: RunConfig, ties: Sequence[TiedVariable], num_stages: int) -> WorkerUpdate:
    """The :class:`WorkerUpdate` of a worker of `num_stages` stages run by `config` with `ties`: every
    stage but the first waits for the first stage's terms under a global clip or loss scaling, else
    the stages that hold a tied replica do; those send the first stage their replicas' gradients."""
    tied = tuple(sorted({st for t in ties for st, _ in t.replicas} - {0}))
    waiting = tuple(range(1, num_stages)) if config.update_rule else tied
    update = WorkerUpdate(waiting=waiting, tied=tied)
    check_worker_update(config.schedule, update, "a layer called in several stages (tied weights)" if tied
                        else "global clipping and loss scaling")
    return update


def _refuse_untrainable_ties(staged: StagedModel) -> None:
    """A SharedLayerError for a layer with non-trainable state that several stages call: each
    replica would keep state of its own (moving statistics), unlike the one layer of the model."""
    for tie in staged.tied:
        if not tie.trainable:
            stages = [st for st, _ in tie.replicas]
            raise SharedLayerError(f"variable '{tie.path}' is non-trainable state of a layer called in stages {stages} "
                                   f"(cut at {list(staged.boundaries)}): each stage's replica would update its own "
                                   f"state; cut the model so that the layer's calls are in one stage")


def _given_references(references: Sequence[tuple[float, float]],
                      num_stages: int) -> list[dict[type[Instruction], float]]:
    """[{Forward: seconds, Backward: seconds}] per stage from (forward, backward) pairs, checked."""
    try:
        pairs = [tuple(float(t) for t in p) for p in references]
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or len(pairs) != num_stages or any(len(p) != 2 or min(p) <= 0 for p in pairs):
        raise ValueError(f"references: give one (forward, backward) pair of seconds > 0 per stage ({num_stages} "
                         f"stages), got {references!r}")
    return [{Forward: f, Backward: b} for f, b in pairs]


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
