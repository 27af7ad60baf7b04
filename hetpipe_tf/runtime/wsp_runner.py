"""Several virtual workers trained together by Wave Synchronous Parallel (HetPipe §3, §5), or by
another scheme on the parameter servers (BSP, SSP, ASP: per-minibatch clocks, §2.2).

Every virtual worker is a :class:`hetpipe_tf.runtime.virtual_worker.VirtualWorker` whose schedule
pushes each wave's aggregated update to the parameter servers and pulls the global
weights, waiting until every worker has pushed wave c - D; the workers run concurrently,
each on its own devices (which may be remote tasks of TensorFlow's distributed runtime),
and the global weights end in the Keras model.

:class:`BoundWorkers` are virtual workers bound to a run's servers, given: all of a run's
workers, or those a worker's process drives (:mod:`hetpipe_tf.distributed.worker_process`).
:class:`WSPRunner` is a run in this process that owns its servers: it builds them from the
run's :class:`hetpipe_tf.sync.parameter_server.ServerLayout` (:func:`server_layout`), builds new
ones after an aborted run, decides the run's one dilation and is what ``fit`` trains.

With uneven minibatches (``minibatch_sizes``, beyond the paper; :mod:`hetpipe_tf.planning.uneven`)
worker i trains b_i samples per minibatch (:func:`hetpipe_tf.runtime.worker_data.worker_shards`)
and the servers weight its pushes by n · b_i / B, so that with D = 0 and Nm = 1 the global
step is SGD's on the concatenated batch of the round
(:mod:`hetpipe_tf.sync.parameter_server`).
"""
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from hetpipe_tf.pipeline.emulation import EmulationReport
from hetpipe_tf.pipeline.executor import ExecutionReport
from hetpipe_tf.pipeline.simulator import wait_and_idle
from hetpipe_tf.pipeline.trace import TraceRecorder
from hetpipe_tf.planning.uneven import push_weights
from hetpipe_tf.runtime.checkpoint import (PlanCuts, RunState, set_stage_optimizer_state, skip_consumed,
                                           stage_optimizer_state)
from hetpipe_tf.runtime.fit_loop import Events, done_event, start_thread
from hetpipe_tf.runtime.optimizers import check_for_workers
from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.stage_rewrite import StagedModel
from hetpipe_tf.runtime.update_times import UpdateTimes
from hetpipe_tf.runtime.virtual_worker import Dilation, VirtualWorker, decide_dilation
from hetpipe_tf.sync.parameter_server import ParameterServers, ServerLayout, layer_of

#: A minibatch: (inputs, labels).
Minibatch = tuple


