"""Virtual workers each driven by a process of its own, under Wave Synchronous Parallel (HetPipe §3, §5, §8).

The paper's TensorFlow implementation runs every virtual worker as a worker process
and the parameter servers as separate tasks. :class:`ProcessRunner` does the same: this
process, the chief, creates the global weights and the WSP clock on the parameter-server
tasks, starts one :mod:`hetpipe_tf.distributed.worker_process` per virtual worker on the
worker's home node (a task the cluster starts, :class:`hetpipe_tf.distributed.launch.LocalCluster`
here or :class:`hetpipe_tf.distributed.launch.TFConfigCluster` through the node's worker task;
the chief watches its heartbeats), and sends each its model, plan and shard of the data. Each worker process
pipelines its minibatches and pushes and pulls at the servers itself; the chief only
gathers their per-minibatch logs, runs validation and the callbacks on the global weights,
forwards learning-rate changes and stops everything. So the chief does no work per
minibatch but read one small message per worker.

Calls per minibatch and stage in a worker process (its pipeline is
:class:`hetpipe_tf.runtime.stage_runtime.StageRuntime`'s): four compiled ``tf.function``
calls (stash the weight version, forward, backward, apply), two custom ops of the weight
stash (get, release) and at most two eager ops (the backward pass's seed on all stages
but the last; reading back the loss on the last) and one read-back (whether the gradients
were finite): at most 9. Per stage and wave: 3 calls to push (read the weights, their
difference to the last push, the push function spanning the servers), 1 to pull, and
4 + one per stashed version to merge. A stage on the worker's own node makes no RPC but
the push and the pull; a stage on another node's worker task makes one RPC per call.

**A lost virtual worker** (its process killed, or stopped and given up by the heartbeats,
:mod:`hetpipe_tf.distributed.heartbeat`): with ``on_worker_failure="stop"`` (default) the
run ends with an error naming it. With ``"continue"`` the chief retires it at the WSP clock
(:meth:`hetpipe_tf.ops.wsp_clock.WspClock.retire`), so that its clock no longer holds back
the global clock (§5: a pull waits for the slowest worker still running), prints one line
naming it, and the others train on; the minibatches it had still to train in that epoch are
not trained (fit counts them as steps without an update). Such a run trains epoch by epoch,
as a checkpointing one does (:class:`hetpipe_tf.runtime.checkpoint.EpochSegments`): at the
end of the epoch it was lost in, once the others drained, the chief starts a new process for
it, which takes the global weights (and a fresh optimizer), goes on in its shard where the
epoch ended, and rejoins the clock at the global clock (its missed waves count as empty
pushes, :func:`rejoin_at_global_clock`), so it holds no one back; it trains from the next
epoch on. What it pushed before it was lost stays applied, once: a push is one call that
applies the update and records the wave.
"""
import json
import multiprocessing.connection
import pickle
import queue
import threading
import sys
import time
from dataclasses import dataclass

from hetpipe_tf.distributed.heartbeat import call_with_deadline
from hetpipe_tf.distributed.starter import ClusterStartError
from hetpipe_tf.distributed.worker_process import job_name
from hetpipe_tf.pipeline.emulation import EmulationReport, calibrate_dilation
from hetpipe_tf.pipeline.executor import PipelineError
from hetpipe_tf.pipeline.trace import TraceRecorder
from hetpipe_tf.runtime.checkpoint import EpochSegments, RunState, skip_consumed
from hetpipe_tf.planning.uneven import push_weights
from hetpipe_tf.runtime.fit_loop import batch_size_of, epoch_steps, run_fit
from hetpipe_tf.runtime.worker_data import worker_shards
from hetpipe_tf.runtime.loss_head import LossHead
from hetpipe_tf.runtime.stage_rewrite import split_model
from hetpipe_tf.runtime.stage_runtime import NonFiniteError
from hetpipe_tf.runtime.virtual_worker import warn_if_not_faithful
from hetpipe_tf.runtime.wsp_runner import stage_layer_servers
from hetpipe_tf.sync.parameter_server import ParameterServers

#: What a run does when a virtual worker's process is lost (see the module docstring).
ON_WORKER_FAILURE = ("stop", "continue")


class WorkerProcessError(PipelineError):
    """A virtual worker's process failed or ended; the message names it and says why."""


