"""The process that drives one virtual worker (HetPipe §3, §8: a worker process per virtual worker).

    python -m hetpipe_tf.distributed.worker_process --chief=HOST:PORT --worker=W \\
        --address=HOST:PORT --cluster_spec='{"ps": [...], "worker": [...]}' --local_devices=N

Started for the chief (:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`) on the
virtual worker's home node, by the chief itself or by that node's worker task
(:mod:`hetpipe_tf.distributed.starter`). The
process joins TensorFlow's cluster as a client of its own (job ``vwW``, the only client
its cluster spec names: two clients naming each other hang TensorFlow 2.21's connect):
the parameter-server tasks, whose global weights and WSP clock it attaches to by name
(:class:`hetpipe_tf.sync.parameter_server.ParameterServers` given ``variable_devices``), and
the worker tasks of other nodes, which run the stages it places there (their tensors
cross nodes through TensorFlow's runtime). The stages on its own node run on its own
devices (one logical CPU per emulated device). It trains with a
:class:`hetpipe_tf.runtime.wsp_runner.WSPRunner` of this one worker, so its pipeline,
pushes and pulls are exactly those of the in-process runtime, and it reads its shard
of the data itself (:mod:`hetpipe_tf.distributed.dataset_transfer`).

Orders come from the chief over an authenticated connection
(``multiprocessing.connection``, the cluster's key in the environment variable
``HETPIPE_AUTHKEY``; the process first says ``("hello", W)``); each is a tuple, answered
on the same connection (a failed order by ``("error", kind, message, logs)``):

* ``("job", dict)``: build the model, the worker and its data -> ``("ready", batch size,
  description)``
* ``("probe", dilation, workers)``: one emulation probe -> ``("probed", EmulationReport)``
* ``("train", data, steps, dilation, calibration, trace)``: train ->
  ``("started", t)``, ``("done", (logs, t))`` per minibatch, then ``("finished", trace)``
  (None, or the trace's origin and events)
  or ``("failed", kind, message, logs)``; `data` None: go on in the last train's data where
  it ended (a checkpointing run's next epoch)
* ``("drain",)``: after a train, every stage takes the global weights
  (:meth:`hetpipe_tf.runtime.wsp_runner.WSPRunner.drain`) -> ``("drained",)``
* ``("optimizer_state",)`` -> ``("optimizer_state", state)``: its optimizer state per model
  variable (:func:`hetpipe_tf.runtime.checkpoint.stage_optimizer_state`), for a checkpoint;
  ``("set_optimizer_state", state)``: a resumed run's -> ``("optimizer_state_set",)``
* ``("stop",)``, ``("abort",)``, ``("learning_rate", value)``: as in ``fit``;
  ``("stats", since)`` -> ``("stats", list)``; ``("report",)`` -> ``("report", EmulationReport)``

Times are ``time.perf_counter()`` (CLOCK_MONOTONIC, common to the processes of one host).
The process answers the chief's heartbeats (:mod:`hetpipe_tf.distributed.heartbeat`) and
ends when the chief ends, closes the connection or goes silent for ``--chief_timeout_s``.
"""
import json
import multiprocessing.connection
import os
import pickle
import sys
import threading
import time

from absl import app, flags

from hetpipe_tf.distributed.heartbeat import HeartbeatResponder, end_with_parent
from hetpipe_tf.distributed.starter import AUTHKEY_ENV

flags.DEFINE_string("chief", None, "The chief's order connection, HOST:PORT.")
flags.DEFINE_integer("worker", None, "The virtual worker this process drives (its index in the run).")
flags.DEFINE_string("address", None, "This process's TensorFlow address, HOST:PORT.")
flags.DEFINE_string("cluster_spec", None, "The servers as JSON: {\"ps\": [...], \"worker\": [...]}.")
flags.DEFINE_integer("local_devices", 1, "Logical CPU devices of this process (its node's emulated devices).")
flags.DEFINE_integer("parent_pid", 0, "End when this process ends (default: the parent).")
flags.DEFINE_float("chief_timeout_s", 0.0, "End when the chief sends no heartbeat for this long (0: never).")
FLAGS = flags.FLAGS


def job_name(worker):
    """The TensorFlow job of the process that drives virtual worker `worker`."""
    return f"vw{worker}"


def local_device(worker, index):
    """The TensorFlow name of logical CPU `index` of the process driving `worker`."""
    return f"/job:{job_name(worker)}/replica:0/task:0/device:CPU:{index}"