class BoundWorkers:
    """Virtual workers of a run bound to its parameter servers under staleness bound D.

    Args:
      vws: the :class:`VirtualWorker` s, made from the run's `config` (their `sync` is set here).
      config: the run's :class:`RunConfig`: Nm (the same for every worker, §4), the staleness bound
        and the scheme (WSP's D, §5; BSP, SSP, ASP), the timeouts and the minibatch sizes (one per
        worker of the run; ``train`` takes the data as given).
      servers: the run's :class:`ParameterServers` (of this process, or attached to another's).
      worker_ids: the run's index of each worker in `vws` (default 0, 1, ...): a process that
        drives worker 3 of a run gives [3].
    """

    def __init__(self, vws: Sequence[VirtualWorker], config: RunConfig, servers: ParameterServers,
                 worker_ids: Sequence[int] | None = None):
        self.vws = list(vws)
        self.config = config
        self.worker_ids = tuple(worker_ids) if worker_ids is not None else tuple(range(len(self.vws)))
        if len(self.worker_ids) != len(self.vws):
            raise ValueError(f"{len(self.vws)} workers but {len(self.worker_ids)} worker ids")
        sizes, run_workers = config.minibatch_sizes, max(self.worker_ids) + 1
        if sizes is not None and len(sizes) < run_workers:
            raise ValueError(f"{len(sizes)} minibatch sizes {list(sizes)} for {run_workers} virtual workers: "
                             f"give one per worker of the run, or None for the data's batch size")
        self.bind(servers)
        self.trace = None
        self._executors = {}
        self._updates = UpdateTimes(len(self.vws))
        self._optimizer_states = None  # to give the stages once they are built (a resumed run)
        self.batch_sizes = None  # each worker's, once built

    def bind(self, servers: ParameterServers) -> None:
        """Binds every worker to `servers` (a run's, not aborted)."""
        self.servers = servers
        self.aborted = None  # why the run was aborted, if it was
        for w, vw in zip(self.worker_ids, self.vws):
            vw.sync = self.config.sync.bind(w, servers, self.config.staleness_bound, self.config.timeout_s)

    @property
    def num_workers(self) -> int:
        return len(self.vws)

    @property
    def emulated(self) -> bool:
        return any(vw.emulated for vw in self.vws)

    def build(self, data: Sequence[Iterable[Minibatch]]) -> tuple[list[Minibatch], list[Iterator[Minibatch]]]:
        """Builds every worker for the first minibatch of its data (`data`: one iterable per worker)
        and gives a resumed run's optimizer state to the stages; returns each worker's first
        minibatch and the rest of its data."""
        if len(data) != self.num_workers:
            raise ValueError(f"{self.num_workers} workers but data for {len(data)}")
        if self.aborted:
            raise RuntimeError(f"this run was aborted ({self.aborted}) and its parameter servers belong to another "
                               f"process: that process starts a new run")
        iterators = [iter(d) for d in data]
        firsts = [next(it) for it in iterators]
        # Build and trace one worker at a time.
        self.batch_sizes = [vw.prepare(*first) for vw, first in zip(self.vws, firsts)]
        if self._optimizer_states is not None:
            self.set_optimizer_states(self._optimizer_states)
            self._optimizer_states = None
        return firsts, iterators

    def train(self, data: Sequence[Iterable[Minibatch]], steps: int, dilation: Dilation, trace: bool = False,
              on_minibatch_done: Callable | None = None,
              on_started: Callable[[float], None] | None = None) -> list[ExecutionReport]:
        """Trains every worker on `steps` minibatches of its own data (one iterable per worker) at the
        run's `dilation`; returns their ExecutionReports. on_minibatch_done(worker, p, logs);
        on_started(time) once the workers are built."""
        firsts, rest = self.build(data)
        return self.run(firsts, rest, steps, dilation, trace, on_minibatch_done, on_started)

    def run(self, firsts: Sequence[Minibatch], rest: Sequence[Iterator[Minibatch]], steps: int | Sequence[int],
            dilation: Dilation, trace: bool = False, on_minibatch_done: Callable | None = None,
            on_started: Callable[[float], None] | None = None) -> list[ExecutionReport]:
        """Trains the built workers (:meth:`build`) on `steps` minibatches (each worker's, or as many
        for every worker), each from its first one on."""
        counts = [steps] * self.num_workers if isinstance(steps, int) else list(steps)
        if trace:
            metadata = {"hetpipe_tf": f"{self.num_workers} virtual workers, {self.config.sync.name.upper()} "
                                      f"D={self.config.staleness_bound}"}
            emulation = self.vws[0].trace_metadata(dilation).get("emulation")
            self.trace = TraceRecorder(metadata=dict(metadata, emulation=emulation) if emulation else metadata)
        else:
            self.trace = None
        reports, errors = [None] * self.num_workers, []
        self._updates = UpdateTimes(self.num_workers)
        for vw in self.vws:
            vw.sync.pull_waits.clear()
        started = time.perf_counter()
        self._updates.started(started)
        if on_started:
            on_started(started)

        def run(i: int) -> None:
            def chain() -> Iterator[Any]:
                yield firsts[i]
                yield from rest[i]

            def done(p: int, logs: dict[str, Any]) -> None:
                self._updates.done(i, time.perf_counter())
                if on_minibatch_done:
                    on_minibatch_done(i, p, logs)

            try:
                reports[i] = self.vws[i].train(chain(), counts[i], trace=self.trace or False, on_minibatch_done=done,
                                               executor_hook=lambda ex: self._executors.__setitem__(i, ex),
                                               dilation=dilation)
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
        return reports

    def stage_compute_s(self, i: int) -> list[float]:
        """Worker `i`'s seconds of device compute per stage in the current run so far (each stage's
        passes on its device: an emulated device's paced times); empty before the run starts."""
        ex = self._executors.get(i)
        return [report.compute_s for report in ex.reports] if ex is not None else []

    def images_per_s(self) -> float:
        """Images per second of the current (or last) run, every worker together: the samples of
        the updates completed so far over the time since the run started."""
        return self._updates.images_per_s(self.batch_sizes or ())

    def abort(self, reason: str = "the run was stopped") -> None:
        """Stops every worker now, and ends the run at the servers: every pull, waiting or later,
        of any worker of the run (in any process) fails at once, naming `reason`."""
        if not self.aborted:
            self.aborted = reason
            self.servers.abort(reason)
        for ex in list(self._executors.values()):
            ex.abort()

    def request_stop(self) -> None:
        """Asks every worker to admit no more minibatches (those in flight complete)."""
        for ex in list(self._executors.values()):
            ex.request_stop()

    def emulation_report(self) -> EmulationReport | None:
        """Every worker's emulation in the current (or last) run together (None if none is emulated)."""
        return EmulationReport.combine(vw.emulation_report() for vw in self.vws)

    def probe(self, dilation: float, minibatches: Sequence[Minibatch], workers: int | None = None) -> EmulationReport:
        """One probe run of every worker at once at `dilation` (each on copies of its minibatch
        in `minibatches`, nothing kept); their EmulationReport together. `workers`: how many
        workers of the run probe at the same time, here and in other processes (default: these),
        which sets the probe's length. The probes do the workers' side of the synchronisation
        but not the servers' (their waits and sums), which share the host's cores in the real
        run: the calibration's steps of margin cover them."""
        reports, errors = [None] * self.num_workers, []
        n = self.vws[0].probe_minibatches(workers or self.num_workers)

        def run(i: int) -> None:
            try:
                reports[i] = self.vws[i].probe_emulation(minibatches[i], dilation, n)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        for t in [start_thread(lambda i=i: run(i), f"hetpipe-probe-{i}") for i in range(self.num_workers)]:
            t.join()
        if errors:
            raise errors[0]
        return EmulationReport.combine(reports)

    def finish(self) -> None:
        """Puts the global weights and state into the Keras model, and worker 0's state that the
        servers do not keep (random seeds)."""
        for rt in self.vws[0].runtimes:
            for v, value in zip(rt.stage.non_trainable_variables, rt.non_trainable):
                if v.path not in self.servers.variables:
                    v.assign(value.value)
        self.servers.write_to(self.vws[0].model)

    def drain(self) -> None:
        """After a train (every update pushed, the global weights in the Keras model): every
        stage takes the global weights, as a run after an aborted one does."""
        for vw in self.vws:
            for rt in vw.runtimes or ():
                rt.load_model_weights()

    def optimizer_states(self) -> list[dict]:
        """Per worker, its optimizer state per model variable
        (:func:`hetpipe_tf.runtime.checkpoint.stage_optimizer_state`)."""
        return [stage_optimizer_state(vw.runtimes, vw.model) for vw in self.vws]

    def set_optimizer_states(self, states: Sequence[dict | None]) -> None:
        """Gives every worker's stages their optimizer variables' values (`states` as
        :meth:`optimizer_states` gives them): now if they are built, else once they are."""
        if all(vw.runtimes is not None for vw in self.vws):
            for vw, values in zip(self.vws, states):
                set_stage_optimizer_state(vw.runtimes, values, vw.model)
        else:
            self._optimizer_states = states

    def stage_optimizers(self) -> list[keras.optimizers.Optimizer]:
        """Every stage's copy of the optimizer."""
        return [rt.optimizer for vw in self.vws for rt in vw.runtimes or []]

    def provenance(self, stage: int = 0) -> dict:
        """{(worker, minibatch): (local updates, global (worker, wave) pushes)} that `stage`'s
        weight versions held, for :func:`hetpipe_tf.sync.staleness.check`."""
        out = {}
        for w, vw in zip(self.worker_ids, self.vws):
            record = vw.runtimes[stage].provenance
            for p, local in record.used_versions.items():
                out[(w, p)] = (local, record.used_globals.get(p, frozenset()))
        return out

    def stats(self, since: float | None = None) -> list[dict]:
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
            done = [t for t in self._updates.of(i) if since is None or t > since]
            start = since if since is not None else self._updates.start
            rate = len(done) / ((done[-1] if since is None else now) - start) if done and start else 0.0
            out.append({"worker": w, "clock": clocks[w], "clock_distance": clocks[w] - global_clock,
                        "average_wait_s": sum(x for x, _ in waits) / len(waits) if waits else 0.0,
                        "average_idle_s": sum(y for _, y in waits) / len(waits) if waits else 0.0,
                        "minibatches_per_s": rate, "images_per_s": rate * (self.batch_sizes or [0] * (i + 1))[i]})
        return out


