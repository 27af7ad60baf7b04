"""Virtual workers each driven by a process of its own, under Wave Synchronous Parallel (HetPipe §3, §5, §8).

The paper's TensorFlow implementation runs every virtual worker as a worker process
and the parameter servers as separate tasks. :class:`ProcessRunner` does the same: this
process, the chief, creates the global weights and the WSP clock on the parameter-server
tasks, starts one :mod:`hetpipe_tf.distributed.worker_process` per virtual worker on the
worker's home node (a task the cluster starts, :class:`hetpipe_tf.distributed.launch.LocalCluster`
here or :class:`hetpipe_tf.distributed.launch.TFConfigCluster` through the node's worker task;
the chief watches its heartbeats), and sends each its job: the model, the run's configuration,
its place in the plan and its shard of the data (:mod:`hetpipe_tf.distributed.protocol`). Each
worker process pipelines its minibatches and pushes and pulls at the servers itself; the chief
only gathers their per-minibatch logs, runs validation and the callbacks on the global weights,
forwards learning-rate changes and stops everything. So the chief does no work per minibatch
but read one small message per worker.

What runs per minibatch and stage in a worker process is its pipeline's
(:class:`hetpipe_tf.runtime.stage.StageRuntime`): one call of a compiled function per
task (on the last stage a minibatch's forward and backward pass, update and next stash; on the
others a forward task and a backward task), the executor's count of them is each stage's
``device_calls``; a stage on another node's worker task makes one RPC per call, its tensors
crossing with it. Per stage and wave, WSP's push and pull (:mod:`hetpipe_tf.sync.wsp`).

**A lost virtual worker** (its process killed, or stopped and given up by the heartbeats,
:mod:`hetpipe_tf.distributed.heartbeat`): with ``on_worker_failure="stop"`` (default) the
run ends with an error naming it. With ``"continue"`` the run goes on without it and takes it
back at the epoch's end (:mod:`hetpipe_tf.distributed.lost_workers`); such a run trains epoch by
epoch, as a checkpointing one does (:class:`hetpipe_tf.runtime.checkpoint.EpochSegments`).
"""
import dataclasses
import json
import multiprocessing.connection
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from hetpipe_tf.distributed import protocol
from hetpipe_tf.distributed.protocol import job_name
from hetpipe_tf.distributed.dataset_transfer import dataset_to_bytes
from hetpipe_tf.distributed.heartbeat import LostTask, call_with_deadline
from hetpipe_tf.distributed.launch import ChiefCluster
from hetpipe_tf.distributed.lost_workers import LostWorker, LostWorkers
from hetpipe_tf.distributed.starter import ClusterStartError
from hetpipe_tf.pipeline.emulation import EmulationReport
from hetpipe_tf.pipeline.executor import PipelineError
from hetpipe_tf.pipeline.trace import TraceRecorder
from hetpipe_tf.planning.planner import PlanError
from hetpipe_tf.runtime.checkpoint import PlanCuts, RunState, skip_consumed
from hetpipe_tf.runtime.fit_loop import Events
from hetpipe_tf.runtime.loss_head import LossHead
from hetpipe_tf.runtime.model_transport import pack_model
from hetpipe_tf.runtime.stage_rewrite import StagedModel, split_model
from hetpipe_tf.runtime.stage.verdicts import NonFiniteError
from hetpipe_tf.runtime.update_times import UpdateTimes
from hetpipe_tf.runtime.optimizers import check_for_workers, check_optimizer
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.virtual_worker import Dilation, decide_dilation
from hetpipe_tf.runtime.wsp_runner import server_layout

if TYPE_CHECKING:
    import numpy as np



class WorkerProcessError(PipelineError):
    """A virtual worker's process failed or ended; the message names it and says why."""