class _Worker:
    """The process's state: its runner, data and the training thread."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.runner = None
        self.first = None
        self.data = None  # the iterator of the last train's data

    def send(self, *message):
        with self.lock:
            self.conn.send(message)

    def build(self, job):
        import keras

        from hetpipe_tf.distributed.dataset_transfer import dataset_from_bytes
        from hetpipe_tf.runtime.wsp_runner import WSPRunner
        from hetpipe_tf.sync.parameter_server import ParameterServers

        model = keras.models.model_from_json(job["model"])
        model.set_weights(job["weights"])
        compiled = pickle.loads(job["compiled"])
        servers = ParameterServers(model, job["ps_devices"], job["stages_per_worker"], run=job["run"],
                                   variable_devices=job["variable_devices"])
        self.runner = WSPRunner(
            model, [job["spec"]], num_in_flight=job["num_in_flight"], staleness_bound=job["staleness_bound"],
            ps_devices=job["ps_devices"], placement=job["placement"],
            optimizer=keras.optimizers.deserialize(job["optimizer"]), loss=compiled["loss"],
            metrics=compiled["metrics"], loss_weights=compiled["loss_weights"], dilation=job["dilation"],
            timeout_s=job["timeout_s"], servers=servers, worker_ids=[FLAGS.worker], schedule=job["schedule"],
            sync=job["sync"])
        self.first = next(iter(dataset_from_bytes(*job["data"])))
        return self.runner.vws[0].prepare(*self.first)

    def train(self, data, steps, dilation, calibration, trace):
        from hetpipe_tf.distributed.dataset_transfer import dataset_from_bytes

        self.runner.set_dilation(dilation, calibration)
        if data is not None:
            self.data = iter(dataset_from_bytes(*data))

        def run():
            try:
                self.runner.train([self.data], steps, trace=trace,
                                  on_minibatch_done=lambda w, p, logs: self.send(
                                      "done", ({k: float(v) for k, v in logs.items()}, time.perf_counter())),
                                  on_started=lambda t: self.send("started", t))
                recorder = self.runner.trace
                self.send("finished", (recorder.origin, recorder.events()) if recorder else None)
            except BaseException as exc:  # noqa: BLE001 - reported to the chief
                self.send("failed", *describe_error(exc))

        threading.Thread(target=run, name="hetpipe-train", daemon=True).start()

    def serve(self, order):
        kind, args = order[0], order[1:]
        if kind == "job":
            batch_size = self.build(*args)
            self.send("ready", batch_size, self.runner.vws[0].describe())
        elif kind == "probe":
            dilation, workers = args
            self.send("probed", self.runner.probe(dilation, [self.first], workers=workers))
        elif kind == "train":
            self.train(*args)
        elif kind == "drain":
            self.runner.drain()
            self.send("drained")
        elif kind == "optimizer_state":
            self.send("optimizer_state", self.runner.optimizer_states()[0])
        elif kind == "set_optimizer_state":
            self.runner.set_optimizer_states([args[0]])
            self.send("optimizer_state_set")
        elif kind == "stop":
            self.runner.request_stop()
        elif kind == "abort":
            self.runner.abort()
        elif kind == "learning_rate":
            for vw in self.runner.vws:
                for rt in vw.runtimes or []:
                    rt.optimizer.learning_rate = args[0]
        elif kind == "stats":
            self.send("stats", self.runner.stats(since=args[0]))
        elif kind == "report":
            self.send("report", self.runner.emulation_report())
        else:
            raise ValueError(f"unknown order {kind!r} from the chief")


def describe_error(exc):
    """(kind, message, logs) of a failure, for the chief: kind is the exception's class name, or
    ``NonFiniteError`` (with the minibatch's logs) when a non-finite loss caused it."""
    from hetpipe_tf.runtime.stage_runtime import NonFiniteError

    cause = exc if isinstance(exc, NonFiniteError) else exc.__cause__
    if isinstance(cause, NonFiniteError):
        return "NonFiniteError", str(exc), cause.logs
    return type(exc).__name__, str(exc) or repr(exc), None


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    end_with_parent(FLAGS.parent_pid or os.getppid())
    name = f"{job_name(FLAGS.worker)} (virtual worker {FLAGS.worker})"

    def end(message, failed):
        print(f"hetpipe_tf {name}: ending: {message}", flush=True)
        os._exit(1 if failed else 0)  # TensorFlow cannot disconnect a client

    host = FLAGS.address.rsplit(":", 1)[0]
    heartbeat = HeartbeatResponder(host, 0, chief_timeout_s=FLAGS.chief_timeout_s or None, on_end=end,
                                   on_lost_task=lambda m: print(f"hetpipe_tf {name}: {m}", flush=True)).start()
    import tensorflow as tf

    from hetpipe_tf.distributed.launch import use_parallel_remote_ops
    from hetpipe_tf.ops.loader import load_ops
    from hetpipe_tf.planning.devices import DeviceSpec
    from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices

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
    worker.send("hello", FLAGS.worker)
    while True:
        try:
            order = conn.recv()
        except (EOFError, OSError):
            end("the chief closed its order connection", False)
        try:
            worker.serve(order)
        except BaseException as exc:  # noqa: BLE001 - reported to the chief, which decides
            print(f"hetpipe_tf {name}: order {order[0]!r} failed: {exc!r}", file=sys.stderr, flush=True)
            worker.send("error", *describe_error(exc))


if __name__ == "__main__":
    flags.mark_flags_as_required(["chief", "worker", "address", "cluster_spec"])
    app.run(main)
