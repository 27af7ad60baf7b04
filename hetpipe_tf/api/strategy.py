"""HetPipeStrategy: Keras training on virtual workers under Wave Synchronous Parallel (HetPipe §3-§5, §8).

    strategy = hetpipe_tf.HetPipeStrategy(cluster="local", policy="ed", staleness_bound=1)
    with strategy.scope():  # the datasets and the model are made inside it
        train = load_image_classification("hetpipe_digits", "train", batch_size=32, shuffle=True)
        test = load_image_classification("hetpipe_digits", "test", batch_size=32)
        model = build_model("cnn", input_shape=(8, 8, 1), num_classes=10)
        model.compile(optimizer=keras.optimizers.AdamW(1e-3, global_clipnorm=1.0), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, epochs=12, validation_data=test)
    print(strategy.plan.format())

(``build_model`` is :func:`hetpipe_tf.cli.models.build_model`, ``load_image_classification``
:func:`hetpipe_tf.data.datasets.load_image_classification`.)

Behind ``fit``: the model is profiled on this host, the planner groups the cluster's
devices into virtual workers by the policy and cuts the model for each (with Nm), and
the workers train under WSP with parameter servers (:class:`hetpipe_tf.runtime.wsp_runner.WSPRunner`).

Where the tasks run (``launch``):

* ``"processes"`` (default): a :class:`hetpipe_tf.distributed.launch.LocalCluster` on this machine,
  one worker task per node of the cluster description (its devices are the task's
  logical devices, or its GPUs of this machine: :mod:`hetpipe_tf.distributed.gpus`) and one
  parameter-server task per node (§8.1); this process is the chief.
* ``"tf_config"``: the cluster in ``TF_CONFIG`` (jobs ``ps`` and ``worker``, one of
  each per node in the description's node order, this process the ``chief``), started
  by ``hetpipe launch`` or on each host by hand (:class:`hetpipe_tf.distributed.launch.TFConfigCluster`).
  Emulated devices are the worker tasks' logical CPUs, real ones their GPUs.

With both, each virtual worker is driven by a process of its own on its home node, the node
of its first stage (:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`; under
``tf_config`` that node's worker task starts it); the process holds the home node's
emulated and host-CPU devices itself and reaches the others (and real GPUs) on their node's
worker task.
* ``"in_process"``: every device and server in this process (threads; quick, for
  tests and small models).

Keras 3's ``model.fit`` does not run under TensorFlow's ``ParameterServerStrategy``,
so ``fit`` of a model compiled in ``scope()`` is this project's: it keeps Keras's
callbacks, History, progress bar and validation. Between epochs and at the end the
Keras model holds the global weights, so Keras's own ``evaluate`` and ``predict`` use
them. A later ``fit`` goes on where the last ended (the servers' clocks, each worker's
weights and optimizer state). A failed or interrupted ``fit`` ends its run at the servers
at once (every worker's waiting pull fails; none waits for its timeout); the next ``fit``
starts a new run from the Keras model's weights, those of the last completed epoch (in
one process the stages keep their optimizer state; worker processes are rebuilt with
fresh ones). Users who need more use :class:`WSPRunner` and the servers directly.

With ``checkpoint_dir``, ``fit`` saves the run at epochs' ends and ``resume=True`` continues
the newest checkpoint, exactly for deterministic data and D = 0
(:mod:`hetpipe_tf.runtime.checkpoint`: what is saved, the drain at every epoch's end, why
it is exact); ``keras.callbacks.BackupAndRestore`` gets an error that says so.

With ``uneven_minibatches=True`` (beyond the paper; Whale, Cannikin and Poplar do this for
plain data parallelism) the planner gives each virtual worker a minibatch size proportional to
its predicted throughput, within its stages' memory, out of a global batch of the dataset's
batch size times the number of workers (:mod:`hetpipe_tf.planning.uneven`); each worker then
takes its share of every round of that many samples
(:func:`hetpipe_tf.runtime.worker_data.worker_shards`), and the servers weight its pushes by
n · b_i / B so that the global update stays an unbiased average: with D = 0 and Nm = 1, SGD on
the round's concatenated batch (:mod:`hetpipe_tf.sync.parameter_server`). It pays off where the
workers are unequal, as under NP; ``describe()`` and the plan show each worker's size.

A virtual worker's process that is lost (killed, or stopped past ``timeout_s``) ends the run
with an error naming it, unless ``on_worker_failure="continue"``: the run then goes on without
it (retired at the WSP clock, so it holds no one back; one line says so), and a new process
takes its place at the epoch's end, from the global weights, rejoining at the global clock
(:mod:`hetpipe_tf.distributed.process_runner`). A lost parameter-server or worker task always
ends the run; with ``checkpoint_dir``, ``resume=True`` continues from the last checkpoint.
"""
import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

