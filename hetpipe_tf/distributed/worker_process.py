"""The process that drives one virtual worker (HetPipe §3, §8: a worker process per virtual worker).

    python -m hetpipe_tf.distributed.worker_process --chief=HOST:PORT --worker=W \\
        --address=HOST:PORT --cluster_spec='{"ps": [...], "worker": [...]}' --local_devices=N

Started for the chief (:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`) on the
virtual worker's home node, by the chief itself or by that node's worker task
(:mod:`hetpipe_tf.distributed.starter`). The
process joins TensorFlow's cluster as a client of its own (job ``vwW``, the only client
its cluster spec names: two clients naming each other hang TensorFlow 2.21's connect):
the parameter-server tasks, whose global weights and WSP clock it attaches to by name
(the :class:`hetpipe_tf.sync.parameter_server.ServerLayout` its job carries), and
the worker tasks of other nodes, which run the stages it places there (their tensors
cross nodes through TensorFlow's runtime). The stages on its own node run on its own
devices (one logical CPU per emulated device). It trains with
:class:`hetpipe_tf.runtime.wsp_runner.BoundWorkers` of this one worker, at the run's dilation
that each training order carries, so its pipeline,
pushes and pulls are exactly those of the in-process runtime, and it reads its shard
of the data itself (:mod:`hetpipe_tf.distributed.dataset_transfer`).

Orders come from the chief over an authenticated connection
(``multiprocessing.connection``, the cluster's key in the environment variable
``HETPIPE_AUTHKEY``), as the typed messages of :mod:`hetpipe_tf.distributed.protocol`: the
process first says :class:`~hetpipe_tf.distributed.protocol.Hello`, answers every order with its
answer type (or :class:`~hetpipe_tf.distributed.protocol.Error`), and while it trains sends
``Started``, ``Done`` per minibatch, then ``Finished`` or ``Failed``. A :class:`Job` builds the
worker: it attaches to the run's servers and splits the model. A run that re-plans sends a
:class:`~hetpipe_tf.distributed.protocol.Rebuild` at a drained point: the same process builds
its worker again under the new plan's cuts and Nm, keeping its model and its data where it
stands.

Times are ``time.perf_counter()`` (CLOCK_MONOTONIC, common to the processes of one host).
The process answers the chief's heartbeats (:mod:`hetpipe_tf.distributed.heartbeat`) and
ends when the chief ends, closes the connection or goes silent for ``--chief_timeout_s``.
"""
import json
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from absl import app, flags

from hetpipe_tf.distributed import protocol
from hetpipe_tf.distributed.protocol import job_name
from hetpipe_tf.distributed.heartbeat import HeartbeatResponder, end_with_parent
from hetpipe_tf.distributed.launch import use_parallel_remote_ops
from hetpipe_tf.distributed.starter import AUTHKEY_ENV
from hetpipe_tf.ops.loader import load_ops
from hetpipe_tf.planning.devices import DeviceSpec
from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices

if TYPE_CHECKING:
    import numpy as np

    from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
    from hetpipe_tf.runtime.wsp_runner import BoundWorkers
    from hetpipe_tf.sync.parameter_server import ServerLayout

flags.DEFINE_string("chief", None, "The chief's order connection, HOST:PORT.")
flags.DEFINE_integer("worker", None, "The virtual worker this process drives (its index in the run).")
flags.DEFINE_string("address", None, "This process's TensorFlow address, HOST:PORT.")
flags.DEFINE_string("cluster_spec", None, "The servers as JSON: {\"ps\": [...], \"worker\": [...]}.")
flags.DEFINE_integer("local_devices", 1, "Logical CPU devices of this process (its node's emulated devices).")
flags.DEFINE_integer("processes_on_host", 1, "Virtual workers' processes on this machine, this one included: "
                     "each takes its share of the cores as TensorFlow's intra-op threads.", lower_bound=1)
flags.DEFINE_integer("parent_pid", 0, "End when this process ends (default: the parent).")
flags.DEFINE_float("chief_timeout_s", 0.0, "End when the chief sends no heartbeat for this long (0: never).")
FLAGS = flags.FLAGS