class _Connection:
    """The chief's side of one worker process's order connection: orders out; a reader thread
    hands the training messages (and :class:`protocol.Lost` when the connection ends: the process
    is gone) to `on_training` and keeps the answers to orders for :meth:`answer`."""

    def __init__(self, worker: int, conn: multiprocessing.connection.Connection,
                 on_training: Callable[[int, Any], None]) -> None:
        self.worker = worker
        self.conn = conn
        self.ended = False  # the connection ended: the process is gone
        self.left = False  # the chief went on without the process: the connection's end is no news
        self.leaving = threading.Lock()  # orders `left` and the report of the connection's end
        self.lock = threading.Lock()
        self.answers: queue.Queue[Any] = queue.Queue()
        self.on_training = on_training
        threading.Thread(target=self._read, name=f"hetpipe-vw{worker}-reader", daemon=True).start()

    def send(self, order: Any) -> bool:
        """Sends an order; False if the process is gone (its loss is reported by the reader)."""
        try:
            with self.lock:
                self.conn.send(order)
            return True
        except OSError:
            return False

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError) as e:
                self.ended = True
                why = f"its order connection ended ({type(e).__name__})"
                self.answers.put(protocol.Error("ConnectionError", why))
                with self.leaving:
                    if not self.left:
                        self.on_training(self.worker, protocol.Lost("ConnectionError", why))
                return
            if isinstance(message, protocol.TRAINING_MESSAGES):
                self.on_training(self.worker, message)
            else:
                self.answers.put(message)

    def answer(self, timeout_s: float, order: Any) -> Any:
        """The answer to the last `order` sent (of the order's answer type); raises the process's error."""
        try:
            message = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerProcessError(f"virtual worker {self.worker}'s process gave no answer to "
                                     f"{type(order).__name__} within {timeout_s:g} s") from None
        if isinstance(message, protocol.Error):
            raise _error(self.worker, message)
        if not isinstance(message, order.answer):
            raise WorkerProcessError(f"virtual worker {self.worker}'s process answered {type(order).__name__} with "
                                     f"{type(message).__name__}, not {order.answer.__name__}")
        return message

    def ask(self, timeout_s: float, order: Any) -> Any:
        """Sends an order and returns its answer."""
        self.send(order)
        return self.answer(timeout_s, order)


def _error(worker: int, message: protocol.Error | protocol.Failed | protocol.Lost) -> WorkerProcessError:
    """The chief's exception for a worker process's :class:`protocol.Error`, ``Failed`` or ``Lost``
    (a non-finite loss keeps its cause, whose logs TerminateOnNaN reads)."""
    error = WorkerProcessError(f"virtual worker {worker}'s process failed: {message.kind}: {message.message}")
    if message.kind == "NonFiniteError":
        error.__cause__ = NonFiniteError(message.message, None, None, message.logs)
    return error