class WSPRunner:
    """Every virtual worker of a run, in this process, synchronised through parameter servers it
    owns (:class:`BoundWorkers` bound to them).

    Args:
      model: a built Keras model (every worker cuts it into its own stages).
      workers: a :class:`WorkerSpec` per virtual worker.
      config: the run's :class:`RunConfig` (resolved: Nm an integer), as for :class:`BoundWorkers`,
        and the placement of the global weights (``local`` puts every layer on the server of the
        node that trains it in worker 0: `stage_servers` of its stage, §8.1), the optimizer, loss
        and metrics, the dilation (None: one for every worker, calibrated by probe runs of every
        worker at once before the first training, as they share the host) and the minibatch sizes
        (uneven: ``fit`` splits the data so, and the servers weight the pushes by
        :func:`hetpipe_tf.planning.uneven.push_weights`).
      ps_devices: the parameter-server devices.
    """

    def __init__(self, model: keras.Model, workers: Sequence[WorkerSpec], config: RunConfig,
                 ps_devices: Sequence[str]):
        check_for_workers(config.optimizer, len(workers))
        sizes = config.minibatch_sizes
        if sizes is not None and len(sizes) != len(workers):
            raise ValueError(f"{len(sizes)} minibatch sizes {list(sizes)} for {len(workers)} virtual workers: "
                             f"give one per worker, or None for the data's batch size")
        vws = [VirtualWorker.from_config(model, w, config) for w in workers]
        self.model = model
        self.config = config
        self.layout = server_layout(vws[0].staged, workers[0], config, ps_devices, [vw.num_stages for vw in vws])
        self.group = BoundWorkers(vws, config, self.layout.servers(model))
        self._dilation = None  # the run's, decided before its first training
        self._fit_data = None

    # The bound workers' ------------------------------------------------------------------
    @property
    def vws(self) -> list[VirtualWorker]:
        return self.group.vws

    @property
    def servers(self) -> ParameterServers:
        """The run's parameter servers (new ones after an aborted run)."""
        return self.group.servers

    @property
    def aborted(self) -> str | None:
        """Why the last run was aborted, if it was."""
        return self.group.aborted

    @property
    def trace(self) -> TraceRecorder | None:
        """The trace of the last training, when traced."""
        return self.group.trace

    @property
    def batch_sizes(self) -> list[int] | None:
        """Each worker's minibatch size, once built."""
        return self.group.batch_sizes

    @property
    def num_workers(self) -> int:
        return self.group.num_workers

    @property
    def emulated(self) -> bool:
        return self.group.emulated

    @property
    def num_in_flight(self) -> int:
        return self.config.num_in_flight

    def provenance(self, stage: int = 0) -> dict:
        """As :meth:`BoundWorkers.provenance`."""
        return self.group.provenance(stage)

    def stats(self, since: float | None = None) -> list[dict]:
        """As :meth:`BoundWorkers.stats`."""
        return self.group.stats(since)

    def images_per_s(self) -> float:
        """As :meth:`BoundWorkers.images_per_s`."""
        return self.group.images_per_s()

    def abort(self, reason: str = "the run was stopped") -> None:
        """As :meth:`BoundWorkers.abort`: the next training gets new servers."""
        self.group.abort(reason)

    def request_stop(self) -> None:
        self.group.request_stop()

    def stage_optimizers(self) -> list[keras.optimizers.Optimizer]:
        return self.group.stage_optimizers()

    def drain(self) -> None:
        self.group.drain()

    # The run's own -----------------------------------------------------------------------
    def train(self, data: Sequence[Iterable[Minibatch]], steps: int | Sequence[int], trace: bool = False,
              on_minibatch_done: Callable | None = None,
              on_started: Callable[[float], None] | None = None) -> list[ExecutionReport]:
        """Trains every worker on `steps` minibatches of its own data (a list, one iterable per
        worker; `steps` one count per worker, or one for all); returns their ExecutionReports. on_minibatch_done(worker, p, logs); on_started(time)
        once the workers are built and the run's dilation decided. After an aborted run its
        servers take no more pulls: this run gets new ones, and every worker starts from the
        Keras model's weights (those of the last completed epoch)."""
        if self.aborted:
            self.group.bind(self.layout.servers(self.model))
            self.group.drain()
        firsts, rest = self.group.build(data)
        if self._dilation is None:
            self._dilation = decide_dilation(self.config.dilation, self.emulated,
                                             lambda d: self.group.probe(d, firsts))
        return self.group.run(firsts, rest, steps, self._dilation, trace, on_minibatch_done, on_started)

    def emulation_report(self) -> EmulationReport | None:
        """Every worker's emulation in the current (or last) run together, with the run's
        calibration (None if none is emulated)."""
        report = self.group.emulation_report()
        probes = self._dilation.probes if self._dilation is not None else ()
        return report and dataclasses.replace(report, calibration=probes)

    def run_state(self, epoch: int, positions: Sequence[int], plan: PlanCuts | None) -> RunState:
        """The run as a checkpoint holds it, between epochs (after :meth:`drain`)."""
        return RunState(epoch=epoch, weights=[v.numpy() for v in self.model.variables],
                        optimizers=self.group.optimizer_states(),
                        clocks=list(self.servers.clock.clocks()[0]), positions=list(positions), plan=plan)

    def resume(self, state: RunState) -> None:
        """Continues the run `state` holds: its clocks at the servers now, its optimizer state in
        the stages once built (its weights are already in the Keras model and the servers)."""
        self.servers.advance_clocks(state.clocks)
        self.group.set_optimizer_states(state.optimizers)

    def keep_workers(self, previous: "WSPRunner") -> list[int]:
        """Takes over the virtual workers of `previous` (the same run under another plan, drained)
        that would be built again as they are (:meth:`VirtualWorker.can_go_on_as`): their stages,
        state and traced calls go on under this run's configuration and servers, and only the
        workers whose devices or cuts changed are built. Returns the indices of those kept."""
        kept = [w for w, (new, old) in enumerate(zip(self.vws, previous.vws)) if old.can_go_on_as(new)]
        for w in kept:
            previous.vws[w].go_on_under(self.config)
            self.group.vws[w] = previous.vws[w]
        self.group.bind(self.servers)
        return kept

    # What fit asks of a runner (hetpipe_tf.runtime.fit_loop.GlobalWeightsRunner) ----------
    trains_by_epoch = False

    def begin_fit(self, shards: Sequence[Iterable], positions: Sequence[int]) -> None:
        self._fit_data = [iter(s) for s in skip_consumed(shards, positions)]

    def release_fit_data(self) -> None:
        self._fit_data = None

    def fit_data(self) -> list[Iterator[Minibatch]]:
        """Each worker's stream of the fit's minibatches, where it is now (:meth:`begin_fit`)."""
        return list(self._fit_data or ())

    def continue_fit(self, data: Sequence[Iterator[Minibatch]]) -> None:
        """Takes over another runner's fit where its workers are in their streams (`data`: its
        :meth:`fit_data`), a run that goes on under this runner's plan."""
        self._fit_data = list(data)

    def train_fit(self, steps: Sequence[int], trace: bool = False, on_minibatch_done: Callable | None = None,
                  on_started: Callable[[float], None] | None = None) -> None:
        """Trains each worker `steps` more minibatches of the fit's data, from where it stands
        (:meth:`fit_data`), as :meth:`train`."""
        self.train(self._fit_data, steps, trace, on_minibatch_done, on_started)

    def stage_compute_s(self, worker: int) -> list[float]:
        """As :meth:`BoundWorkers.stage_compute_s`."""
        return self.group.stage_compute_s(worker)

    def train_segment(self, steps: Sequence[int], events: Events, first: bool, trace: bool,
                      epoch_ends: Sequence[int]) -> None:
        k = self.num_workers
        self.train_fit(steps, trace, done_event(events),
                       (lambda t: [events.put("started", t) for _ in range(k)]) if first else None)

    def after_drain(self, positions: Sequence[int]) -> None:
        pass

    def epoch_weights(self, events: Events, stopped: bool) -> None:
        self.group.finish()

    def evaluate(self, dataset: tf.data.Dataset) -> dict:
        return self.vws[0].evaluate(dataset)

    def epoch_logs(self) -> dict:
        return {"global_clock": self.servers.clock.clocks()[1]}

    def end_fit(self) -> None:
        pass