from hetpipe_tf.api import compile_hook
from hetpipe_tf.distributed.heartbeat import TaskLostError
from hetpipe_tf.distributed.launch import ClusterConfigError, join_cluster
from hetpipe_tf.distributed.resolvers import launch_for
from hetpipe_tf.pipeline.schedule import PipelineSchedule, SyncScheme
from hetpipe_tf.planning.cluster import Cluster, load_cluster
from hetpipe_tf.planning.profile import Profile

from hetpipe_tf.planning.request import PlanRequest

EMULATION_REFERENCES = ("measured", "profile")
#: What ``replan`` takes: never, or when a device slows down for good (:mod:`hetpipe_tf.runtime.replan`).
REPLAN = ("off", "auto")
#: The least time a task gets to start (importing TensorFlow on a busy machine takes a while).
START_TIMEOUT_S = 120.0
_FIT_ARGS = ("x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_data", "shuffle",
             "steps_per_epoch", "initial_epoch", "trace_path")


class HetPipeStrategy:
    """Data parallelism over heterogeneous virtual workers (HetPipe).

    Args:
      cluster: a cluster description: a preset name ("local"), a JSON path, a dict or a
        Cluster (see :mod:`hetpipe_tf.planning.cluster`).
      policy: how devices are grouped into virtual workers: "np", "ed", "hd" (§8.1) or
        "auto" (the best predicted of every allocation).
      num_in_flight: Nm, minibatches in flight per worker (None: the planner's choice).
      staleness_bound: D of WSP (§5).
      placement: of the global weights on the servers: "default" (layers round-robin) or
        "local" (each stage's layers on its node's server; ED only). None: local for ED.
      vw_size: devices per virtual worker (None: the policy's default).
      dilation: multiplies every emulated device's slowdown (see hetpipe-train --dilation); None
        (default): calibrated by probe runs of every virtual worker before training, so that the
        emulation stays faithful. The planner plans with the devices' speeds alone (dilation 1
        unless given): a dilation slows every emulated device alike.
      launch: "processes", "tf_config" or "in_process" (see the module docstring).
      timeout_s: a worker or a pull that takes longer, or a task that leaves heartbeats unanswered
        this long, fails training with an error; a task start gets at least START_TIMEOUT_S.
      log_dir: where the local cluster's task logs go (default: a temporary directory).
      emulate_links: with launch="processes", run each node's tasks in a network namespace of
        its own, joined by links of the cluster's inter-node bandwidth and latency
        (:mod:`hetpipe_tf.distributed.netlinks`; root needed). None: the cluster description's
        ``links.emulate``.
      checkpoint_dir: save the run there (:mod:`hetpipe_tf.runtime.checkpoint`: global weights,
        every stage's optimizer state, clocks, data positions, plan) at the end of every
        `save_every_epochs`-th epoch and of the last; such a run drains its pipelines at every
        epoch's end. None: no checkpoints (the pipelines run across epochs).
      save_every_epochs: see `checkpoint_dir`.
      resume: the first ``fit`` continues from the newest checkpoint in `checkpoint_dir`
        (weights, optimizer state, clocks, each worker's data position, the epoch); a clear error
        if there is none. Under the same shape of plan (workers, stages, Nm) it keeps the saved
        cuts and is exact; under another (allocation, partition, Nm, number of workers) it
        maps the optimizer state per variable (:func:`hetpipe_tf.runtime.checkpoint.for_workers`).
      schedule: how each virtual worker pipelines its minibatches, a registered
        :class:`hetpipe_tf.pipeline.schedule.PipelineSchedule` or its name (default: HetPipe's, §4).
      sync: how the virtual workers synchronise, a registered
        :class:`hetpipe_tf.pipeline.schedule.SyncScheme` or its name (default: WSP, §5). A scheme
        that cannot synchronise the schedule gets a ValueError listing the combinations that exist
        (:func:`hetpipe_tf.pipeline.schedule.combinations`).
      on_worker_failure: when a virtual worker's process is lost (launch "processes" or
        "tf_config"): "stop" (default) ends the run with an error naming it; "continue" goes on
        without it and restarts it at the epoch's end (its untrained minibatches count as steps
        of that epoch without an update). Such a run drains its pipelines at every epoch's end, as
        a checkpointing one does. ``runner.lost_workers`` lists the workers lost.
      uneven_minibatches: True: give each virtual worker a minibatch size proportional to its
        predicted throughput within its memory, and weight the servers' pushes by it (see the
        module docstring); a list of sizes, one per worker: those (checked against each worker's
        memory; a run that must not depend on a measured profile); False (default): every worker
        trains the dataset's batch size (§3).
      profile: plan with this :class:`hetpipe_tf.planning.profile.Profile` of the model at the data's
        batch size (or the path of one, as ``Profile.to_json`` writes it, e.g. ``strategy.plan.profile``
        of an earlier run) instead of measuring one. None (default): measured on this host (cached).
      emulation_references: what an emulated device's pace is scaled from
        (:mod:`hetpipe_tf.pipeline.emulation`): "measured" (default), each stage's passes timed alone
        in its worker's process before training; "profile", each stage's passes as the plan's profile
        times them (:meth:`hetpipe_tf.planning.planner.Plan.host_pass_seconds`), so that runs given one
        profile emulate the same devices whatever the load of the moment (the benchmarks' comparisons).
      replan: "off" (default) or "auto": when a device slows down for good (its stages' measured
        times over the plan's, :mod:`hetpipe_tf.runtime.replan.watch`), plan again with its measured
        speed and switch to the new plan at a drained wave boundary when the predicted gain over the
        rest of the fit pays for the switch (:mod:`hetpipe_tf.runtime.replan.runner`); under every
        launch (a worker's process stays and builds its worker again), even minibatches only, with
        on_worker_failure "stop". Off by default: a switch's gain rests on the planner's and
        simulator's predictions, a switch rebuilds and retraces every worker, and the run trains
        in chunks that drain between them (a little throughput when nothing slows down).
      cluster_resolver: TensorFlow's ``TFConfigClusterResolver``, ``SlurmClusterResolver`` or
        ``KubernetesClusterResolver`` giving the cluster's tasks; the run is then launch="tf_config"'s
        on them, mapped to the description's nodes by :mod:`hetpipe_tf.distributed.resolvers`' rule.
    """

    def __init__(self, cluster: str | dict[str, Any] | Cluster = "local", policy: str = "ed",
                 num_in_flight: int | None = None, staleness_bound: int = 0, placement: str | None = None,
                 vw_size: int | None = None, dilation: float | None = None, launch: str = "processes",
                 timeout_s: float = 300.0, log_dir: str | None = None, emulate_links: bool | None = None,
                 checkpoint_dir: str | None = None, save_every_epochs: int = 1, resume: bool = False,
                 schedule: PipelineSchedule | str = "hetpipe", sync: SyncScheme | str = "wsp",
                 on_worker_failure: str = "stop", uneven_minibatches: bool = False, profile: Profile | str | None = None,
                 emulation_references: str = "measured", cluster_resolver: Any = None, replan: str = "off") -> None:
        from hetpipe_tf.distributed.cluster_devices import LAUNCHES  # late: defers TensorFlow
        from hetpipe_tf.runtime.checkpoint import Checkpoints  # late: defers TensorFlow
        from hetpipe_tf.runtime.discovery import cluster_for  # late: defers TensorFlow
        from hetpipe_tf.runtime.plan_assembly import loaded_profile  # late: defers TensorFlow
        from hetpipe_tf.runtime.run_config import checked_on_worker_failure, checked_timeout  # late: defers TensorFlow

        launch = launch_for(launch, cluster_resolver)
        if launch not in LAUNCHES:
            raise ValueError(f"unknown launch {launch!r}; allowed: {', '.join(LAUNCHES)}")
        #: What the run asks the planner for (:class:`hetpipe_tf.planning.request.PlanRequest`).
        self.request = PlanRequest.asked(policy=policy, vw_size=vw_size, num_in_flight=num_in_flight,
                                         staleness_bound=staleness_bound, placement=placement, dilation=dilation,
                                         schedule=schedule, sync=sync, uneven_minibatches=uneven_minibatches)
        self.timeout_s = checked_timeout(timeout_s)
        self.on_worker_failure = checked_on_worker_failure(on_worker_failure)
        self.cluster = cluster_for(cluster, launch)
        real = sorted({d.type.name for d in self.cluster.devices() if not d.type.on_host})
        if real and launch == "in_process":
            raise ClusterConfigError(f"cluster '{self.cluster.name}' has accelerator types {real}: launch='in_process' "
                                     f"serves emulated devices and the host CPU only; run GPUs of this machine with "
                                     f"launch='processes', those of several machines with launch='tf_config'")
        if real and launch == "processes":
            from hetpipe_tf.distributed.gpus import gpu_layout  # late: lists GPUs in a child process

            gpu_layout(self.cluster)  # its nodes' GPUs checked against this machine's, before anything starts
        self.launch = launch
        self.cluster_resolver = cluster_resolver
        self.log_dir = log_dir
        self.emulate_links = self.cluster.emulate_links if emulate_links is None else bool(emulate_links)
        if self.emulate_links and launch != "processes":
            raise ValueError(f"emulated links join the tasks that launch='processes' starts on this machine; "
                             f"launch={launch!r} has none (in_process: one process; tf_config: real machines); "
                             f"pass emulate_links=False (--noemulate_links) to run without them")
        if resume and not checkpoint_dir:
            raise ValueError(f"resume=True needs the checkpoint_dir to resume from, got checkpoint_dir="
                             f"{checkpoint_dir!r}")
        if on_worker_failure == "continue" and launch == "in_process":
            raise ValueError("on_worker_failure='continue' goes on without a virtual worker whose process was lost; "
                             "launch='in_process' runs every worker in this process: use launch='processes' or "
                             "'tf_config', or on_worker_failure='stop'")
        if emulation_references not in EMULATION_REFERENCES:
            raise ValueError(f"unknown emulation_references {emulation_references!r}; allowed: "
                             f"{', '.join(EMULATION_REFERENCES)}")
        if emulation_references == "profile" and self.request.minibatch_sizes:
            raise ValueError("emulation_references='profile' scales every stage from the profile's minibatch size; "
                             "with uneven_minibatches the workers train others: use emulation_references='measured'")
        self.emulation_references = emulation_references
        if replan not in REPLAN:
            raise ValueError(f"unknown replan {replan!r}; allowed: {', '.join(map(repr, REPLAN))}")
        if replan == "auto" and on_worker_failure == "continue":
            raise ValueError("replan='auto' switches plans with every virtual worker's process in the run; "
                             "on_worker_failure='continue' goes on without a lost one: give "
                             "on_worker_failure='stop' or replan='off'")
        if replan == "auto" and self.request.minibatch_sizes:
            raise ValueError("replan='auto' keeps every worker's shard of the data and re-plans even minibatches "
                             "only: give uneven_minibatches=False or replan='off'")
        self.replan = replan
        self.profile = loaded_profile(profile)
        self.checkpoints = Checkpoints(checkpoint_dir, save_every_epochs) if checkpoint_dir else None
        self._resume = bool(resume)
        self._planned = None  # the planner's Plan, once fit has planned
        self.cuts = None  # the PlanCuts trained at (the plan's, or a resumed checkpoint's), once fit has planned
        self._run_config = None  # the planned plan's resolved RunConfig
        self.runner = None  # the WSPRunner, once fit has run
        self._compiled = {}  # id(model) -> compile arguments
        self._runner_key = None
        self._devices = None  # the ClusterDevices of the cluster under launch, once scope() joined it
        self._cluster = None  # the cluster this process is the chief of (launch processes or tf_config)

    # The user's side ---------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["HetPipeStrategy"]:
        """Models compiled inside train with this strategy (their ``fit`` is replaced). Under
        launch 'processes' or 'tf_config' this process joins the cluster on entry, and a
        ``tf.data`` dataset made before then cannot run: make datasets inside. The scope holds
        for the thread that entered it; in nested scopes a model goes to the innermost
        (:mod:`hetpipe_tf.api.compile_hook`).

        Yields:
            The strategy itself, for ``with strategy.scope() as s``.
        """
        self._connect()
        with compile_hook.attaching(self._attach):
            yield self

    def _attach(self, model: Any, arguments: dict[str, Any]) -> None:
        """Keeps loss, loss_weights and metrics as given: the workers' loss heads give them
        Keras's meaning (:mod:`hetpipe_tf.runtime.loss_head`). Without sample weights (which fit
        refuses) a weighted metric is its unweighted self: a list of `weighted_metrics` (keras_hub's
        tasks compile with one) joins a list of `metrics`.

        Raises:
            ValueError: `weighted_metrics` is not a list, or `metrics` is not a list to join.
        """
        kept = {k: arguments.get(k) for k in ("loss", "metrics", "loss_weights")}
        weighted = arguments.get("weighted_metrics")
        if weighted:
            if not isinstance(weighted, (list, tuple)) or not isinstance(kept["metrics"], (list, tuple, type(None))):
                raise ValueError(f"HetPipeStrategy takes compile(weighted_metrics=...) as a list, joined to a list "
                                 f"of metrics (there are no sample weights: each is its unweighted self); got "
                                 f"weighted_metrics={weighted!r} with metrics={kept['metrics']!r}: give them "
                                 f"as metrics=")
            kept["metrics"] = list(kept["metrics"] or []) + list(weighted)
        self._compiled[id(model)] = kept
        model.fit = types.MethodType(lambda m, *a, **kw: self.fit(m, *a, **kw), model)

    def fit(self, model: Any, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: str | int = "auto", callbacks: Sequence[Any] | None = None, validation_data: Any = None,
            shuffle: bool = True, steps_per_epoch: int | None = None, initial_epoch: int = 0,
            trace_path: str | None = None, **unsupported: Any) -> Any:
        """``keras.Model.fit`` on the virtual workers. `trace_path` writes every worker's pipeline,
        pushes, pulls and waits as a Chrome/Perfetto trace. A resumed run starts at the
        checkpoint's epoch (`initial_epoch`, if given, must be it). The other arguments are
        ``keras.Model.fit``'s.

        Returns:
            The Keras ``History`` of the fit.

        Raises:
            ValueError: an argument ``keras.Model.fit`` has but the strategy does not take
                (``sample_weight``, ``class_weight``, ...), a model not compiled in
                :meth:`scope`, a ``BackupAndRestore`` callback, or an `initial_epoch` other than
                the resumed checkpoint's.
            TaskLostError: the fit failed and a task of the cluster was found lost (dead,
                stopped or unreachable); the failure is its cause.
        """
        if unsupported:
            weights = sorted(set(unsupported) & {"sample_weight", "class_weight"})
            why = (f" ({' and '.join(weights)}: every sample weighs the same, as in Keras without them)"
                   if weights else "")
            raise ValueError(f"HetPipeStrategy's fit does not take {sorted(unsupported)}{why}; it takes "
                             f"{', '.join(_FIT_ARGS)}")
        if id(model) not in self._compiled:
            raise ValueError("compile the model inside strategy.scope() before fit")
        import keras  # late: defers TensorFlow

        if any(isinstance(c, keras.callbacks.BackupAndRestore) for c in callbacks or ()):
            raise ValueError("keras.callbacks.BackupAndRestore cannot restore a HetPipeStrategy run (its state is "
                             "in the stages and the parameter servers, not in the Keras model): give "
                             "HetPipeStrategy(checkpoint_dir=..., resume=True) (hetpipe-train --checkpoint_dir, "
                             "--resume) instead")
        from hetpipe_tf.runtime.worker_data import as_dataset, is_dataset  # late: defers TensorFlow

        data = as_dataset(x, y, batch_size, shuffle)
        from hetpipe_tf.runtime.subclass_trace import trace_for_data  # late: defers TensorFlow

        trace_for_data(model, data.element_spec)  # a subclassed model's call, traced on the data's inputs
        if validation_data is not None and not is_dataset(validation_data):
            validation_data = as_dataset(*validation_data, batch_size=batch_size, shuffle=False)
        resumed = self.checkpoints.restore_model(model) if self._resume and self.runner is None else None
        runner = self._runner(model, data, resumed.plan if resumed else None)
        positions = None
        if resumed is not None:
            if initial_epoch not in (0, resumed.epoch):
                raise ValueError(f"the checkpoint ends at epoch {resumed.epoch}, fit was given initial_epoch="
                                 f"{initial_epoch}: leave initial_epoch out to resume")
            from hetpipe_tf.runtime.checkpoint import for_workers  # late: defers TensorFlow
            from hetpipe_tf.runtime.worker_data import epoch_steps  # late: defers TensorFlow

            resumed = for_workers(resumed, len(self.plan.workers), steps_per_epoch or epoch_steps(data))
            initial_epoch, positions = resumed.epoch, resumed.positions
            runner.resume(resumed)
            self._resume = False
        from hetpipe_tf.runtime.fit_loop import FitOptions, fit  # late: defers TensorFlow

        if self.replan == "auto":
            from hetpipe_tf.runtime.worker_data import epoch_steps  # late: defers TensorFlow

            runner.set_fit_length((epochs - initial_epoch) * (steps_per_epoch or epoch_steps(data)))
        try:
            return fit(runner, data, FitOptions(
                epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks, verbose=verbose,
                validation_data=validation_data, trace_path=trace_path, initial_epoch=initial_epoch,
                checkpoints=self.checkpoints, positions=positions, plan=self.cuts))
        except Exception as exc:

            lost = self._cluster.find_lost() if self._cluster is not None else None
            if lost is None:
                raise

            raise TaskLostError(lost) from exc

    def stats(self) -> list[dict[str, Any]]:
        """Per virtual worker: clock, distance to the slowest, average wait, throughput (under the
        plan the run trains now, :attr:`plan`; a run that re-plans adds its decisions and switches).

        Returns:
            One dict per virtual worker (none before fit).
        """
        return self.runner.stats() if self.runner else []

    @property
    def plan(self) -> Any:
        """The planner's Plan the run trains under, once fit has planned (None before): a run that
        re-plans holds it in its runner, the plan it switched to after a switch."""
        return self.runner.plan if self.replan == "auto" and self.runner is not None else self._planned

    @property
    def run_config(self) -> Any:
        """The resolved RunConfig (every field decided: Nm, placement, minibatch sizes) of :attr:`plan`,
        once fit has planned (None before)."""
        return self.runner.config if self.replan == "auto" and self.runner is not None else self._run_config

    # Planning and launching --------------------------------------------------------------
    def _runner(self, model: Any, data: Any, saved_cuts: Any = None) -> Any:
        """The runner of `model` on `data`'s batch size: planned (:mod:`hetpipe_tf.runtime.plan_assembly`),
        at a resumed checkpoint's `saved_cuts` when its plan has the same shape.

        Returns:
            The runner, the same one while the model and the batch size stay.
        """
        from hetpipe_tf.distributed.node_speed import with_measured_speeds  # late: defers TensorFlow
        from hetpipe_tf.runtime import plan_assembly as assembly  # late: defers TensorFlow
        from hetpipe_tf.runtime.checkpoint import PlanCuts, reconcile_cuts  # late: defers TensorFlow
        from hetpipe_tf.runtime.worker_data import batch_size_of, first_batch  # late: defers TensorFlow

        batch_size = batch_size_of(data)
        key = (id(model), batch_size)
        if self._runner_key == key:
            return self.runner
        compiled = self._compiled[id(model)]
        training = assembly.Training(model.optimizer, compiled["loss"], compiled["metrics"], compiled["loss_weights"],
                                     self.timeout_s, self.on_worker_failure)
        # Profiled on a minibatch of the data: the loss takes its labels as they come (any structure);
        # with stages on the cluster's tasks, timed on a task's CPU as their references will be.
        profile = assembly.workload_profile(model, batch_size, self.profile, training,
                                            lambda: first_batch(data, f"launch={self.launch!r}"),
                                            self._devices.profiling_device())
        profile = with_measured_speeds(profile, model, lambda: first_batch(data, f"launch={self.launch!r}"),
                                       self.cluster, compiled["loss"])
        self._planned = assembly.assemble_plan(self.cluster, self.request, model.optimizer, profile)
        planned = PlanCuts.of_plan(self._planned)
        self.cuts = reconcile_cuts(saved_cuts, planned)
        if saved_cuts is not None and saved_cuts.shape != planned.shape:
            print(f"hetpipe: resuming {self.checkpoints.latest_path()}, saved under the plan {saved_cuts.to_dict()}, "
                  f"under this run's plan {planned.to_dict()}: weights and optimizer state per variable (every new "
                  f"worker from the saved workers' mean when their number changed)", flush=True)
        self._run_config = assembly.resolved_config(self.request, self._planned, self.cuts, training)
        # each worker's process is driven from its first stage's node, whatever a later plan cuts
        homes = [self._devices.home_node(w.devices) for w in self._planned.workers]
        workers = [self._worker_spec(w, homes[w]) for w in range(len(self._planned.workers))]
        if self.replan == "auto":
            self.runner = self._replanning_runner(model, workers, homes, training)
        else:
            self.runner = self._plan_runner(model, workers, self._run_config, homes)
        self._runner_key = key
        return self.runner

    def _plan_runner(self, model: Any, workers: Sequence[tuple[Any, int]], config: Any, homes: Sequence[int],
                     stage_compute: bool = False) -> Any:
        """The runner of a plan (`workers`: each worker's spec and count of its process's own devices)
        under `config`: a ProcessRunner of a process per worker under launch 'processes' or
        'tf_config' (each on its home node, `homes`; each reporting its stages' compute with every
        update with `stage_compute`), else a WSPRunner in this process.

        Returns:
            The runner.
        """
        specs = [spec for spec, _ in workers]
        if self.launch == "in_process":
            from hetpipe_tf.runtime.wsp_runner import WSPRunner  # late: defers TensorFlow

            return WSPRunner(model, specs, config, self._devices.ps)
        from hetpipe_tf.distributed.process_runner import ProcessRunner  # late: defers TensorFlow

        return ProcessRunner(model, self._cluster, specs, config, self._devices.ps, [n for _, n in workers], homes,
                             stage_compute)

    def _replanning_runner(self, model: Any, first: Sequence[tuple[Any, int]], homes: Sequence[int],
                           training: Any) -> Any:
        """The runner that re-plans (:mod:`hetpipe_tf.runtime.replan.runner`): first at the run's cuts
        (`first`: each worker's spec and count of its own devices), then at each new plan's, on the
        cluster's devices; with a process per worker, each process stays on its home node (`homes`)
        across a switch (:meth:`hetpipe_tf.distributed.process_runner.ProcessRunner.switch_plan`) and
        reports its stages' compute, which the run watches.

        Returns:
            The runner.
        """
        from hetpipe_tf.runtime.optimizers import slots_per_weight  # late: defers TensorFlow
        from hetpipe_tf.runtime.replan.decide import nominal_devices  # late: defers TensorFlow
        from hetpipe_tf.runtime.replan.runner import ReplanningRunner  # late: defers TensorFlow

        def workers_of(plan: Any) -> list[tuple[Any, int]]:
            if plan is self._planned:
                return list(first)
            # each worker's process stays on its node, wherever its first stage now is
            profile = self.emulation_references == "profile"
            return [self._devices.worker(w, nominal_devices(plan, w), plan.node_boundaries(w),
                                         plan.host_pass_seconds(w) if profile else None, homes[w])
                    for w in range(len(plan.workers))]

        def make(plan: Any, config: Any) -> Any:
            return self._plan_runner(model, workers_of(plan), config, homes, stage_compute=True)

        def switch_processes(old: Any, plan: Any, config: Any, state: Any) -> Any:
            workers = workers_of(plan)
            old.switch_plan([spec for spec, _ in workers], config, homes, [n for _, n in workers], state)
            return old

        return ReplanningRunner(self._planned, self.request, self._run_config, make,
                                optimizer_slots=slots_per_weight(training.optimizer),
                                switch_runner=None if self.launch == "in_process" else switch_processes)

    def _worker_spec(self, w: int, home: int) -> Any:
        """Worker w's WorkerSpec and how many of its devices its own process holds
        (:meth:`hetpipe_tf.distributed.cluster_devices.ClusterDevices.worker`; `home`: its home
        node's index), at the run's cuts.

        Returns:
            The WorkerSpec and the count of its devices.

        Raises:
            ValueError: ``emulation_references="profile"`` with a resumed checkpoint's cuts other
                than the plan's.
        """
        boundaries = self.cuts.boundaries[w]
        references = None
        if self.emulation_references == "profile":
            if boundaries != self._planned.node_boundaries(w):
                raise ValueError(f"emulation_references='profile' times the plan's cuts {self._planned.node_boundaries(w)}; "
                                 f"virtual worker {w} resumes the checkpoint's {boundaries}: resume with "
                                 f"emulation_references='measured'")
            references = self._planned.host_pass_seconds(w)
        return self._devices.worker(w, self._planned.workers[w].devices, boundaries, references, home)

    def _connect(self) -> None:
        """Starts (processes) or joins (tf_config) the cluster, once per process; names its devices."""
        from hetpipe_tf.distributed.cluster_devices import ClusterDevices  # late: defers TensorFlow

        if self.launch != "in_process":

            # A lost task stops training at once (the heartbeat monitor found it), or, a virtual worker's
            # process under on_worker_failure="continue", training goes on without it.
            self._cluster = join_cluster(self.cluster, self.launch, self.timeout_s, max(self.timeout_s, START_TIMEOUT_S),
                                         log_dir=self.log_dir, emulate_links=self.emulate_links,
                                         resolver=self.cluster_resolver,
                                         on_lost=lambda lost: self.runner.task_lost(lost) if self.runner else None)
        if self._devices is None:
            self._devices = ClusterDevices(self.cluster, self.launch)

    def describe(self) -> str:
        """The chosen plan and where its tasks run, as text."""
        lines = [self.plan.format() if self.plan else "(no plan yet: fit plans the run)",
                 f"launch: {self.launch}"]
        sizes = self.cuts and self.cuts.minibatch_sizes
        if sizes and sizes != self.plan.minibatch_sizes:
            lines.append(f"minibatch sizes {sizes} (resumed from the checkpoint)")
        if self._cluster is not None and hasattr(self._cluster, "log_dir"):
            lines.append(f"task logs: {self._cluster.log_dir}")
        if self.cluster.emulated:
            report = self.runner.emulation_report() if self.runner else None
            dilation = report.dilation if report else self.request.dilation
            lines.append(f"EMULATED devices (dilation {'calibrated at fit' if dilation is None else f'{dilation:g}'})")
        return "\n".join(lines)