class _Worker:
    """The process's state: its runner, data and the training thread."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.runner: "BoundWorkers | None" = None
        self.model: Any = None  # the job's Keras model, every plan's stages cut from it
        self.worker = 0  # the virtual worker of the job
        self.first: Any = None  # the job's first minibatch (inputs, labels)
        self.data: Iterator[Any] | None = None  # the iterator of the last train's data
        self.stage_compute = False  # the job's: each Done carries the stages' compute

    def send(self, message: Any) -> None:
        with self.lock:
            self.conn.send(message)

    def build(self, job: protocol.Job) -> protocol.Ready:
        from hetpipe_tf.distributed.dataset_transfer import dataset_from_bytes  # late: defers TensorFlow
        from hetpipe_tf.runtime.model_transport import unpack_model  # late: defers TensorFlow

        self.model, self.worker = unpack_model(job.model_json), job.worker
        self.stage_compute = job.stage_compute
        self.first = next(iter(dataset_from_bytes(*job.data)))
        return self._bind(job.spec, job.config, job.weights, job.servers)

    def rebuild(self, order: protocol.Rebuild) -> protocol.Ready:
        """The worker under another plan (:class:`protocol.Rebuild`): its data stays where it
        stands, its stages are built anew (or, with `keep`, kept as built, under the new Nm) from
        the global weights and take its optimizer state."""
        kept = None
        if order.keep:
            assert self.runner is not None
            kept = self.runner.vws[0]
            kept.go_on_under(order.config)
        ready = self._bind(order.spec, order.config, order.weights, order.servers, kept)
        self.runner.set_optimizer_states([order.optimizer_state])
        return ready

    def _bind(self, spec: "WorkerSpec", config: "RunConfig", weights: "list[np.ndarray]",
              servers: "ServerLayout", kept: "VirtualWorker | None" = None) -> protocol.Ready:
        """Builds the worker of `spec` from `weights`, bound to `servers`, its stages built for the
        job's first minibatch (and, emulated, their solo times measured); or binds `kept`, the
        worker as built, whose stages take `weights`."""
        from hetpipe_tf.runtime.virtual_worker import VirtualWorker  # late: defers TensorFlow
        from hetpipe_tf.runtime.wsp_runner import BoundWorkers  # late: defers TensorFlow

        self.model.set_weights(weights)
        vw = kept or VirtualWorker.from_config(self.model, spec, config)
        self.runner = BoundWorkers([vw], config, servers.servers(self.model), worker_ids=[self.worker])
        if kept is not None:
            self.runner.drain()  # its stages take the global weights
        return protocol.Ready(vw.prepare(*self.first), vw.describe())

    def train(self, order: protocol.Train) -> None:
        from hetpipe_tf.distributed.dataset_transfer import dataset_from_bytes  # late: defers TensorFlow

        if order.data is not None:
            self.data = iter(dataset_from_bytes(*order.data))

        def done(w: int, p: int, logs: dict[str, Any]) -> None:
            compute = tuple(self.runner.stage_compute_s(0)) if self.stage_compute else ()
            self.send(protocol.Done({k: float(v) for k, v in logs.items()}, time.perf_counter(), p, compute))

        def run() -> None:
            try:
                self.runner.train([self.data], order.steps, order.dilation, trace=order.trace,
                                  on_minibatch_done=done, on_started=lambda t: self.send(protocol.Started(t)))
                recorder = self.runner.trace
                self.send(protocol.Finished((recorder.origin, recorder.events()) if recorder else None))
            except BaseException as exc:  # noqa: BLE001 - reported to the chief
                self.send(protocol.Failed(*describe_error(exc)))

        threading.Thread(target=run, name="hetpipe-train", daemon=True).start()

    def set_learning_rate(self, order: protocol.SetLearningRate) -> None:
        for optimizer in self.runner.stage_optimizers():
            optimizer.learning_rate = order.value

    def serve(self, order: Any) -> None:
        """Carries out one order of the chief; sends its answer, if it has one."""
        handlers = {
            protocol.Job: self.build,
            protocol.Rebuild: self.rebuild,
            protocol.Probe: lambda o: protocol.Probed(self.runner.probe(o.dilation, [self.first], workers=o.workers)),
            protocol.Train: self.train,
            protocol.Drain: lambda o: (self.runner.drain(), protocol.Drained())[1],
            protocol.GetOptimizerState: lambda o: protocol.OptimizerState(self.runner.optimizer_states()[0]),
            protocol.SetOptimizerState: lambda o: (self.runner.set_optimizer_states([o.state]),
                                                   protocol.OptimizerStateSet())[1],
            protocol.Stop: lambda o: self.runner.request_stop(),
            protocol.Abort: lambda o: self.runner.abort(),
            protocol.SetLearningRate: self.set_learning_rate,
            protocol.GetStats: lambda o: protocol.Stats(self.runner.stats(since=o.since)),
            protocol.GetReport: lambda o: protocol.Report(self.runner.emulation_report()),
        }
        handler = handlers.get(type(order))
        if handler is None:
            raise ValueError(f"unknown order {order!r} from the chief; the orders are: "
                             f"{', '.join(sorted(t.__name__ for t in handlers))}")
        answer = handler(order)
        if order.answer is not None:
            self.send(answer)


def describe_error(exc: BaseException) -> tuple[str, str, dict[str, float] | None]:
    """(kind, message, logs) of a failure, for the chief: kind is the exception's class name, or
    ``NonFiniteError`` (with the minibatch's logs) when a non-finite loss caused it."""
    from hetpipe_tf.runtime.stage.verdicts import NonFiniteError  # late: defers TensorFlow

    cause = exc if isinstance(exc, NonFiniteError) else exc.__cause__
    if isinstance(cause, NonFiniteError):
        return "NonFiniteError", str(exc), cause.logs
    return type(exc).__name__, str(exc) or repr(exc), None


def intra_op_threads(cores: int, processes_on_host: int) -> int:
    """The intra-op threads of one of `processes_on_host` virtual workers' processes on a machine
    of `cores` cores: its share, at least one. In one process the workers' stages share one pool
    of the cores' threads; a pool of every core per process would put more threads than cores
    on the machine, all computing at once."""
    return max(1, cores // processes_on_host)


def main(argv: Sequence[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # No GPU, before TensorFlow starts CUDA: the GPUs of this host are its nodes' worker tasks'
    # (hetpipe_tf.distributed.gpus), whichever process started this one.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    end_with_parent(FLAGS.parent_pid or os.getppid())
    name = f"{job_name(FLAGS.worker)} (virtual worker {FLAGS.worker})"

    def end(message: str, failed: bool) -> NoReturn:
        print(f"hetpipe_tf {name}: ending: {message}", flush=True)
        os._exit(1 if failed else 0)  # TensorFlow cannot disconnect a client

    host = FLAGS.address.rsplit(":", 1)[0]
    heartbeat = HeartbeatResponder(host, 0, chief_timeout_s=FLAGS.chief_timeout_s or None, on_end=end,
                                   on_lost_task=lambda m: print(f"hetpipe_tf {name}: {m}", flush=True)).start()
    import tensorflow as tf  # late: defers TensorFlow (the heartbeat answers while it loads)


    tf.config.threading.set_intra_op_parallelism_threads(
        intra_op_threads(len(os.sched_getaffinity(0)), FLAGS.processes_on_host))
    load_ops()
    # Before connecting. Its own devices are logical CPUs; a GPU of this host belongs to the
    # node's worker task, which runs the stages placed on it.
    tf.config.set_visible_devices([], "GPU")
    configure_tensorflow_devices([DeviceSpec("emulated")] * FLAGS.local_devices)
    spec = dict(json.loads(FLAGS.cluster_spec), **{job_name(FLAGS.worker): [FLAGS.address]})
    use_parallel_remote_ops()
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec), job_name=job_name(FLAGS.worker),
                                              task_index=0, make_master_device_default=False)
    print(f"hetpipe_tf {name} (pid {os.getpid()}) ready at {FLAGS.address}; heartbeat at {heartbeat.address}",
          flush=True)
    chief_host, chief_port = FLAGS.chief.rsplit(":", 1)
    conn = multiprocessing.connection.Client((chief_host, int(chief_port)),
                                             authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    worker = _Worker(conn)
    worker.send(protocol.Hello(FLAGS.worker))
    while True:
        try:
            order = conn.recv()
        except (EOFError, OSError):
            end("the chief closed its order connection", False)
        try:
            worker.serve(order)
        except BaseException as exc:  # noqa: BLE001 - reported to the chief, which decides
            print(f"hetpipe_tf {name}: order {type(order).__name__} failed: {exc!r}", file=sys.stderr, flush=True)
            worker.send(protocol.Error(*describe_error(exc)))


if __name__ == "__main__":
    flags.mark_flags_as_required(["chief", "worker", "address", "cluster_spec"])
    app.run(main)