class ProcessRunner:
    """Virtual workers under WSP, each in a process of its own, with this process as the chief.

    Args:
      model: the built, compiled Keras model (the chief's copy holds the global weights
        between epochs, for validation and callbacks).
      cluster: the started and connected :class:`hetpipe_tf.distributed.launch.LocalCluster` or
        :class:`hetpipe_tf.distributed.launch.TFConfigCluster`.
      workers: a :class:`hetpipe_tf.runtime.run_config.WorkerSpec` per virtual worker, its
        TensorFlow devices as its process names them
        (:func:`hetpipe_tf.distributed.protocol.local_device` for its own node's).
      config: the run's :class:`hetpipe_tf.runtime.run_config.RunConfig` (sent to every worker's
        process: a scheme or schedule of the user's own, the loss and the metrics must be
        importable there).
      ps_devices: the parameter-server devices.
      local_devices: for each worker, how many devices its own process holds.
      home_nodes: for each worker, the node its process runs on (the node of its first stage),
        whose address the process binds.
      stage_compute: whether each worker's process reports its stages' compute with every update
        (:meth:`stage_compute_s`; a run that re-plans watches it); told to the process with its job.
    """

    def __init__(self, model: keras.Model, cluster: ChiefCluster, workers: Sequence[WorkerSpec], config: RunConfig,
                 ps_devices: Sequence[str], local_devices: Sequence[int], home_nodes: Sequence[int],
                 stage_compute: bool = False) -> None:
        config.check_picklable()  # before any process starts
        self._model_text = pack_model(model)  # refuses a layer class a worker cannot rebuild, before any process starts
        check_for_workers(config.optimizer, len(workers))
        self.model = model
        self.cluster = cluster
        self.home_nodes = list(home_nodes)
        self.local_devices = list(local_devices)
        self.ps_devices = list(ps_devices)
        self.stage_compute = stage_compute
        self._dilation: Dilation | None = None  # the run's, decided at the first fit (calibrated when the config gives none)
        staged = self._plan_servers(workers, config)
        self.loss_head = LossHead(config.loss, staged.keras_graph.model.output_names,
                                  loss_weights=config.loss_weights, metrics=config.metrics)
        self.lost = LostWorkers(cluster, self.servers.clock, config.timeout_s)
        self.aborted: str | None = None  # why the last run was aborted, if it was
        self.trace: TraceRecorder | None = None
        self.batch_sizes: list[int] = [0] * len(workers)  # each worker's minibatch size, once built
        self._built_nm: list[int] = [0] * len(workers)  # the Nm each worker's stages were built for (their stashes')
        self.descriptions: list[str | None] = []
        self._conns: list[_Connection] = []
        self._events: Events | None = None
        self._report_started = True
        self._optimizer_states: list[protocol.OptimizerStateDict | None] | None = None  # a resumed run's
        self._finished: queue.Queue[tuple[int, Any]] = queue.Queue()
        # the current train's: each Done's receiver (worker, message), each Started's (time)
        self._on_done: Callable[[int, protocol.Done], None] = lambda w, m: None
        self._on_started: Callable[[float], None] | None = None
        self._compute: dict[int, tuple[float, ...]] = {}  # each worker's stage compute at its last Done
        self._updates = UpdateTimes(len(workers))
        # the current train's
        self._segment: dict[str, Any] = {"steps": [0] * self.num_workers, "done": {}, "started": set()}
        self._shards: Sequence[Iterable] | None = None  # each worker's whole shard (repeated), to restart one
        self._restarted: dict[int, protocol.DatasetBytes] = {}  # the shards of workers restarted at the epoch's end
        self._learning_rate = _LearningRate(self, float(check_optimizer(config.optimizer).learning_rate))

    def _plan_servers(self, workers: Sequence[WorkerSpec], config: RunConfig) -> StagedModel:
        """Takes `workers` and `config` as the run's plan: the configuration its worker processes
        get, and new servers of the plan's layout holding the Keras model's weights; returns
        worker 0's staged model."""
        self.workers, self.config = list(workers), config
        # Under "continue" a worker waits twice as long for the others (pulls, its pipeline's
        # watchdog) as the heartbeats take to give up a stopped one, which is then retired first.
        self._worker_config = config.replace(
            timeout_s=config.timeout_s * (2 if config.on_worker_failure == "continue" else 1))
        stages = [len(w.devices) for w in self.workers]
        staged = split_model(self.model, boundaries=self.workers[0].boundaries, num_stages=stages[0])
        self.layout = server_layout(staged, self.workers[0], config, self.ps_devices, stages)
        self.servers = self.layout.servers(self.model)
        return staged

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def emulated(self) -> bool:
        return any(d.emulated for w in self.workers for d in w.devices)

    @property
    def lost_workers(self) -> list[LostWorker]:
        """Every virtual worker lost in this runner's fits (:class:`hetpipe_tf.distributed.lost_workers.LostWorker`)."""
        return self.lost.records

    # Starting --------------------------------------------------------------------------
    def _start_processes(self, workers: Iterable[int]) -> list[_Connection]:
        """Starts the processes of `workers` on their home nodes; returns every worker's
        connection (the new ones in place of the old)."""
        host = self.cluster.address("chief", 0).rsplit(":", 1)[0]
        servers = json.dumps({"ps": self.cluster.spec["ps"], "worker": self.cluster.spec["worker"]})
        conns = dict(enumerate(self._conns))
        hosts = [self.cluster.host(n) for n in self.home_nodes]
        with multiprocessing.connection.Listener((host, 0), authkey=self.cluster.authkey) as listener:
            self.cluster.start_tasks([
                (job_name(w), 0, self.home_nodes[w], "hetpipe_tf.distributed.worker_process",
                 [f"--chief={host}:{listener.address[1]}", f"--worker={w}", f"--cluster_spec={servers}",
                  f"--local_devices={self.local_devices[w]}",
                  f"--processes_on_host={hosts.count(hosts[w])}"]) for w in workers])
            for _ in workers:  # each process connects right after its ready line
                conn = _accept(listener, self.config.timeout_s)
                hello = conn.recv()
                conns[hello.worker] = _Connection(hello.worker, conn, self._on_training)
        return [conns[w] for w in range(self.num_workers)]

    def _send_jobs(self, shards: Mapping[int, protocol.DatasetBytes] | Sequence[protocol.DatasetBytes],
                   workers: Iterable[int] | None = None, weights: "list[np.ndarray] | None" = None) -> None:
        """Sends the process of each of `workers` (default: all) its :class:`protocol.Job` (the
        model with `weights`, default the Keras model's; its place in the plan; its data; the run's
        servers) and waits until it is built."""
        layout = self.servers.layout()
        model_json, weights = self._model_text, self.model.get_weights() if weights is None else weights
        workers = range(self.num_workers) if workers is None else workers
        if len(self.descriptions) != self.num_workers:
            self.descriptions = [None] * self.num_workers
        for w in workers:
            # One after another: each measures its stages' solo times (the emulation's references,
            # hetpipe_tf.pipeline.emulation) while no other worker computes, as in one process.
            ready = self._conns[w].ask(self.config.timeout_s, protocol.Job(
                w, self.workers[w], self._worker_config, model_json, weights, layout, shards[w], self.stage_compute))
            self.batch_sizes[w], self.descriptions[w] = ready.batch_size, ready.description
            self._built_nm[w] = self.config.num_in_flight

    def _probe(self, dilation: float) -> EmulationReport:
        """One calibration probe of every worker at once at `dilation`, each in its own process (the
        dilation is calibrated for the multi-process runtime that then runs); their report."""
        order = protocol.Probe(dilation, self.num_workers)
        for c in self._live():
            c.send(order)
        return EmulationReport.combine(c.answer(self.config.timeout_s, order).report for c in self._live())

    # Training --------------------------------------------------------------------------
    def _on_training(self, worker: int, message: Any) -> None:
        if isinstance(message, protocol.Started):
            self._updates.started(time.perf_counter())
            self._segment["started"].add(worker)
            if self._on_started is not None:
                self._on_started(message.time)
        elif isinstance(message, protocol.Done):
            self._updates.done(worker, time.perf_counter())
            self._segment["done"][worker] = self._segment["done"].get(worker, 0) + 1
            self._compute[worker] = message.compute
            self._on_done(worker, message)
        else:
            self._finished.put((worker, message))

    def _live(self) -> list[_Connection]:
        """The connections of the workers whose process runs (not lost)."""
        return [c for c in self._conns if c.worker not in self.lost.gone]

    def broadcast(self, order: Any) -> None:
        """Sends an order to every worker's process."""
        for c in self._live():
            c.send(order)

    def task_lost(self, lost: LostTask) -> None:
        """The cluster lost a task (a :class:`hetpipe_tf.distributed.heartbeat.LostTask`): the run
        is aborted, unless it is a virtual worker's process and on_worker_failure is "continue"
        (the cluster ended the process; its connection's end then retires it, :meth:`_collect`)."""
        if self.config.on_worker_failure == "continue" and lost.job in {job_name(w) for w in range(self.num_workers)}:
            return
        self.abort(str(lost))

    def _skip(self, worker: int, missing: int) -> None:
        """Tells fit that `missing` minibatches of `worker` will not be trained (steps without an
        update) and, if it had not said so, that it started."""
        if self._report_started and worker not in self._segment["started"]:
            self._events.put("started", time.perf_counter())
        for _ in range(missing):
            self._events.put("done", (None, time.perf_counter()))

    def _lose(self, worker: int) -> None:
        """Goes on without `worker`, whose process is gone (:meth:`LostWorkers.lose`); the
        minibatches it had still to train in this epoch count as steps without an update."""
        missing = self._segment["steps"][worker] - self._segment["done"].get(worker, 0)
        self.lost.lose(worker, job_name(worker), missing, self.num_workers)
        self._skip(worker, missing)

    def _restart_lost(self, positions: Sequence[int]) -> dict[int, protocol.DatasetBytes]:
        """Starts a new process for every lost worker (between epochs: every other worker
        drained): it takes the global weights, its shard from `positions`, and rejoins the WSP
        clock at the global clock. A worker whose process cannot start stays lost (one line).
        Returns {worker: its shard} of those restarted."""
        lost = sorted(self.lost.gone)
        try:
            self._conns = self._start_processes(lost)
            shards = {w: dataset_to_bytes(skip_consumed([self._shards[w]], [positions[w]])[0]) for w in lost}
            self._send_jobs(shards, lost, self._global_weights())
        except (OSError, EOFError, TimeoutError, PipelineError, ClusterStartError) as e:
            print(f"hetpipe: virtual worker(s) {lost} could not restart ({e}); training continues without them",
                  file=sys.stderr, flush=True)
            return {}
        self.lost.rejoined(lost, [w for w in range(self.num_workers) if w not in self.lost.gone])
        return shards

    def _global_weights(self) -> "list[np.ndarray]":
        """The Keras model's weights with the global ones (the servers') in place."""
        values = self.servers.values()
        return [values[v.path].numpy() if v.path in values else v.numpy() for v in self.model.weights]

    def resume(self, state: RunState) -> None:
        """Continues the run `state` (a :class:`hetpipe_tf.runtime.checkpoint.RunState`) holds: its
        clocks at the servers now, its optimizer state in the workers' stages once they are built
        (its weights are already in the Keras model, hence the servers and the workers' jobs)."""
        self.servers.advance_clocks(state.clocks)
        self._optimizer_states = state.optimizers

    def switch_plan(self, workers: Sequence[WorkerSpec], config: RunConfig, home_nodes: Sequence[int],
                    local_devices: Sequence[int], state: RunState) -> None:
        """Goes on under another plan of the same virtual workers on the same devices (`workers`:
        its cuts; `config`: its Nm and placement) from `state`, this run's drained state
        (:meth:`run_state`): new servers of the plan's layout take the global weights and the
        clocks, and every worker's process builds its worker again (:class:`protocol.Rebuild`,
        one after another, as at the start: each measures its stages' solo times alone) from the
        global weights and its optimizer state. Every process, its tasks and its data stream stay:
        each worker trains on from where it stands in its shard, driven from its node (`home_nodes`,
        whatever node the plan's first stage is on now).

        Raises:
            PlanError: the plan has another number of workers, or would drive a worker from
                another node or with another number of its own devices (its process is where
                it is); nothing changed.
        """
        moved = [w for w, (node, n) in enumerate(zip(home_nodes, local_devices))
                 if w >= self.num_workers or (node, n) != (self.home_nodes[w], self.local_devices[w])]
        if len(workers) != self.num_workers or moved:
            raise PlanError(f"the plan has {len(workers)} virtual workers (the run {self.num_workers}) and drives "
                            f"worker(s) {moved} from another node or with another number of their own devices: "
                            f"their processes stay where they are")
        same_run = self.config.same_run(config)
        keep = [same_run and config.num_in_flight <= self._built_nm[w] and self.workers[w].same_stages(spec)
                for w, spec in enumerate(workers)]
        self._plan_servers(workers, config)
        self.lost.clock = self.servers.clock
        self.servers.advance_clocks(state.clocks)
        layout, weights = self.servers.layout(), self.model.get_weights()
        for c in self._live():
            ready = c.ask(self.config.timeout_s, protocol.Rebuild(
                self.workers[c.worker], self._worker_config, weights, layout, state.optimizers[c.worker],
                keep[c.worker]))
            self.batch_sizes[c.worker], self.descriptions[c.worker] = ready.batch_size, ready.description
            if not keep[c.worker]:
                self._built_nm[c.worker] = config.num_in_flight

    def run_state(self, epoch: int, positions: Sequence[int], plan: PlanCuts | None) -> RunState:
        """The run as a checkpoint holds it, between epochs (every worker drained): the global
        weights in the Keras model, each worker's stages' optimizer state asked of its process."""
        self.servers.write_to(self.model)
        optimizers = [None if c.worker in self.lost.gone  # a worker that could not restart: fresh on resume
                      else c.ask(self.config.timeout_s, protocol.GetOptimizerState()).state for c in self._conns]
        return RunState(epoch=epoch, weights=[v.numpy() for v in self.model.variables], optimizers=optimizers,
                        clocks=list(self.servers.clock.clocks()[0]), positions=list(positions), plan=plan)

    # What fit asks of a runner (hetpipe_tf.runtime.fit_loop.GlobalWeightsRunner) ------------
    @property
    def trains_by_epoch(self) -> bool:
        """A run that may go on without a lost worker trains epoch by epoch, to restart it between them."""
        return self.config.on_worker_failure == "continue"

    def begin_fit(self, shards: Sequence[Iterable], positions: Sequence[int]) -> None:
        self._shards = shards
        data = [dataset_to_bytes(s) for s in skip_consumed(shards, positions)]
        self._first_data: list[protocol.DatasetBytes] | None = data
        if not self._conns:
            self._conns = self._start_processes(range(self.num_workers))
            self._send_jobs(data)
        elif self.aborted:  # its servers take no more pulls: a new run, from the Keras model's weights
            self.servers, self.aborted = self.layout.servers(self.model), None
            self.lost.clock = self.servers.clock
            self._send_jobs(data)
        if self._optimizer_states is not None:
            for c, states in zip(self._conns, self._optimizer_states):
                c.ask(self.config.timeout_s, protocol.SetOptimizerState(states))
            self._optimizer_states = None
        if self._dilation is None:
            self._dilation = decide_dilation(self.config.dilation, self.emulated, self._probe)

    def train_segment(self, steps: Sequence[int], events: Events, first: bool, trace: bool,
                      epoch_ends: Sequence[int]) -> None:
        self._events = events
        self._report_started = first  # once per fit, not per epoch of a checkpointing one
        self._train(steps, trace, lambda w, m: events.put("done", (m.logs, m.time)),
                    (lambda t: events.put("started", t)) if first else None, None)

    def train_fit(self, steps: Sequence[int], trace: bool = False,
                  on_minibatch_done: Callable[[int, int, dict[str, float]], None] | None = None,
                  on_started: Callable[[float], None] | None = None) -> None:
        """Trains each worker `steps` more minibatches of the fit's data (from where the last train
        ended): on_minibatch_done(worker, p, logs) per update (on a connection's reader thread: it
        must not ask a worker's process anything), on_started(time) once every worker's process
        has its order (on the caller's thread, which may)."""
        self._train(steps, trace, lambda w, m: on_minibatch_done and on_minibatch_done(w, m.minibatch, m.logs),
                    None, on_started)

    def stage_compute_s(self, worker: int) -> list[float]:
        """As :meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.stage_compute_s`: `worker`'s, as its
        process reported it with its last update (empty unless the runner was made with `stage_compute`)."""
        return list(self._compute.get(worker, ()))

    def images_per_s(self) -> float:
        """As :meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.images_per_s`: images per second of
        the current (or last) train, every worker together, as the chief saw it (:class:`UpdateTimes`)."""
        return self._updates.images_per_s(self.batch_sizes)

    def _train(self, steps: Sequence[int], trace: bool, on_done: Callable[[int, protocol.Done], None],
               on_started: Callable[[float], None] | None, on_sent: Callable[[float], None] | None) -> None:
        """Trains each worker `steps` more minibatches: on_done(worker, Done) and on_started(time)
        per worker's message, on its connection's reader thread; on_sent(time) on this thread once
        every order is sent; returns once every worker finished (:meth:`_collect`)."""
        # The fit's first train sends the data; the next ones go on where the last ended, but a
        # restarted worker's process gets its shard from where the epoch ended.
        data = self._first_data or [self._restarted.pop(w, None) for w in range(self.num_workers)]
        self._first_data = None
        self._segment = {"steps": list(steps), "done": {}, "started": set()}
        self._on_done, self._on_started, self._compute = on_done, on_started, {}
        self._updates = UpdateTimes(self.num_workers)
        self.servers.rejoin(w for w in range(self.num_workers) if w not in self.lost.gone)
        for w in sorted(self.lost.gone):  # one that could not restart trains none of its minibatches
            self._skip(w, steps[w])
        for c in self._live():
            c.send(protocol.Train(data[c.worker], steps[c.worker], self._dilation, trace))
        if on_sent is not None:
            on_sent(time.perf_counter())
        self._collect(trace)

    def drain(self) -> None:
        """Every worker's process drains (:meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.drain`);
        under "continue", one whose process is gone meanwhile is lost here (:meth:`_lose`): its
        connection ended, or it gave no answer and its heartbeat gave it up within another timeout
        (a stopped process's heartbeat stops with it, and is given up a little after a drain's
        wait that began after the stop)."""
        for c in self._live():
            try:
                c.ask(self.config.timeout_s, protocol.Drain())
            except WorkerProcessError:
                if not (self.config.on_worker_failure == "continue" and (
                        c.ended or self.cluster.lost_task(job_name(c.worker), 0, wait_s=self.config.timeout_s))):
                    raise
                self._go_on_without(c)

    def _go_on_without(self, c: _Connection) -> None:
        """Loses the worker of connection `c` between segments: the report of its connection's end,
        sent or to come, is dropped, so that no later :meth:`_collect` takes it for the process that
        restarts in its place."""
        with c.leaving:
            c.left = True
            kept = []
            while True:
                try:
                    worker, message = self._finished.get_nowait()
                except queue.Empty:
                    break
                if not (worker == c.worker and isinstance(message, protocol.Lost)):
                    kept.append((worker, message))
            for item in kept:
                self._finished.put(item)
        self._lose(c.worker)

    def after_drain(self, positions: Sequence[int]) -> None:
        # On the caller's thread: a process's death signal follows the thread that started it.
        if self.lost.gone:
            self._restarted.update(self._restart_lost(positions))

    def epoch_weights(self, events: Events, stopped: bool) -> None:
        self.servers.write_to(self.model)

    def evaluate(self, dataset: tf.data.Dataset) -> dict:
        return self.loss_head.evaluate(self.model, dataset)

    def epoch_logs(self) -> dict:
        return {"global_clock": self.servers.clock.clocks()[1]}

    def stage_optimizers(self) -> list["_LearningRate"]:
        return [self._learning_rate]

    def request_stop(self) -> None:
        self.broadcast(protocol.Stop())

    def end_fit(self) -> None:
        self.servers.write_to(self.model)

    def release_fit_data(self) -> None:
        """Nothing here: the fit's streams are in the workers' processes, each replaced there by the
        next fit's when its data arrives."""

    def _collect(self, traced: bool) -> None:
        """Waits until every worker's process finished training, gathers their traces into one,
        and raises the first failure. Under "continue" a worker whose process is lost is retired
        and the others go on (:meth:`_lose`)."""
        self.trace = TraceRecorder(metadata={
            "hetpipe_tf": f"{self.num_workers} virtual workers, one process each, {self.config.sync.name.upper()} "
                          f"D={self.config.staleness_bound}"}) if traced else None
        finished = set(self.lost.gone)
        while len(finished) < self.num_workers:
            worker, message = self._finished.get()
            finished.add(worker)
            if isinstance(message, protocol.Lost) and self.config.on_worker_failure == "continue" \
                    and not self.aborted:
                self._lose(worker)
                continue
            if isinstance(message, (protocol.Failed, protocol.Lost)):
                self.abort(f"virtual worker {worker} failed: {message.kind}")
                self._await_ends(finished)
                raise _error(worker, message)
            if traced and message.trace:
                origin, events = message.trace
                self.trace.add_events(events, origin)

    def _await_ends(self, finished: set[int]) -> None:
        """Waits (up to timeout_s) until the workers not in `finished` report their run's end, so
        that no message of an aborted run reaches the next."""
        deadline = time.monotonic() + self.config.timeout_s
        while len(finished) < self.num_workers and time.monotonic() < deadline:
            try:
                finished.add(self._finished.get(timeout=max(deadline - time.monotonic(), 0.01))[0])
            except queue.Empty:
                break

    def abort(self, reason: str = "the run was stopped") -> None:
        """Stops every worker now; every pull of the run, waiting or later, fails at once
        (:meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.abort`)."""
        if not self.aborted:
            self.aborted = reason
            self.servers.abort(reason)
        self.broadcast(protocol.Abort())

    def stats(self, since: float | None = None) -> list[dict[str, Any]]:
        """Per worker, as :meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.stats` (asked of each
        worker's process; `since` is a time.perf_counter() value of this host)."""
        return [st for c in self._live() for st in c.ask(self.config.timeout_s, protocol.GetStats(since)).stats]

    def emulation_report(self) -> EmulationReport | None:
        """Every worker's emulation in the current (or last) run together, with the run's
        calibration (None if none is emulated)."""
        if not self._live():
            return None
        report = EmulationReport.combine(c.ask(self.config.timeout_s, protocol.GetReport()).report
                                         for c in self._live())
        return report and dataclasses.replace(report, calibration=self._dilation.probes if self._dilation else ())


class _LearningRate:
    """The stages' learning rate as fit's learning-rate follower sees it
    (:class:`hetpipe_tf.runtime.fit_loop.LearningRateFollower`): a value set is sent to every
    worker's process, whose stages take it."""

    def __init__(self, runner: ProcessRunner, value: float) -> None:
        self.runner = runner
        self.value = value

    @property
    def learning_rate(self) -> float:
        return self.value

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.value = float(value)
        self.runner.broadcast(protocol.SetLearningRate(self.value))


def _accept(listener: multiprocessing.connection.Listener, timeout_s: float) -> multiprocessing.connection.Connection:
    """The next connection to `listener`, or WorkerProcessError after `timeout_s` (a worker's
    process that ended before connecting)."""
    try:
        return call_with_deadline(listener.accept, timeout_s, "waiting for a virtual worker's process to connect")
    except TimeoutError as e:
        raise WorkerProcessError(f"a virtual worker's process said it was ready but did not connect ({e})") from None