def server_layout(staged: StagedModel, worker0: WorkerSpec, config: RunConfig, ps_devices: Sequence[str],
                  stages_per_worker: Sequence[int]) -> ServerLayout:
    """Where a run's global weights live: on `ps_devices`, placed as `config` says (``local``: each
    layer on the server of the node of worker 0's stage that holds it, `worker0.stage_servers`,
    §8.1; `staged`: worker 0's stages), each worker's pushes weighted by its share of the samples
    under uneven minibatch sizes (:func:`hetpipe_tf.planning.uneven.push_weights`)."""
    layer_devices = None
    if config.placement == "local":
        if not worker0.stage_servers or len(worker0.stage_servers) != staged.num_stages:
            raise ValueError(f"local placement needs worker 0's stage_servers, one per stage ({staged.num_stages}), "
                             f"got {worker0.stage_servers!r}")
        layer_devices = stage_layer_servers(staged, worker0.stage_servers)
    weights = tuple(push_weights(config.minibatch_sizes)) if config.minibatch_sizes else None
    return ServerLayout(tuple(ps_devices), tuple(stages_per_worker), config.placement, layer_devices, weights)


def stage_layer_servers(staged: StagedModel, stage_servers: Sequence[str]) -> dict[str, str]:
    """{layer name: the server of the stage that holds it}, for ``local`` placement (§8.1): each
    stage's layers on the server of its node."""
    return {layer_of(v.path): server for server, stage in zip(stage_servers, staged.stages)
            for v in list(stage.trainable_variables) + list(stage.non_trainable_variables)}