@dataclass
class LostWorker:
    """A virtual worker whose process was lost in a run that went on without it: why (the
    heartbeat's line, or how its connection ended), its WSP clock when it was retired (the waves
    its stages had all pushed), when it was retired, and the global clock it rejoined at when a new
    process took its place (None until then, or if none could start)."""
    worker: int
    reason: str
    clock: int
    found_at: float  # time.perf_counter() when the chief retired it
    rejoined_at: int = None


class _Connection:
    """The chief's side of one worker process's order connection: orders out; a reader thread
    hands training's messages (started, done, finished, failed, and lost when the connection
    ends: the process is gone) to `on_training` and keeps the answers to orders for :meth:`answer`."""

    def __init__(self, worker, conn, on_training):
        self.worker = worker
        self.conn = conn
        self.ended = False  # the connection ended: the process is gone
        self.lock = threading.Lock()
        self.answers = queue.Queue()
        self.on_training = on_training
        threading.Thread(target=self._read, name=f"hetpipe-vw{worker}-reader", daemon=True).start()

    def send(self, *order):
        """Sends an order; False if the process is gone (its loss is reported by the reader)."""
        try:
            with self.lock:
                self.conn.send(order)
            return True
        except OSError:
            return False

    def _read(self):
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError) as e:
                ended = ("error", "ConnectionError", f"its order connection ended ({type(e).__name__})", None)
                self.ended = True
                self.answers.put(ended)
                self.on_training(self.worker, ("lost",) + ended[1:])
                return
            if message[0] in ("started", "done", "finished", "failed"):
                self.on_training(self.worker, message)
            else:
                self.answers.put(message)

    def answer(self, timeout_s, kind):
        """The payload of the answer to the last order (of `kind`); raises the process's error."""
        try:
            message = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerProcessError(f"virtual worker {self.worker}'s process gave no {kind!r} answer within "
                                     f"{timeout_s:g} s") from None
        if message[0] == "error":
            raise _error(self.worker, *message[1:])
        return message[1:]

    def ask(self, timeout_s, *order):
        """Sends an order and returns the payload of its answer."""
        self.send(*order)
        return self.answer(timeout_s, order[0])


def _error(worker, kind, message, logs):
    """The chief's exception for a worker process's failure (a non-finite loss keeps its cause,
    whose logs TerminateOnNaN reads)."""
    error = WorkerProcessError(f"virtual worker {worker}'s process failed: {kind}: {message}")
    if kind == "NonFiniteError":
        error.__cause__ = NonFiniteError(message, None, None, logs)
    return error


