"""One task of a hetpipe_tf cluster on TensorFlow's distributed runtime.

    python -m hetpipe_tf.distributed.server --cluster_spec='{"ps": [...], "worker": [...], "chief": [...]}' \\
        --job_name=worker --task_index=0 --logical_cpus=2

A ``tf.distribute.Server`` (gRPC) with hetpipe_tf's custom ops loaded, so that the chief
can run stages, weight stashes and the WSP clock on it. A worker task gets one logical
CPU device per emulated device of its node; with the cluster's key in ``HETPIPE_AUTHKEY``
it also starts, on the chief's request, the processes of the virtual workers whose home
is its node, as its own children (:class:`hetpipe_tf.distributed.starter.TaskStarter`,
their logs in ``--task_log_dir``). The task answers the chief's
heartbeats (:mod:`hetpipe_tf.distributed.heartbeat`), logs the task the chief reports
lost, and ends, with one line saying why, when the chief ends or goes silent for
``--chief_timeout_s``; it also ends with its parent (the launcher or the chief): no
server is left behind.
"""
import json
import os
import sys
import tempfile

from absl import app, flags

from hetpipe_tf.distributed.gpus import server_config
from hetpipe_tf.distributed.heartbeat import HeartbeatResponder, end_with_parent
from hetpipe_tf.distributed.starter import TaskStarter, authkey_from
from hetpipe_tf.ops.loader import load_ops

flags.DEFINE_string("cluster_spec", None, "The cluster as JSON: {job: [host:port, ...]}.")
flags.DEFINE_string("job_name", None, "This task's job (ps, worker).")
flags.DEFINE_integer("task_index", 0, "This task's index in its job.")
flags.DEFINE_integer("logical_cpus", 1, "Logical CPU devices of this task (one per emulated device).")
flags.DEFINE_integer("intra_op_threads", 1, "TensorFlow intra-op threads.")
flags.DEFINE_list("gpu_memory_mb", [], "Per GPU this task sees (CUDA_VISIBLE_DEVICES), its memory limit in MiB; the "
                  "task's GPUs grow their memory as needed up to it (hetpipe_tf.distributed.gpus). Empty: "
                  "TensorFlow's defaults.")
flags.DEFINE_integer("parent_pid", 0, "End when this process ends (default: the parent).")
flags.DEFINE_integer("heartbeat_port", 0, "The port of this task's heartbeats (0: a free one; the ready line says).")
flags.DEFINE_float("chief_timeout_s", 0.0, "End when the chief sends no heartbeat for this long (0: never).")
flags.DEFINE_string("task_log_dir", None, "Where the logs of the processes this task starts go (default: a temporary "
                    "directory).")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    end_with_parent(FLAGS.parent_pid or os.getppid())
    import tensorflow as tf  # late: after the parent watch starts: TensorFlow takes seconds to import

    load_ops()
    config = server_config(FLAGS.logical_cpus, FLAGS.intra_op_threads, [int(m) for m in FLAGS.gpu_memory_mb])
    spec = json.loads(FLAGS.cluster_spec)
    name = f"{FLAGS.job_name}:{FLAGS.task_index}"

    def end(message: str, failed: bool) -> None:
        print(f"hetpipe_tf server {name}: ending: {message}", flush=True)
        os._exit(1 if failed else 0)  # the TensorFlow server has no clean stop

    host = spec[FLAGS.job_name][FLAGS.task_index].rsplit(":", 1)[0]
    heartbeat = HeartbeatResponder(host, FLAGS.heartbeat_port, chief_timeout_s=FLAGS.chief_timeout_s or None,
                                   on_end=end, on_lost_task=lambda m: print(f"hetpipe_tf server {name}: {m}",
                                                                            flush=True)).start()
    authkey = authkey_from()
    if FLAGS.job_name == "worker" and authkey is not None:  # before the server: the chief looks for it then
        log_dir = FLAGS.task_log_dir or tempfile.mkdtemp(prefix="hetpipe_task_")
        os.makedirs(log_dir, exist_ok=True)
        TaskStarter(host, authkey, log_dir).start(spec[FLAGS.job_name][FLAGS.task_index])
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=FLAGS.job_name,
                                  task_index=FLAGS.task_index, protocol="grpc", config=config, start=True)
    print(f"hetpipe_tf server {name} (pid {os.getpid()}) ready at {server.target}; heartbeat at "
          f"{heartbeat.address}", flush=True)
    sys.stdout.flush()
    server.join()


if __name__ == "__main__":
    flags.mark_flags_as_required(["cluster_spec", "job_name"])
    app.run(main)
