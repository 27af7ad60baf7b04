"""Starting the tasks of a hetpipe_tf cluster on this machine, and connecting to it.

:class:`LocalCluster` starts parameter-server and worker tasks as processes
(:mod:`hetpipe_tf.server`), each a ``tf.distribute.Server`` on its own port, and makes
this process the cluster's chief: the client that drives every virtual worker's stages
on the worker tasks and keeps the global weights on the parameter-server tasks. Hosts
and ports are configurable per task (loopback is only the default). Every task's output
goes to a log file; a task that fails to start is reported with its log. Tasks end with
the process that started them, whether it exits, fails or is killed.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


class ClusterStartError(RuntimeError):
    """A task of the cluster did not start."""


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def use_parallel_remote_ops():
    """Lets this process's threads run ops on one remote task at the same time.

    By default TensorFlow's eager client streams every op for a task through one gRPC
    stream, which that task runs one op after another: two pipeline stages on one task
    would never overlap, and a WSP pull waiting there would block every other op (a
    deadlock). Without streaming each op is its own call and they run concurrently
    (measured here: 1.1x -> 1.7-2.2x overlap for two stages on two cores). Takes effect
    for connections made after it.
    """
    os.environ["TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"] = "0"


class LocalCluster:
    """Parameter servers and workers as processes here; this process is the chief.

    Args:
      num_ps: parameter-server tasks.
      worker_cpus: for every worker task (one per virtual worker), its logical CPU devices.
      host: the address every task binds (a string, or a list per job: {"ps": [...], ...}).
      log_dir: where task logs go (default: a temporary directory).
    """

    def __init__(self, num_ps, worker_cpus, host="127.0.0.1", log_dir=None, start_timeout=120.0):
        self.worker_cpus = list(worker_cpus)
        hosts = host if isinstance(host, dict) else {"ps": [host] * num_ps,
                                                     "worker": [host] * len(self.worker_cpus),
                                                     "chief": [host]}
        self.spec = {job: [f"{h}:{free_port(h)}" for h in hosts[job]] for job in ("ps", "worker", "chief")}
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="hetpipe_cluster_")
        self.start_timeout = start_timeout
        self._procs = {}
        self._connected = False

    def task_log(self, job, index):
        return os.path.join(self.log_dir, f"{job}-{index}.log")

    def start(self):
        """Starts every ps and worker task and waits until each says it is ready."""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        for job, cpus in [("ps", [1] * len(self.spec["ps"])), ("worker", self.worker_cpus)]:
            for i, n in enumerate(cpus):
                log = open(self.task_log(job, i), "w")
                cmd = [sys.executable, "-m", "hetpipe_tf.server", f"--cluster_spec={json.dumps(self.spec)}",
                       f"--job_name={job}", f"--task_index={i}", f"--logical_cpus={n}",
                       f"--parent_pid={os.getpid()}"]
                self._procs[(job, i)] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        deadline = time.monotonic() + self.start_timeout
        for (job, i), (proc, _) in self._procs.items():
            while True:
                with open(self.task_log(job, i)) as f:
                    if "ready at" in f.read():
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = open(self.task_log(job, i)).read()[-2000:]
                    self.stop()
                    why = f"exited with {proc.returncode}" if proc.returncode is not None else \
                        f"was not ready after {self.start_timeout:g} s"
                    raise ClusterStartError(f"task {job}:{i} {why}; its log ({self.task_log(job, i)}):\n{tail}")
                time.sleep(0.1)
        return self

    def connect(self):
        """Makes this process the chief of the cluster (once per process)."""
        import tensorflow as tf

        if not self._connected:
            use_parallel_remote_ops()
            tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(self.spec), job_name="chief",
                                                      task_index=0, make_master_device_default=False)
            self._connected = True
        return self

    def ps_devices(self):
        return [f"/job:ps/task:{i}/device:CPU:0" for i in range(len(self.spec["ps"]))]

    def worker_devices(self, worker, kind="CPU"):
        return [f"/job:worker/task:{worker}/device:{kind}:{j}" for j in range(self.worker_cpus[worker])]

    def tf_config(self):
        """TF_CONFIG for the chief (to hand to a program that connects itself)."""
        return json.dumps({"cluster": self.spec, "task": {"type": "chief", "index": 0}})

    def stop(self):
        """Ends every task, unless this process is connected to the cluster: TensorFlow cannot
        disconnect a client, and tasks ended under it make it fail at exit, so a connected
        chief's tasks end when the chief does (each task watches the process that started it)."""
        if self._connected:
            return
        for proc, log in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc, log in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        self._procs.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