class ProcessRunner:
    """Virtual workers under WSP, each in a process of its own, with this process as the chief.

    Args:
      model: the built, compiled Keras model (the chief's copy holds the global weights
        between epochs, for validation and callbacks).
      cluster: the started and connected :class:`hetpipe_tf.distributed.launch.LocalCluster` or
        :class:`hetpipe_tf.distributed.launch.TFConfigCluster`.
      workers: a :class:`hetpipe_tf.runtime.wsp_runner.WorkerSpec` per virtual worker, its
        TensorFlow devices as its process names them
        (:func:`hetpipe_tf.distributed.worker_process.local_device` for its own node's).
      local_devices: for each worker, how many devices its own process holds.
      home_nodes: for each worker, the node its process runs on (the node of its first stage;
        default: node 0), whose address the process binds.
      num_in_flight, staleness_bound, ps_devices, placement, dilation, timeout_s: as for
        :class:`hetpipe_tf.runtime.wsp_runner.WSPRunner`.
      optimizer, loss, metrics, loss_weights: as given to ``compile``.
      schedule, sync: every worker's pipelining schedule and the synchronisation scheme between
        the workers, as for :class:`hetpipe_tf.runtime.wsp_runner.WSPRunner` (sent to each
        process: a scheme or schedule of the user's own must be importable there).
      on_worker_failure: "stop" (a lost worker's process ends the run with an error) or
        "continue" (the run goes on without it and restarts it at the epoch's end; see the
        module docstring). :attr:`lost_workers` lists the workers lost.
      minibatch_sizes: each worker's minibatch size, uneven (None: the data's batch size), as for
        :class:`hetpipe_tf.runtime.wsp_runner.WSPRunner`: each process gets its share of every
        round of the data, and the servers weight its pushes (the processes read the weights there).
    """

    def __init__(self, model, cluster, workers, local_devices, num_in_flight, staleness_bound, ps_devices,
                 placement="default", optimizer="sgd", loss=None, metrics=(), loss_weights=None, dilation=None,
                 timeout_s=300.0, home_nodes=None, schedule="hetpipe", sync="wsp", on_worker_failure="stop",
                 minibatch_sizes=None):
        import keras

        from hetpipe_tf.pipeline.schedule import check_combination

        self.model = model
        self.cluster = cluster
        self.workers = list(workers)
        self.home_nodes = list(home_nodes) if home_nodes is not None else [0] * len(self.workers)
        self.local_devices = list(local_devices)
        self.num_in_flight = num_in_flight
        self.staleness_bound = int(staleness_bound)
        self.ps_devices = list(ps_devices)
        self.placement = placement
        self.optimizer = keras.optimizers.get(optimizer)
        # Pickled now: compile arguments that cannot reach the workers fail before any process starts.
        self.compiled = _pickled({"loss": loss, "metrics": metrics, "loss_weights": loss_weights})
        self.dilation = dilation
        self.calibration = ()
        self.timeout_s = float(timeout_s)
        self.schedule, self.sync = check_combination(schedule, sync)
        if on_worker_failure not in ON_WORKER_FAILURE:
            raise ValueError(f"unknown on_worker_failure {on_worker_failure!r}; allowed: "
                             f"{', '.join(ON_WORKER_FAILURE)}")
        self.on_worker_failure = on_worker_failure
        # Under "continue" a worker waits twice as long for the others (pulls, its pipeline's
        # watchdog) as the heartbeats take to give up a stopped one, which is then retired first.
        self.worker_timeout_s = self.timeout_s * (2 if on_worker_failure == "continue" else 1)
        self.lost_workers = []
        stages = [len(w.devices) for w in self.workers]
        staged = split_model(model, boundaries=self.workers[0].boundaries, num_stages=stages[0])
        self.loss_head = LossHead(loss, staged.keras_graph.model.output_names, loss_weights=loss_weights,
                                  metrics=metrics)
        layer_devices = None
        if placement == "local":
            layer_devices = stage_layer_servers(staged, self.workers[0].stage_servers)
        self.minibatch_sizes = tuple(minibatch_sizes) if minibatch_sizes is not None else None
        weights = push_weights(self.minibatch_sizes) if self.minibatch_sizes else None
        self._new_servers = lambda: ParameterServers(model, self.ps_devices, stages, placement, layer_devices,
                                                     push_weights=weights)
        self.servers = self._new_servers()
        self.aborted = None  # why the last run was aborted, if it was
        self.trace = None
        self.batch_size = None
        self.descriptions = []
        self._conns = []
        self._events = None
        self._report_started = True
        self._optimizer_states = None  # a resumed run's, to give the workers' stages once built
        self._finished = queue.Queue()
        self._lost = set()  # workers whose process is gone and not yet replaced
        self._segment = {"steps": 0, "done": {}, "started": set()}  # the current train's
        self._shards = None  # each worker's whole shard (repeated), to restart one
        self._learning_rate = _LearningRate(self, float(self.optimizer.learning_rate))

    @property
    def num_workers(self):
        return len(self.workers)

    @property
    def emulated(self):
        return any(d.emulated for w in self.workers for d in w.devices)

    # Starting --------------------------------------------------------------------------
    def _start(self, shards):
        """Starts every worker's process on its home node, sends it its job and waits until it
        is built."""
        self._conns = self._start_processes(range(self.num_workers))
        self._send_jobs(shards)

    def _start_processes(self, workers):
        """Starts the processes of `workers` on their home nodes; returns every worker's
        connection (the new ones in place of the old)."""
        host = self.cluster.address("chief", 0).rsplit(":", 1)[0]
        servers = json.dumps({"ps": self.cluster.spec["ps"], "worker": self.cluster.spec["worker"]})
        conns = dict(enumerate(self._conns))
        with multiprocessing.connection.Listener((host, 0), authkey=self.cluster.authkey) as listener:
            self.cluster.start_tasks([
                (job_name(w), 0, self.home_nodes[w], "hetpipe_tf.distributed.worker_process",
                 [f"--chief={host}:{listener.address[1]}", f"--worker={w}", f"--cluster_spec={servers}",
                  f"--local_devices={self.local_devices[w]}"]) for w in workers])
            for _ in workers:  # each process connects right after its ready line
                conn = _accept(listener, self.timeout_s)
                _, w = conn.recv()
                conns[w] = _Connection(w, conn, self._on_training)
        return [conns[w] for w in range(self.num_workers)]

    def _send_jobs(self, shards, workers=None, weights=None):
        """Sends the process of each of `workers` (default: all) its job (the model, `weights`
        (default: the Keras model's), its plan, its data and the run's servers) and waits until
        it is built."""
        import keras

        job = {"model": self.model.to_json(), "weights": self.model.get_weights() if weights is None else weights,
               "compiled": self.compiled,
               "optimizer": keras.optimizers.serialize(self.optimizer), "num_in_flight": self.num_in_flight,
               "staleness_bound": self.staleness_bound, "ps_devices": self.ps_devices,
               "stages_per_worker": self.servers.clock.stages_per_worker, "placement": self.placement,
               "variable_devices": self.servers.variable_devices(), "run": self.servers.run, "dilation": self.dilation,
               "timeout_s": self.worker_timeout_s, "schedule": self.schedule, "sync": self.sync}
        workers = range(self.num_workers) if workers is None else workers
        if len(self.descriptions) != self.num_workers:
            self.descriptions = [None] * self.num_workers
        for w in workers:
            # One after another: each measures its stages' solo times (the emulation's references,
            # hetpipe_tf.pipeline.emulation) while no other worker computes, as in one process.
            self._conns[w].send("job", dict(job, spec=self.workers[w], data=shards[w]))
            self.batch_size, self.descriptions[w] = self._conns[w].answer(self.timeout_s, "ready")

    def calibrate_dilation(self):
        """One dilation for every worker, by probe runs of all of them at once, each in its own
        process (:func:`hetpipe_tf.pipeline.emulation.calibrate_dilation`): the dilation is
        calibrated for the multi-process runtime that then runs."""
        def probe(dilation):
            for c in self._live():
                c.send("probe", dilation, self.num_workers)
            return EmulationReport.combine(c.answer(self.timeout_s, "probed")[0] for c in self._live())

        self.dilation, self.calibration = calibrate_dilation(probe)
        return self.dilation

    # Training --------------------------------------------------------------------------
    def _on_training(self, worker, message):
        kind = message[0]
        if kind == "started":
            self._segment["started"].add(worker)
            if self._report_started:  # once per fit, not per epoch of a checkpointing one
                self._events.put("started", message[1])
        elif kind == "done":
            self._segment["done"][worker] = self._segment["done"].get(worker, 0) + 1
            self._events.put("done", message[1])
        else:
            self._finished.put((worker, message))

    def _live(self):
        """The connections of the workers whose process runs (not lost)."""
        return [c for c in self._conns if c.worker not in self._lost]

    def broadcast(self, *order):
        """Sends an order to every worker's process."""
        for c in self._live():
            c.send(*order)

    def task_lost(self, lost):
        """The cluster lost a task (a :class:`hetpipe_tf.distributed.heartbeat.LostTask`): the run
        is aborted, unless it is a virtual worker's process and on_worker_failure is "continue"
        (the cluster ended the process; its connection's end then retires it, :meth:`_collect`)."""
        if self.on_worker_failure == "continue" and lost.job in {job_name(w) for w in range(self.num_workers)}:
            return
        self.abort(str(lost))

    def _lose(self, worker):
        """Goes on without `worker`, whose process is gone: retires it at the WSP clock, says so
        in one line, and counts the minibatches it had still to train in this epoch as steps
        without an update (a ``done`` event without logs, :func:`hetpipe_tf.runtime.fit_loop.run_fit`)."""
        job = job_name(worker)
        found = self.cluster.lost_task(job, 0, wait_s=min(self.timeout_s, 5.0))
        reason = str(found) if found else f"lost task {job}:0: its order connection ended"
        self.cluster.forget(job, 0)
        self._lost.add(worker)
        self.servers.clock.retire(worker)
        clock = self.servers.clock.clocks()[0][worker]
        self.lost_workers.append(LostWorker(worker, reason, clock, time.perf_counter()))
        missing = self._segment["steps"] - self._segment["done"].get(worker, 0)
        live = self.num_workers - len(self._lost)
        print(f"hetpipe: virtual worker {worker} was lost ({reason}) at clock {clock}; training continues "
              f"without it ({live} of {self.num_workers} virtual workers; {missing} of its minibatches of this "
              f"epoch not trained; it restarts at the epoch's end)", file=sys.stderr, flush=True)
        self._skip(worker, missing)

    def _skip(self, worker, missing):
        """Tells fit that `missing` minibatches of `worker` will not be trained (steps without an
        update) and, if it had not said so, that it started."""
        if self._report_started and worker not in self._segment["started"]:
            self._events.put("started", time.perf_counter())
        for _ in range(missing):
            self._events.put("done", (None, time.perf_counter()))

    def _restart_lost(self, positions):
        """Starts a new process for every lost worker (between epochs: every other worker
        drained): it takes the global weights, its shard from `positions`, and rejoins the WSP
        clock at the global clock. A worker whose process cannot start stays lost (one line).
        Returns {worker: its shard} of those restarted."""
        from hetpipe_tf.distributed.dataset_transfer import dataset_to_bytes

        lost = sorted(self._lost)
        try:
            self._conns = self._start_processes(lost)
            shards = {w: dataset_to_bytes(skip_consumed([self._shards[w]], [positions[w]])[0]) for w in lost}
            self._send_jobs(shards, lost, self._global_weights())
        except (OSError, EOFError, TimeoutError, PipelineError, ClusterStartError) as e:
            print(f"hetpipe: virtual worker(s) {lost} could not restart ({e}); training continues without them",
                  file=sys.stderr, flush=True)
            return {}
        running = [w for w in range(self.num_workers) if w not in self._lost]
        for w in lost:
            record = next(r for r in reversed(self.lost_workers) if r.worker == w)
            record.rejoined_at = rejoin_at_global_clock(self.servers.clock, w, running)
            print(f"hetpipe: virtual worker {w} restarted from the global weights; it rejoins at clock "
                  f"{record.rejoined_at}", file=sys.stderr, flush=True)
        self._lost.clear()
        return shards

    def _global_weights(self):
        """The Keras model's weights with the global ones (the servers') in place."""
        values = self.servers.values()
        return [values[v.path].numpy() if v.path in values else v.numpy() for v in self.model.weights]

    def resume(self, state):
        """Continues the run `state` (a :class:`hetpipe_tf.runtime.checkpoint.RunState`) holds: its
        clocks at the servers now, its optimizer state in the workers' stages once they are built
        (its weights are already in the Keras model, hence the servers and the workers' jobs)."""
        self.servers.advance_clocks(state.clocks)
        self._optimizer_states = state.optimizers

    def run_state(self, epoch, positions, plan):
        """The run as a checkpoint holds it, between epochs (every worker drained): the global
        weights in the Keras model, each worker's stages' optimizer state asked of its process."""
        self.servers.write_to(self.model)
        return RunState(epoch=epoch, weights=[v.numpy() for v in self.model.variables],
                        optimizers=[None if c.worker in self._lost else c.ask(self.timeout_s, "optimizer_state")[0]
                    for c in self._conns],  # a worker that could not restart: fresh on resume
                        clocks=list(self.servers.clock.clocks()[0]), positions=list(positions), plan=plan)

    def fit(self, x, epochs=1, steps_per_epoch=None, callbacks=None, verbose="auto", validation_data=None,
            trace_path=None, initial_epoch=0, checkpoints=None, positions=None, plan=None):
        """Trains like ``keras.Model.fit`` (see :meth:`hetpipe_tf.runtime.wsp_runner.WSPRunner.fit`,
        also for `initial_epoch`, `checkpoints`, `positions` and `plan`): each worker's process
        takes its shard of `x`; at every epoch's end the global weights go into the Keras model
        for validation and callbacks."""
        from hetpipe_tf.distributed.dataset_transfer import dataset_to_bytes

        steps_per_epoch = steps_per_epoch or epoch_steps(x)
        k = self.num_workers
        per_worker = -(-(epochs - initial_epoch) * steps_per_epoch // k)
        positions = positions or [0] * k
        self._shards = worker_shards(x, k, self.minibatch_sizes)
        shards = [dataset_to_bytes(s) for s in skip_consumed(self._shards, positions)]
        if not self._conns:
            self._start(shards)
        elif self.aborted:  # its servers take no more pulls: a new run, from the Keras model's weights
            self.servers, self.aborted = self._new_servers(), None
            self._send_jobs(shards)
        if self._optimizer_states is not None:
            for c, states in zip(self._conns, self._optimizer_states):
                c.ask(self.timeout_s, "set_optimizer_state", states)
            self._optimizer_states = None
        if self.emulated and self.dilation is None:
            self.calibrate_dilation()
        # A run that may go on without a lost worker trains epoch by epoch, to restart it between them.
        segments = None if checkpoints is None and self.on_worker_failure == "stop" else EpochSegments(
            checkpoints, steps_per_epoch, k, initial_epoch, epochs, positions)

        def train_steps(steps, data, first):
            self._report_started = first
            self._segment = {"steps": steps, "done": {}, "started": set()}
            self.servers.rejoin(w for w in range(k) if w not in self._lost)
            for w in sorted(self._lost):  # one that could not restart trains none of its minibatches
                self._skip(w, steps)
            for c in self._live():
                c.send("train", data[c.worker], steps, self.dilation, self.calibration, trace_path is not None)
            self._collect(trace_path is not None)

        def train(events):
            self._events = events
            if segments is None:
                train_steps(per_worker, shards, True)
                return

            def train_epoch(steps, first):  # the workers go on in their data where the last epoch ended
                train_steps(steps, shards if first else [restarted.pop(w, None) for w in range(k)], first)
                self._drain()

            segments.train(events, train_epoch)

        restarted = {}  # the shards of workers restarted at the last epoch's end

        def drained(positions):
            # On the caller's thread: a process's death signal follows the thread that started it.
            if self._lost:
                restarted.update(self._restart_lost(positions))

        def epoch_end(epoch, stopped, events):
            if segments is not None:
                segments.epoch_end(epoch, stopped, events, lambda e, p: self.run_state(e, p, plan), drained)
            self.servers.write_to(self.model)
            logs = {f"val_{k}": v for k, v in self.loss_head.evaluate(self.model, validation_data).items()} \
                if validation_data else {}
            logs["global_clock"] = self.servers.clock.clocks()[1]
            if self.emulated:
                logs["emulated_overrun_fraction"] = self.emulation_report().overrun_fraction
            return logs

        history = run_fit(
            self.model, train=train, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks,
            verbose=verbose, batch_size=sum(self.minibatch_sizes) / k if self.minibatch_sizes else batch_size_of(x),
            epoch_end=epoch_end, workers=k, optimizer=self.optimizer,
            stage_optimizers=lambda: [self._learning_rate], request_stop=lambda: self.broadcast("stop"),
            abort=lambda: (segments and segments.release(), self.abort()), timeout_s=self.timeout_s,
            initial_epoch=initial_epoch, after_epoch=segments and segments.after_epoch)
        self.servers.write_to(self.model)
        if trace_path and self.trace:
            self.trace.write(trace_path)
        warn_if_not_faithful(self.emulation_report())
        return history

    def _drain(self):
        """Every worker's process drains (:meth:`hetpipe_tf.runtime.wsp_runner.WSPRunner.drain`);
        under "continue", one whose process is gone meanwhile is left out (its loss is handled
        in the next :meth:`_collect`)."""
        for c in self._live():
            try:
                c.ask(self.timeout_s, "drain")
            except WorkerProcessError:
                if not (self.on_worker_failure == "continue" and c.ended):
                    raise

    def _collect(self, traced):
        """Waits until every worker's process finished training, gathers their traces into one,
        and raises the first failure. Under "continue" a worker whose process is lost is retired
        and the others go on (:meth:`_lose`)."""
        self.trace = TraceRecorder(metadata={
            "hetpipe_tf": f"{self.num_workers} virtual workers, one process each, {self.sync.name.upper()} D={self.staleness_bound}"}) \
            if traced else None
        finished = set(self._lost)
        while len(finished) < self.num_workers:
            worker, message = self._finished.get()
            finished.add(worker)
            if message[0] == "lost" and self.on_worker_failure == "continue" and not self.aborted:
                self._lose(worker)
                continue
            if message[0] in ("failed", "lost"):
                self.abort(f"virtual worker {worker} failed: {message[1]}")
                self._await_ends(finished)
                raise _error(worker, *message[1:])
            if traced and message[1]:
                origin, events = message[1]
                self.trace.add_events(events, origin)

    def _await_ends(self, finished):
        """Waits (up to timeout_s) until the workers not in `finished` report their run's end, so
        that no message of an aborted run reaches the next."""
        deadline = time.monotonic() + self.timeout_s
        while len(finished) < self.num_workers and time.monotonic() < deadline:
            try:
                finished.add(self._finished.get(timeout=max(deadline - time.monotonic(), 0.01))[0])
            except queue.Empty:
                break

    def abort(self, reason="the run was stopped"):
        """Stops every worker now; every pull of the run, waiting or later, fails at once
        (:meth:`hetpipe_tf.runtime.wsp_runner.WSPRunner.abort`)."""
        if not self.aborted:
            self.aborted = reason
            self.servers.abort(reason)
        self.broadcast("abort")

    def stats(self, since=None):
        """Per worker, as :meth:`hetpipe_tf.runtime.wsp_runner.WSPRunner.stats` (asked of each
        worker's process; `since` is a time.perf_counter() value of this host)."""
        return [st for c in self._live() for st in c.ask(self.timeout_s, "stats", since)[0]]

    def emulation_report(self):
        """Every worker's emulation in the current (or last) run together (None if none is emulated)."""
        if not self._live():
            return None
        return EmulationReport.combine(c.ask(self.timeout_s, "report")[0] for c in self._live())


class _LearningRate:
    """The stages' learning rate as fit's learning-rate sync sees it
    (:class:`hetpipe_tf.runtime.fit_loop.LearningRateFollower`): a value set is sent to every
    worker's process, whose stages take it."""

    def __init__(self, runner, value):
        self.runner = runner
        self.value = value

    @property
    def learning_rate(self):
        return self.value

    @learning_rate.setter
    def learning_rate(self, value):
        self.value = float(value)
        self.runner.broadcast("learning_rate", self.value)


def rejoin_at_global_clock(clock, worker, running):
    """Brings `worker` (retired, its process new) back into the WSP clock `clock` (a
    :class:`hetpipe_tf.ops.wsp_clock.WspClock`) at the global clock of the workers `running` (those
    not lost; between runs each is retired by its run's end, so the clock's own global clock would
    count the lost one too): every wave it missed counts as pushed, empty (the clock only: nothing
    is applied), so that it holds no other worker back (§5), and all its stages go on from one wave
    (a stage that had pushed more than another when its process was lost is caught up with).
    Returns the wave it rejoined at, which its next run's waves count from
    (:meth:`hetpipe_tf.sync.wsp.WSP.handlers`): the global clock, or one past it when it was not
    behind (a stage's next wave is found by pushing it)."""
    import tensorflow as tf

    clocks = clock.clocks()[0]
    global_clock = min((clocks[w] for w in running), default=clocks[worker])
    nexts = []
    for stage in range(clock.stages_per_worker[worker]):
        # The stage's next wave is the first the clock takes; it refuses an earlier one as pushed twice.
        # A stage leads its worker's slowest by a wave or two, never by more than the global clock
        # plus the waves in flight: the bound only keeps a broken clock from looping forever.
        for wave in range(clocks[worker], max(global_clock, clocks[worker]) + 64):
            try:
                clock.push(worker, stage, wave)
                break
            except tf.errors.FailedPreconditionError:
                continue
        else:
            raise RuntimeError(f"virtual worker {worker}'s stage {stage} took no wave from {clocks[worker]} on at the "
                               f"WSP clock (global clock {global_clock}); the clock is not this run's")
        nexts.append(wave + 1)
    rejoined = max(global_clock, *nexts)
    for stage, next_wave in enumerate(nexts):
        for wave in range(next_wave, rejoined):
            clock.push(worker, stage, wave)
    clock.retire(worker, retired=False)
    return rejoined


def _accept(listener, timeout_s):
    """The next connection to `listener`, or WorkerProcessError after `timeout_s` (a worker's
    process that ended before connecting)."""
    try:
        return call_with_deadline(listener.accept, timeout_s, "waiting for a virtual worker's process to connect")
    except TimeoutError as e:
        raise WorkerProcessError(f"a virtual worker's process said it was ready but did not connect ({e})") from None


def _pickled(compiled):
    """The compile arguments as bytes for the worker processes, or a clear error."""
    try:
        return pickle.dumps(compiled)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"the loss, metrics and loss_weights given to compile must be sendable to the virtual "
                         f"workers' processes (picklable: names, Keras objects, functions defined in a module), "
                         f"got {compiled} ({e}); or train with launch='in_process'") from None
