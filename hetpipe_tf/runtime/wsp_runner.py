"""Several virtual workers trained together by Wave Synchronous Parallel (HetPipe §3, §5), or by
another scheme on the parameter servers (BSP, SSP, ASP: per-minibatch clocks, §2.2).

Every virtual worker is a :class:`hetpipe_tf.runtime.virtual_worker.VirtualWorker` whose schedule
pushes each wave's aggregated update to the parameter servers and pulls the global
weights, waiting until every worker has pushed wave c - D; the workers run concurrently,
each on its own devices (which may be remote tasks of TensorFlow's distributed runtime),
and the global weights end in the Keras model.

With uneven minibatches (``minibatch_sizes``, beyond the paper; :mod:`hetpipe_tf.planning.uneven`)
worker i trains b_i samples per minibatch (:func:`hetpipe_tf.runtime.worker_data.worker_shards`)
and the servers weight its pushes by n · b_i / B, so that with D = 0 and Nm = 1 the global
step is SGD's on the concatenated batch of the round
(:mod:`hetpipe_tf.sync.parameter_server`).
"""
import time

from hetpipe_tf.pipeline.emulation import EmulationReport, calibrate_dilation
from hetpipe_tf.pipeline.simulator import wait_and_idle
from hetpipe_tf.pipeline.trace import TraceRecorder
from hetpipe_tf.runtime.checkpoint import RunState, set_stage_optimizer_state, skip_consumed, stage_optimizer_state
from hetpipe_tf.planning.uneven import push_weights
from hetpipe_tf.runtime.fit_loop import done_event, fit, start_thread
from hetpipe_tf.runtime.optimizers import check_for_workers
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from hetpipe_tf.sync.parameter_server import ParameterServers, layer_of


class WSPRunner:
    """Virtual workers synchronised through parameter servers under staleness bound D.

    Args:
      model: a built Keras model (every worker cuts it into its own stages).
      workers: a :class:`WorkerSpec` per virtual worker.
      config: the run's :class:`RunConfig`: Nm (the same for every worker, §4), the staleness bound
        and the scheme (WSP's D, §5; BSP, SSP, ASP), the schedule, the placement of the global
        weights (``local`` puts every layer on the server of the node that trains it in worker 0:
        `stage_servers` of its stage, §8.1), the optimizer, loss and metrics, the dilation (None:
        one for every worker, calibrated by probe runs of every worker at once, as they share the
        host), the timeouts and the minibatch sizes (uneven: ``fit`` splits the data so, and the
        servers this runner creates weight the pushes by :func:`hetpipe_tf.planning.uneven.push_weights`;
        ``train`` takes the data as given).
      ps_devices: the parameter-server devices.
      servers: parameter servers another process created (:class:`ParameterServers` given
        ``variable_devices``), when this runner drives some of a run's workers only; None: this
        runner creates them for `model`.
      worker_ids: the run's index of each worker in `workers` (default 0, 1, ...): a process
        that drives worker 3 of a run gives [3].
    """

    def __init__(self, model, workers, config, ps_devices, servers=None, worker_ids=None):
        self.model = model
        self.config = config
        self.vws = [VirtualWorker.from_config(model, w, config) for w in workers]
        self.worker_ids = tuple(worker_ids) if worker_ids is not None else tuple(range(len(self.vws)))
        if len(self.worker_ids) != len(self.vws):
            raise ValueError(f"{len(self.vws)} workers but {len(self.worker_ids)} worker ids")
        # The sizes are the run's, one per virtual worker of the run (a process's runner trains some).
        run_workers = len(self.vws) if servers is None else max(self.worker_ids) + 1
        sizes = config.minibatch_sizes
        if sizes is not None and (len(sizes) != run_workers if servers is None else len(sizes) < run_workers):
            raise ValueError(f"{len(sizes)} minibatch sizes {list(sizes)} for {run_workers} virtual workers: "
                             f"give one per worker, or None for the data's batch size")
        self._new_servers = None
        if servers is None:  # this runner trains every worker of the run
            check_for_workers(config.optimizer, len(self.vws))
            layer_devices = None
            if config.placement == "local":
                if not workers[0].stage_servers or len(workers[0].stage_servers) != self.vws[0].num_stages:
                    raise ValueError("local placement needs worker 0's stage_servers, one per stage")
                layer_devices = stage_layer_servers(self.vws[0].staged, workers[0].stage_servers)
            weights = push_weights(config.minibatch_sizes) if config.minibatch_sizes else None
            self._new_servers = lambda: ParameterServers(model, ps_devices, [vw.num_stages for vw in self.vws],
                                                         config.placement, layer_devices, push_weights=weights)
            servers = self._new_servers()
        self._bind(servers)
        self.aborted = None  # why the last run was aborted, if it was
        self.trace = None
        self.reports = None
        self._executors = {}
        self._completions = {}  # worker -> when each of its updates completed (perf_counter)
        self._started = None
        self._optimizer_states = None  # to give the stages once they are built (a resumed run)
        self.batch_sizes = None  # each worker's, once train() has built it

    def _bind(self, servers):
        self.servers = servers
        for w, vw in zip(self.worker_ids, self.vws):
            vw.sync = self.config.sync.bind(w, servers, self.config.staleness_bound, self.config.timeout_s)

    def _renew_after_abort(self):
        """An aborted run's servers take no more pulls (:meth:`abort`): the next run gets new ones,
        and every worker starts from the Keras model's weights (those of the last completed epoch)."""
        if self._new_servers is None:
            raise RuntimeError(f"this run was aborted ({self.aborted}) and its parameter servers belong to "
                               f"another process: that process starts a new run")
        self._bind(self._new_servers())
        for vw in self.vws:
            for rt in vw.runtimes or ():
                rt.load_model_weights()
        self.aborted = None

    @property
    def num_workers(self):
        return len(self.vws)

    @property
    def emulated(self):
        return any(vw.emulated for vw in self.vws)

    @property
    def descriptions(self):
        """Each worker's description (its stages and devices)."""
        return [vw.describe() for vw in self.vws]

    @property
    def num_in_flight(self):
        return self.vws[0].num_in_flight

    def train(self, data, steps, trace=False, on_minibatch_done=None, on_started=None):
        """Trains every worker on `minibatches` minibatches of its own data (a list, one
        iterable per worker); returns their ExecutionReports. on_minibatch_done(worker, p, logs);
        on_started(time) once the workers are built and the emulation calibrated."""
        if len(data) != self.num_workers:
            raise ValueError(f"{self.num_workers} workers but data for {len(data)}")
        if self.aborted:
            self._renew_after_abort()
        iterators = [iter(d) for d in data]
        firsts = [next(it) for it in iterators]
        # Build and trace one worker at a time.
        self.batch_sizes = [vw.prepare(*first) for vw, first in zip(self.vws, firsts)]
        if self._optimizer_states is not None:
            self.set_optimizer_states(self._optimizer_states)
            self._optimizer_states = None
        if any(vw.emulated and vw.dilation is None for vw in self.vws):
            self.calibrate_dilation(firsts)
        if trace:
            metadata = {"hetpipe_tf": f"{self.num_workers} virtual workers, {self.config.sync.name.upper()} "
                                      f"D={self.config.staleness_bound}"}
            emulation = self.vws[0].trace_metadata().get("emulation")
            self.trace = TraceRecorder(metadata=dict(metadata, emulation=emulation) if emulation else metadata)
        else:
            self.trace = None
        reports, errors = [None] * self.num_workers, []
        self._completions = {i: [] for i in range(self.num_workers)}
        for vw in self.vws:
            vw.sync.pull_waits.clear()
        self._started = time.perf_counter()
        if on_started:
            on_started(self._started)

        def run(i):
            def chain():
                yield firsts[i]
                yield from iterators[i]

            def done(p, logs):
                self._completions[i].append(time.perf_counter())
                if on_minibatch_done:
                    on_minibatch_done(i, p, logs)

            try:
                reports[i] = self.vws[i].train(chain(), steps, trace=self.trace or False, on_minibatch_done=done,
                                               executor_hook=lambda ex: self._executors.__setitem__(i, ex))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                self.abort(f"virtual worker {self.worker_ids[i]} failed: {type(exc).__name__}")

        self.servers.rejoin(self.worker_ids)
        threads = [start_thread(lambda i=i: run(i), f"hetpipe-worker-{i}") for i in range(self.num_workers)]
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.finish()
        self.reports = reports
        return reports

    def images_per_s(self):
        """Images per second of the current (or last) run, every worker together: the samples of
        the updates completed so far over the time since the run started."""
        ends = [t for times in self._completions.values() for t in times]
        images = sum(len(self._completions[i]) * b for i, b in enumerate(self.batch_sizes or ()))
        return images / (max(ends) - self._started) if ends else 0.0

    def abort(self, reason="the run was stopped"):
        """Stops every worker now, and ends the run at the servers: every pull, waiting or later,
        of any worker of the run (in any process) fails at once, naming `reason`."""
        if not self.aborted:
            self.aborted = reason
            self.servers.abort(reason)
        for ex in list(self._executors.values()):
            ex.abort()

    def request_stop(self):
        """Asks every worker to admit no more minibatches (those in flight complete)."""
        for ex in list(self._executors.values()):
            ex.request_stop()

    def emulation_report(self):
        """Every worker's emulation in the current (or last) run together (None if none is emulated)."""
        return EmulationReport.combine(vw.emulation_report() for vw in self.vws)

    def calibrate_dilation(self, minibatches):
        """Chooses one dilation for every worker: probe runs of all workers at once (each on
        copies of its minibatch in `minibatches`, nothing kept), as in
        :meth:`VirtualWorker.calibrate_dilation`. The probes do the workers' side of the
        synchronisation but not the servers' (their waits and sums), which share the host's
        cores in the real run: the calibration's steps of margin cover them."""
        dilation, tried = calibrate_dilation(lambda d: self.probe(d, minibatches))
        self.set_dilation(dilation, tried)
        return dilation

    def probe(self, dilation, minibatches, workers=None):
        """One probe run of every worker at once at `dilation` (each on copies of its minibatch
        in `minibatches`, nothing kept); their EmulationReport together. `workers`: how many
        workers of the run probe at the same time, here and in other processes (default: this
        runner's), which sets the probe's length."""
        reports, errors = [None] * self.num_workers, []
        n = self.vws[0].probe_minibatches(workers or self.num_workers)

        def run(i):
            try:
                reports[i] = self.vws[i].probe_emulation(minibatches[i], dilation, n)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        for t in [start_thread(lambda i=i: run(i), f"hetpipe-probe-{i}") for i in range(self.num_workers)]:
            t.join()
        if errors:
            raise errors[0]
        return EmulationReport.combine(reports)

    def set_dilation(self, dilation, calibration=()):
        """Every worker's emulated devices run at `dilation` (`calibration`: the probes' (dilation,
        overrun fraction), when calibrated)."""
        for vw in self.vws:
            vw.dilation, vw.calibration = dilation, tuple(calibration)

    def finish(self):
        """Puts the global weights and state into the Keras model, and worker 0's state that the
        servers do not keep (random seeds)."""
        for rt in self.vws[0].runtimes:
            for v, value in zip(rt.stage.non_trainable_variables, rt.non_trainable):
                if v.path not in self.servers.variables:
                    v.assign(value.value)
        self.servers.write_to(self.model)

    def drain(self):
        """After a train() (every update pushed, the global weights in the Keras model): every
        stage takes the global weights, as a run after an aborted one does."""
        for vw in self.vws:
            for rt in vw.runtimes or ():
                rt.load_model_weights()

    def run_state(self, epoch, positions, plan):
        """The run as a checkpoint holds it, between epochs (after :meth:`drain`)."""
        return RunState(epoch=epoch, weights=[v.numpy() for v in self.model.variables],
                        optimizers=self.optimizer_states(),
                        clocks=list(self.servers.clock.clocks()[0]), positions=list(positions), plan=plan)

    def resume(self, state):
        """Continues the run `state` holds: its clocks at the servers now, its optimizer state in
        the stages once built (its weights are already in the Keras model and the servers)."""
        self.servers.advance_clocks(state.clocks)
        self.set_optimizer_states(state.optimizers)

    def optimizer_states(self):
        """Per worker, its optimizer state per model variable (:func:`hetpipe_tf.runtime.checkpoint.stage_optimizer_state`)."""
        return [stage_optimizer_state(vw.runtimes, self.model) for vw in self.vws]

    def set_optimizer_states(self, states):
        """Gives every worker's stages their optimizer variables' values (`states` as
        :meth:`optimizer_states` gives them): now if they are built, else once they are."""
        if all(vw.runtimes is not None for vw in self.vws):
            for vw, values in zip(self.vws, states):
                set_stage_optimizer_state(vw.runtimes, values, self.model)
        else:
            self._optimizer_states = states

    def fit(self, x, epochs=1, steps_per_epoch=None, callbacks=None, verbose="auto", validation_data=None,
            trace_path=None, initial_epoch=0, checkpoints=None, positions=None, plan=None):
        """Trains like ``keras.Model.fit`` (:func:`hetpipe_tf.runtime.fit_loop.fit`). Each worker takes
        its shard of `x`; an epoch is `steps_per_epoch` minibatches of all workers together; at every
        epoch's end the global weights go into the Keras model for validation and callbacks."""
        return fit(self, x, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks, verbose=verbose,
                   validation_data=validation_data, trace_path=trace_path, initial_epoch=initial_epoch,
                   checkpoints=checkpoints, positions=positions, plan=plan)

    # What fit asks of a runner (hetpipe_tf.runtime.fit_loop.Runner) ------------------------
    trains_by_epoch = False

    def begin_fit(self, shards, positions):
        self._fit_data = [iter(s) for s in skip_consumed(shards, positions)]

    def train_segment(self, steps, events, first, trace, epoch_ends):
        k = self.num_workers
        self.train(self._fit_data, steps, trace=trace, on_minibatch_done=done_event(events),
                   on_started=(lambda t: [events.put("started", t) for _ in range(k)]) if first else None)

    def after_drain(self, positions):
        pass

    def epoch_weights(self, events, stopped):
        self.finish()

    def evaluate(self, dataset):
        return self.vws[0].evaluate(dataset)

    def epoch_logs(self):
        return {"global_clock": self.servers.clock.clocks()[1]}

    def stage_optimizers(self):
        return [rt.optimizer for vw in self.vws for rt in vw.runtimes or []]

    def end_fit(self):
        pass

    def provenance(self, stage=0):
        """{(worker, minibatch): (local updates, global (worker, wave) pushes)} that `stage`'s
        weight versions held, for :func:`hetpipe_tf.sync.staleness.check`."""
        out = {}
        for w, vw in zip(self.worker_ids, self.vws):
            record = vw.runtimes[stage].provenance
            for p, local in record.used_versions.items():
                out[(w, p)] = (local, record.used_globals.get(p, frozenset()))
        return out

    def stats(self, since=None):
        """Per worker: its clock and distance to the slowest worker's, and, over the pulls and
        updates after `since` (a time.perf_counter() value; None: the whole run), its first
        stage's average wait for pulled weights, the part of it that stage ran nothing (§8.4),
        and its minibatches and images per second."""
        clocks, global_clock = self.servers.clock.clocks()
        now = time.perf_counter()
        out = []
        for i, (w, vw) in enumerate(zip(self.worker_ids, self.vws)):
            ex = self._executors.get(i)
            pulls = [(asked, answered) for s, wave, asked, answered in vw.sync.pull_waits
                     if s == 0 and (since is None or answered > since)]
            waits = wait_and_idle(pulls, ex.first_stage_busy if ex else [])
            done = [t for t in self._completions.get(i, []) if since is None or t > since]
            start = since if since is not None else self._started
            rate = len(done) / ((done[-1] if since is None else now) - start) if done and start else 0.0
            out.append({"worker": w, "clock": clocks[w], "clock_distance": clocks[w] - global_clock,
                        "average_wait_s": sum(x for x, _ in waits) / len(waits) if waits else 0.0,
                        "average_idle_s": sum(y for _, y in waits) / len(waits) if waits else 0.0,
                        "minibatches_per_s": rate, "images_per_s": rate * (self.batch_sizes or [0] * (i + 1))[i]})
        return out


def stage_layer_servers(staged, stage_servers):
    """{layer name: the server of the stage that holds it}, for ``local`` placement (§8.1): each
    stage's layers on the server of its node."""
    return {layer_of(v.path): server for server, stage in zip(stage_servers, staged.stages)
            for v in list(stage.trainable_variables) + list(stage.non_trainable_variables)}
