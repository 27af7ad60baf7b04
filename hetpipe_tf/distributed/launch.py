"""Starting the tasks of a hetpipe_tf cluster on this machine, and connecting to it.

:class:`LocalCluster` starts parameter-server and worker tasks as processes
(:mod:`hetpipe_tf.distributed.server`), each a ``tf.distribute.Server`` on its own port, and makes
this process the cluster's chief: the client that drives every virtual worker's stages
on the worker tasks and keeps the global weights on the parameter-server tasks. Hosts
and ports are configurable per task (loopback is only the default). Every task's output
goes to a log file; a task that fails to start is reported with its log. Tasks end with
the process that started them, whether it exits, fails or is killed. Once connected, the
chief watches every task's heartbeats (:mod:`hetpipe_tf.distributed.heartbeat`): a task
that dies or stops answering for ``timeout_s`` is named in one line, ended, and training
stopped (:meth:`LocalCluster.on_lost`). :class:`TFConfigCluster` is the same cluster as the
chief sees it when its tasks were started elsewhere (``TF_CONFIG``: by :func:`launch`, or
on other hosts by hand). Both start the tasks the chief adds (the virtual workers'
processes) on a given node: LocalCluster itself, TFConfigCluster through that node's
worker task (:mod:`hetpipe_tf.distributed.starter`).
"""
import abc
import atexit
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from hetpipe_tf.distributed.cgroups import (
    CGROUP_ROOT,
    HOST_GROUP_ENV,
    CgroupError,
    CpuGroup,
    CpuGroups,
    host_procs_file,
    reap_orphans,
)
from hetpipe_tf.distributed.gpus import NO_GPU, GPULayout, gpu_layout, hide_gpus_here
from hetpipe_tf.distributed.heartbeat import HeartbeatMonitor, LostTask, Watched, poll
from hetpipe_tf.distributed.netlinks import EmulatedLinks
from hetpipe_tf.distributed.ports import free_port
from hetpipe_tf.distributed.resolvers import chief_environ
from hetpipe_tf.distributed.starter import (
    AUTHKEY_ENV,
    ClusterStartError,
    StarterClient,
    authkey_from,
    spawn,
    starter_file,
    wait_ready,
)
from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.planning.cluster import Cluster, load_cluster


def use_parallel_remote_ops() -> None:
    """Lets this process's threads run ops on one remote task at the same time.

    By default TensorFlow's eager client streams every op for a task through one gRPC
    stream, which that task runs one op after another: two pipeline stages on one task
    would never overlap, and a WSP pull waiting there would block every other op (a
    deadlock). Without streaming each op is its own call and they run concurrently
    (measured here: 1.1x -> 1.7-2.2x overlap for two stages on two cores). Takes effect
    for connections made after it.
    """
    os.environ["TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"] = "0"


def ps_device(task: int) -> str:
    """The TensorFlow device of parameter-server task `task` (its CPU)."""
    return f"/job:ps/task:{task}/device:CPU:0"


def worker_device(task: int, kind: str, index: int) -> str:
    """The TensorFlow device `kind`:`index` ("CPU" or "GPU") of worker task `task` (one per node)."""
    return f"/job:worker/task:{task}/device:{kind}:{index}"


@dataclass(frozen=True)
class TaskCommand:
    """How a task of a :class:`LocalCluster` is started: ``python -m module args`` with `env` added
    to this process's environment (its GPUs: :mod:`hetpipe_tf.distributed.gpus`)."""
    job: str
    index: int
    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


class ChiefCluster(abc.ABC):
    """What the chief of a cluster asks of it, whoever started its tasks: the tasks' addresses, the
    chief's connection, starting the tasks the chief adds (the virtual workers' processes, at a
    node), the tasks found lost, and forgetting a lost one. :class:`LocalCluster` and
    :class:`TFConfigCluster` are the two kinds."""

    def __init__(self, spec: dict[str, list[str]], timeout_s: float, start_timeout: float) -> None:
        self.spec = spec  # {job: [address, ...]} of the ps, worker and chief tasks
        self.timeout_s = float(timeout_s)
        self.start_timeout = float(start_timeout)
        self.monitor: HeartbeatMonitor | None = None  # the HeartbeatMonitor of the tasks watched
        self._addresses: dict[tuple[str, int], str] = {}  # (job, index) -> address of the tasks the chief started
        self._on_lost: list[Callable[[LostTask], object]] = []

    def address(self, job: str, index: int) -> str:
        """The TensorFlow address of task (job, index)."""
        return self.spec[job][index] if job in self.spec else self._addresses[(job, index)]

    def host(self, node: int) -> str:
        """The machine whose cores node `node`'s tasks share: its worker task's host."""
        return self.spec["worker"][node].rsplit(":", 1)[0]

    def on_lost(self, callback: Callable[[LostTask], object]) -> None:
        """Calls callback(LostTask) when a watched task is lost."""
        self._on_lost.append(callback)

    def lost_task(self, job: str, index: int, wait_s: float = 0.0) -> LostTask | None:
        """The :class:`hetpipe_tf.distributed.heartbeat.LostTask` of task (job, index), waiting up
        to `wait_s` for its heartbeat to say so (how it ended, or why it was given up), or None."""
        return poll(lambda: self.monitor.reported(job, index) if self.monitor else None, wait_s, 0.05)

    def _connect_as_chief(self) -> None:
        import tensorflow as tf  # late: defers TensorFlow

        use_parallel_remote_ops()
        tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(self.spec), job_name="chief", task_index=0,
                                                  make_master_device_default=False)

    def _told_lost(self, lost: LostTask) -> None:
        """Tells the other tasks and calls the callbacks (which stop training, or go on without a
        virtual worker's process)."""
        self.monitor.tell_lost(lost)
        for callback in self._on_lost:
            callback(lost)

    @abc.abstractmethod
    def connect(self) -> "ChiefCluster":
        """Makes this process the chief of the cluster (once per process); returns the cluster."""

    @abc.abstractmethod
    def start_tasks(self, tasks: Sequence[tuple[str, int, int, str, list[str]]]) -> None:
        """Starts tasks, each (job, index, node, module, args), on node `node`; waits until every
        one is ready and watches their heartbeats."""

    @abc.abstractmethod
    def forget(self, job: str, index: int) -> None:
        """Ends task (job, index) if it still runs and forgets it: it no longer counts as lost."""

    @abc.abstractmethod
    def find_lost(self, wait_s: float = 2.0) -> LostTask | None:
        """The task found lost (a LostTask), or None, waiting up to `wait_s` for it to show."""


class LocalCluster(ChiefCluster):
    """Parameter servers and workers as processes here; this process is the chief.

    Args:
      num_ps: parameter-server tasks.
      worker_cpus: for every worker task (one per virtual worker), its logical CPU devices.
      host: the address every task binds (a string, or a list per job: {"ps": [...], ...}).
      log_dir: where task logs go (default: a temporary directory).
      start_timeout: the longest a task may take to start.
      timeout_s: the longest a task may leave a heartbeat unanswered before it is lost
        (:mod:`hetpipe_tf.distributed.heartbeat`), and a task the chief's.
      task_starters: whether the worker tasks start processes for a chief that joins through
        TF_CONFIG (:class:`TFConfigCluster`; :func:`launch` asks for them).
      links: started :class:`hetpipe_tf.distributed.netlinks.EmulatedLinks` with a node per ps
        and worker task: node i's tasks (ps i, worker i, and tasks given its address) run in
        its network namespace at its address, the chief at the links' own address (`host`
        is then not used).
      cpu_quotas: per worker task (node), the cores of its CPU-quota group, or None for none:
        worker task i, which computes node i's stages, runs in a group of that quota from its
        first instruction (:mod:`hetpipe_tf.distributed.cgroups`); the ps tasks, this process
        (the chief) and the processes started at a node (:meth:`start_tasks`: a virtual
        worker's, the host's runtime that drives the devices) run outside every group, on the
        cores the quotas leave, as a GPU server's host CPU runs its Python while its GPUs
        compute (:mod:`hetpipe_tf.distributed.cluster_devices`). The groups are named by this process's pid and removed by :meth:`stop`, or, when
        this process ends first (a connected chief, or one killed), by a reaper process that
        waits for its end; a reaper killed too leaves them to the next quota cluster's start,
        which removes the groups of owners no longer alive.
      cgroup_root: where the cgroup filesystems are mounted.
      gpus: the :class:`hetpipe_tf.distributed.gpus.GPULayout` of the nodes (one per worker task):
        worker task i sees node i's GPUs only (``CUDA_VISIBLE_DEVICES``, each with its memory
        limit), the ps tasks and the processes started at a node (:meth:`start_tasks`) none.
        None: every task sees what this process sees.
    """

    def __init__(self, num_ps: int, worker_cpus: Sequence[int], host: str | dict[str, list[str]] = "127.0.0.1",
                 log_dir: str | None = None, start_timeout: float = 120.0, timeout_s: float = 300.0,
                 task_starters: bool = False, links: EmulatedLinks | None = None,
                 cpu_quotas: Sequence[float | None] | None = None, cgroup_root: str = CGROUP_ROOT,
                 gpus: GPULayout | None = None) -> None:
        self.worker_cpus = list(worker_cpus)
        if gpus is not None and len(gpus.nodes) != len(self.worker_cpus):
            raise ValueError(f"the GPU layout has {len(gpus.nodes)} nodes for {len(self.worker_cpus)} worker tasks; "
                             f"give one per worker task (node)")
        self.gpus = gpus
        self.links = links
        self.cpu_quotas = self._checked_quotas(cpu_quotas)
        self.cgroups: CpuGroups | None = None  # made with the first task of a node that has a quota
        self._cgroup_root = cgroup_root
        self._node_hosts: list[str] = []
        self._ports: dict[str, int] = {}  # ports given out per namespace address
        if links is not None:
            if not num_ps == len(self.worker_cpus) == links.num_nodes:
                raise ValueError(f"emulated links join {links.num_nodes} nodes, one ps and one worker task each; "
                                 f"got {num_ps} ps and {len(self.worker_cpus)} worker tasks")
            self._node_hosts = [links.address(i) for i in range(links.num_nodes)]
            host = {"ps": self._node_hosts, "worker": self._node_hosts, "chief": [links.chief_address]}
        hosts = host if isinstance(host, dict) else {"ps": [host] * num_ps,
                                                     "worker": [host] * len(self.worker_cpus),
                                                     "chief": [host]}
        super().__init__({job: [self.free_address(h) for h in hosts[job]] for job in ("ps", "worker", "chief")},
                         timeout_s, start_timeout)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="hetpipe_cluster_")
        os.makedirs(self.log_dir, exist_ok=True)
        self.authkey = os.urandom(16)  # the cluster's key (hetpipe_tf.distributed.starter)
        self.task_starters = task_starters
        self._procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self._heartbeats: dict[tuple[str, int], str] = {}
        self._connected = False

    def _checked_quotas(self, cpu_quotas: Sequence[float | None] | None) -> list[float | None]:
        if cpu_quotas is None:
            return [None] * len(self.worker_cpus)
        quotas = list(cpu_quotas)
        if len(quotas) != len(self.worker_cpus):
            raise ValueError(f"cpu_quotas gives {len(quotas)} quotas for {len(self.worker_cpus)} worker tasks; give "
                             f"one per worker task (node), None for a node without a quota")
        total, cores = sum(q for q in quotas if q is not None), len(os.sched_getaffinity(0))
        if total >= cores:
            raise CgroupError(f"the nodes' CPU quotas {quotas} total {total:g} cores, and this machine gives this "
                              f"process {cores}: nothing would be left to the chief and the parameter servers, and "
                              f"the quotas could not all be granted; scale them to total less than {cores}")
        return quotas

    def cpu_group(self, node: int) -> CpuGroup | None:
        """The CPU-quota group (:class:`hetpipe_tf.distributed.cgroups.CpuGroup`) of node `node`'s
        worker task, or None for a node without a quota. The first call
        that needs one makes every node's group (and removes those of owners no longer alive)."""
        if self.cpu_quotas[node] is None:
            return None
        if self.cgroups is None:
            groups = CpuGroups(self._cgroup_root)
            reap_orphans(groups.controller)
            groups.start_reaper()
            for n, quota in enumerate(self.cpu_quotas):
                if quota is not None:
                    groups.create(f"node{n}", quota)
            self.cgroups = groups
        return self.cgroups[f"node{node}"]

    def free_address(self, host: str) -> str:
        """A TensorFlow address HOST:PORT with a port free on `host`. An emulated node's
        namespace is a port space of its own, which only this cluster's tasks use."""
        if host not in self._node_hosts:
            return f"{host}:{free_port(host)}"
        self._ports[host] = self._ports.get(host, 20000) + 1
        return f"{host}:{self._ports[host]}"

    def host(self, node: int) -> str:
        """This machine: every task of a local cluster runs here, in a node's network namespace or not."""
        return "localhost"

    def node_host(self, node: int) -> str:
        """The address that node `node`'s tasks bind: its namespace's with emulated links,
        else the workers' host."""
        return self._node_hosts[node] if self._node_hosts else self.spec["worker"][node].rsplit(":", 1)[0]

    @property
    def tasks(self) -> list[tuple[str, int]]:
        """(job, index) of every task, ps tasks first."""
        return list(self._procs)

    def pid(self, job: str, index: int) -> int:
        return self._procs[(job, index)].pid

    def exit_status(self, job: str, index: int) -> str | None:
        """How task (job, index) ended ("exited with status 1", "killed by signal 9"), or None
        while it runs."""
        code = self._procs[(job, index)].poll()
        if code is None:
            return None
        return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def task_log(self, job: str, index: int) -> str:
        return os.path.join(self.log_dir, f"{job}-{index}.log")

    def task_commands(self) -> list[TaskCommand]:
        """How every ps and worker task is started, ps tasks first: its server's flags, and its GPUs
        (none for a ps task; its node's for a worker task, with their memory limits)."""
        commands = []
        for job, cpus in [("ps", [1] * len(self.spec["ps"])), ("worker", self.worker_cpus)]:
            for i, n in enumerate(cpus):
                args = [f"--cluster_spec={json.dumps(self.spec)}", f"--job_name={job}", f"--task_index={i}",
                        f"--logical_cpus={n}", f"--task_log_dir={self.log_dir}"]
                env: dict[str, str] = {}
                if self.gpus is not None:
                    env = self.gpus.worker_env(i) if job == "worker" else dict(NO_GPU)
                    args += self.gpus.worker_args(i) if job == "worker" else []
                commands.append(TaskCommand(job, i, "hetpipe_tf.distributed.server", args, env))
        return commands

    def added_task_env(self) -> dict[str, str]:
        """The GPUs of a process started at a node (:meth:`start_tasks`): none, with a GPU layout."""
        return {} if self.gpus is None else dict(NO_GPU)

    def start(self) -> "LocalCluster":
        """Starts every ps and worker task (each worker task in its node's CPU-quota group, if it
        has one, and with its node's GPUs) and waits until each says it is ready. A worker task in a
        group starts the processes a chief asks of it (:class:`TFConfigCluster`) outside it, in this
        process's group (:data:`hetpipe_tf.distributed.cgroups.HOST_GROUP_ENV`)."""
        for command in self.task_commands():
            group = self.cpu_group(command.index) if command.job == "worker" else None
            env = command.env if group is None else dict(command.env, **{HOST_GROUP_ENV: host_procs_file(group.controller)})
            self._spawn(command.job, command.index, command.module, command.args, keyed=self.task_starters,
                        group=group, env=env)
        for job, i in list(self._procs):
            self._wait_ready(job, i)
        return self

    def start_tasks(self, tasks: Sequence[tuple[str, int, int, str, list[str]]]) -> None:
        """Starts more tasks, each (job, index, node, module, args): ``python -m module args
        --address=HOST:PORT`` at an address of node `node`, outside every CPU-quota group (see
        `cpu_quotas`; it takes --parent_pid and --chief_timeout_s and prints the ready line of
        :mod:`hetpipe_tf.distributed.server`); waits until every one is ready and watches their
        heartbeats if the others' are watched."""
        for job, index, node, module, args in tasks:
            address = self.free_address(self.node_host(node))
            self._addresses[(job, index)] = address
            self._spawn(job, index, module, [*args, f"--address={address}"], keyed=True, group=None,
                        env=self.added_task_env())
        for job, index, *_ in tasks:
            self._wait_ready(job, index)
            if self.monitor is not None:
                self.monitor.add(self._watched(job, index))

    def _spawn(self, job: str, index: int, module: str, args: list[str], keyed: bool, group: CpuGroup | None,
               env: dict[str, str]) -> None:
        """Starts a task; `keyed`: with the cluster's key (a worker task then runs its starter);
        `group`: the CpuGroup it runs in, or None; `env`: added to its environment."""
        host = self.address(job, index).rsplit(":", 1)[0]
        wrap = None if group is None else group.command
        if host in self._node_hosts:  # in its node's network namespace (`ip netns exec` execs it: same pid)
            in_namespace = functools.partial(self.links.command, self._node_hosts.index(host))
            wrap = in_namespace if group is None else (lambda cmd: in_namespace(group.command(cmd)))
        self._procs[(job, index)] = spawn(module, args, self.task_log(job, index),
                                          env=dict(env, **({AUTHKEY_ENV: self.authkey.hex()} if keyed else {})),
                                          chief_timeout_s=self.timeout_s, wrap=wrap)

    def _wait_ready(self, job: str, i: int) -> None:
        try:
            self._heartbeats[(job, i)] = wait_ready(self._procs[(job, i)], self.task_log(job, i), f"{job}:{i}",
                                                    self.start_timeout)
        except ClusterStartError:
            self.stop()
            raise

    def connect(self) -> "LocalCluster":
        """Makes this process the chief of the cluster (once per process)."""
        if not self._connected:
            self._connect_as_chief()
            self._connected = True
            self.watch()
        return self

    def watch(self) -> "LocalCluster":
        """Starts watching every task's heartbeats (once; the chief's connect does it)."""
        if self.monitor is None:
            self.monitor = HeartbeatMonitor([self._watched(job, i) for job, i in self._procs], self.timeout_s,
                                            self._lost, exit_status=self.exit_status).start()
        return self

    def _watched(self, job: str, i: int) -> Watched:
        return Watched(job, i, self.address(job, i), self._heartbeats[(job, i)])

    @property
    def lost(self) -> LostTask | None:
        """The first task found lost (a :class:`hetpipe_tf.distributed.heartbeat.LostTask`), or
        None. A task that exited counts even before its heartbeat connection says so: a call
        to it may fail first."""
        if self.monitor and self.monitor.lost:
            return self.monitor.lost
        for job, i in self._procs:
            status = self.exit_status(job, i)
            if status:
                return LostTask(job, i, self.address(job, i), status)
        return None

    def find_lost(self, wait_s: float = 2.0) -> LostTask | None:
        """:attr:`lost`, waiting up to `wait_s` for it to show: a call to a task that was just
        killed can fail (its sockets close) before its exit can be seen."""
        return poll(lambda: self.lost, wait_s, 0.1)

    def forget(self, job: str, index: int) -> None:
        """Ends task (job, index) if it still runs and forgets it: it no longer counts as lost
        (:attr:`lost`), and a task started for it anew is watched afresh (a virtual worker's
        process the run went on without, :class:`hetpipe_tf.distributed.process_runner.ProcessRunner`)."""
        if self.monitor is not None:
            self.monitor.forget(job, index)
        proc = self._procs.pop((job, index), None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _lost(self, lost: LostTask) -> None:
        """A task is lost: says so in one line, ends it (gRPC calls waiting on a stopped task
        then fail instead of hanging), tells the other tasks, and calls the callbacks (which
        stop training, or go on without a virtual worker's process)."""
        print(f"hetpipe: {lost}", file=sys.stderr, flush=True)
        proc = self._procs.get((lost.job, lost.index))
        if proc is not None and proc.poll() is None:
            proc.kill()
        self._told_lost(lost)

    def ps_devices(self) -> list[str]:
        return [ps_device(i) for i in range(len(self.spec["ps"]))]

    def worker_devices(self, worker: int, kind: str = "CPU") -> list[str]:
        return [worker_device(worker, kind, j) for j in range(self.worker_cpus[worker])]

    def tf_config(self) -> str:
        """TF_CONFIG for the chief (to hand to a program that connects itself)."""
        return json.dumps({"cluster": self.spec, "task": {"type": "chief", "index": 0}})

    def stop(self) -> None:
        """Ends every task, unless this process is connected to the cluster: TensorFlow cannot
        disconnect a client, and tasks ended under it make it fail at exit, so a connected
        chief's tasks end when the chief does (each task watches the process that started it)."""
        if self._connected:
            return
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        if self.cgroups is not None:
            self.cgroups.remove_all()
        if self.task_starters:
            for address in self.spec["worker"]:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(starter_file(address))

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClusterConfigError(HetPipeUsageError, ValueError):
    """TF_CONFIG is missing or does not describe the cluster asked for."""


class TFConfigCluster(ChiefCluster):
    """The cluster in ``TF_CONFIG``, whose ps and worker tasks were started elsewhere (by
    ``hetpipe launch``, or on each host by hand with
    ``python -m hetpipe_tf.distributed.server``); this process is its chief.

    The cluster must have `num_ps` ``ps`` tasks, `num_workers` ``worker`` tasks and a
    ``chief``, and TF_CONFIG's task must be the chief. Tasks this chief starts
    (:meth:`start_tasks`: the virtual workers' processes) are started by the worker task of
    their node (:class:`hetpipe_tf.distributed.starter.TaskStarter`), which needs the
    cluster's key in ``HETPIPE_AUTHKEY`` here as in every task; the chief watches their
    heartbeats, and ``hetpipe launch`` the ps and worker tasks' (:func:`reported_lost`).

    Args:
        num_ps: the number of ``ps`` tasks the cluster must have.
        num_workers: the number of ``worker`` tasks the cluster must have.
        timeout_s: how long, in seconds, a call to a task may take before it counts as lost.
        start_timeout: how long, in seconds, a started task may take to answer.
        environ: where ``TF_CONFIG`` and ``HETPIPE_AUTHKEY`` are read (None: ``os.environ``).

    Raises:
        ClusterConfigError: ``TF_CONFIG`` is missing, malformed, has other tasks than asked, does
            not name this process its chief, or ``HETPIPE_AUTHKEY`` is not set.
    """

    def __init__(self, num_ps: int, num_workers: int, timeout_s: float = 300.0, start_timeout: float = 120.0,
                 environ: Mapping[str, str] | None = None) -> None:
        environ = environ if environ is not None else os.environ
        text = environ.get("TF_CONFIG")
        if not text:
            raise ClusterConfigError("launch='tf_config' needs TF_CONFIG (start the tasks with `hetpipe launch`, "
                                     "which sets it for the chief)")
        try:
            config = json.loads(text)
            spec, task = config["cluster"], config.get("task", {})
        except (ValueError, KeyError, TypeError) as e:
            raise ClusterConfigError(f"TF_CONFIG is not a JSON object with a 'cluster' ({e}): "
                                     f"{text[:200]!r}") from None
        want = {"ps": num_ps, "worker": num_workers, "chief": 1}
        got = {job: len(spec.get(job, [])) for job in want}
        if got != want:
            raise ClusterConfigError(f"TF_CONFIG's cluster has {got} tasks; this cluster description needs {want} "
                                     f"(one ps and one worker task per node, in node order, and one chief)")
        if task.get("type") != "chief" or int(task.get("index", 0)) != 0:
            raise ClusterConfigError(f"this process must be TF_CONFIG's chief (task 0), got task {task}")
        self.authkey = authkey_from(environ)
        if self.authkey is None:
            raise ClusterConfigError(f"launch='tf_config' needs the cluster's key in {AUTHKEY_ENV}, the same as the "
                                     f"tasks' (`hetpipe launch` sets it; on other hosts, set the same hex value for "
                                     f"every task and the chief)")
        super().__init__(spec, timeout_s, start_timeout)
        self._environ = environ
        self._starters: dict[int, StarterClient] = {}  # node -> StarterClient
        self._started_by: dict[tuple[str, int], int] = {}  # (job, index) -> node

    def connect(self) -> "TFConfigCluster":
        """Makes this process the chief of the cluster (once per process)."""
        self._connect_as_chief()
        return self

    def _starter(self, node: int) -> StarterClient:
        """The task starter of node `node`'s worker task, its address read on that host through
        TensorFlow (:func:`hetpipe_tf.distributed.starter.starter_file`)."""
        import tensorflow as tf  # late: defers TensorFlow

        if node not in self._starters:
            address = self.spec["worker"][node]
            try:
                with tf.device(worker_device(node, "CPU", 0)):
                    starter = tf.io.read_file(starter_file(address)).numpy().decode()
            except tf.errors.NotFoundError:
                raise ClusterConfigError(f"worker task {node} at {address} runs no task starter: start it with "
                                         f"{AUTHKEY_ENV} set to the chief's key") from None
            self._starters[node] = StarterClient(starter, self.authkey, self.timeout_s)
        return self._starters[node]

    def start_tasks(self, tasks: Sequence[tuple[str, int, int, str, list[str]]]) -> None:
        """Starts tasks, each (job, index, node, module, args), by node `node`'s worker task:
        ``python -m module args --address=HOST:PORT`` on its host; waits until every one is
        ready, and watches their heartbeats."""
        for job, index, node, module, args in tasks:
            address, heartbeat, _ = self._starter(node).start(job, index, module, args, self.timeout_s,
                                                               self.start_timeout)
            self._addresses[(job, index)] = address
            self._started_by[(job, index)] = node
            watched = Watched(job, index, address, heartbeat)
            if self.monitor is None:
                self.monitor = HeartbeatMonitor([watched], self.timeout_s, self._lost).start()
            else:
                self.monitor.add(watched)

    def _lost(self, lost: LostTask) -> None:
        """As :meth:`LocalCluster._lost`: one line; the task ended by the worker task that started
        it; the others told; the callbacks called."""
        print(f"hetpipe: {lost}", file=sys.stderr, flush=True)
        try:
            self._starters[self._started_by[(lost.job, lost.index)]].end(lost.job, lost.index)
        except (OSError, EOFError, TimeoutError) as e:
            print(f"hetpipe: could not end {lost.job}:{lost.index} ({e}); it ends when this chief does",
                  file=sys.stderr, flush=True)
        self._told_lost(lost)

    def forget(self, job: str, index: int) -> None:
        """As :meth:`LocalCluster.forget`: the task is ended by the worker task that started it."""
        if self.monitor is not None:
            self.monitor.forget(job, index)
        node = self._started_by.pop((job, index), None)
        if node is not None:
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self._starters[node].end(job, index)

    def find_lost(self, wait_s: float = 2.0) -> LostTask | None:
        """The task lost, or None: one that ``hetpipe launch`` reported (a ps or worker task:
        the cause when the processes it started were lost with it), else one of this chief's."""
        return reported_lost(self._environ, wait_s) or (self.monitor.lost if self.monitor else None)


def local_gpus(description: Cluster) -> GPULayout:
    """The GPUs of `description`'s nodes on this machine (:func:`hetpipe_tf.distributed.gpus.gpu_layout`),
    said on stderr when some node has GPUs."""
    layout = gpu_layout(description)
    if layout.has_gpus:
        print(layout.describe(), file=sys.stderr, flush=True)
    return layout


#: This process as a cluster's chief: TensorFlow connects a process to one cluster only.
_chief: dict[str, Any] = {}


def join_cluster(description: Cluster, launch: str, timeout_s: float, start_timeout: float,
                 log_dir: str | None = None, emulate_links: bool = False,
                 on_lost: Callable[[LostTask], object] | None = None, resolver: Any = None) -> ChiefCluster:
    """Starts (launch "processes": a :class:`LocalCluster` here, with emulated links between its
    nodes if `emulate_links`) or joins (launch "tf_config": :class:`TFConfigCluster`, of TF_CONFIG
    or of TensorFlow's cluster `resolver`, :mod:`hetpipe_tf.distributed.resolvers`) the cluster of
    `description` (a :class:`hetpipe_tf.planning.cluster.Cluster`), once per process, and makes this
    process its chief; returns the cluster. A later call in the same process gets the same cluster
    if it has the same shape, else an error saying that the process is another cluster's chief.
    `on_lost(LostTask)`: what a lost task now calls (the last caller's)."""
    shape = [len(description.nodes), [n.count for n in description.nodes]] + (["emulated links"] if emulate_links
                                                                               else [])
    if _chief:
        if _chief["shape"] != shape or _chief["launch"] != launch:
            raise RuntimeError(f"this process already drives a {_chief['launch']} cluster of {_chief['shape']} (ps "
                               f"tasks, devices per worker task); TensorFlow connects a process to one cluster "
                               f"only, so this one ({launch}, {shape}) needs a new process")
        _chief["on_lost"] = on_lost
        return _chief["cluster"]
    if launch == "processes":
        links = None
        if emulate_links:
            links = EmulatedLinks(shape[0], 8 * description.inter_node_bandwidth,
                                  description.inter_node_latency).start()
            atexit.register(links.stop)  # after the tasks, which end with this process
        gpus = local_gpus(description)
        cluster = LocalCluster(num_ps=shape[0], worker_cpus=shape[1], log_dir=log_dir, links=links,
                               start_timeout=start_timeout, timeout_s=timeout_s,
                               cpu_quotas=description.node_quotas(), gpus=gpus).start()
        if gpus.has_gpus and not hide_gpus_here():
            print("hetpipe: this process's TensorFlow started before the cluster did, so it keeps this machine's "
                  "GPUs visible (an op it runs there takes memory on a node's GPU); start the strategy's scope "
                  "before running TensorFlow", file=sys.stderr, flush=True)
        cluster.connect()
    else:
        environ = None
        if resolver is not None:

            environ = chief_environ(resolver, description)
        cluster = TFConfigCluster(num_ps=shape[0], num_workers=shape[0], timeout_s=timeout_s,
                                  start_timeout=start_timeout, environ=environ).connect()
    cluster.on_lost(lambda lost: _chief["on_lost"] and _chief["on_lost"](lost))
    _chief.update(shape=shape, launch=launch, cluster=cluster, on_lost=on_lost)
    return cluster


#: The environment variable naming the file where `hetpipe launch` writes the task it lost.
LOST_TASK_FILE_ENV = "HETPIPE_LOST_TASK_FILE"


def reported_lost(environ: Mapping[str, str] | None = None, wait_s: float = 2.0) -> LostTask | None:
    """The task that `hetpipe launch` found lost (a LostTask), or None: read from the file
    named by HETPIPE_LOST_TASK_FILE, waiting up to `wait_s` for it (a call to a dead task may
    fail before the launcher's heartbeat says so)."""
    path = (environ if environ is not None else os.environ).get(LOST_TASK_FILE_ENV)
    if not path:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path) as f:
                return LostTask(**json.load(f))
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)


def launch(cluster: str | Cluster, command: Sequence[str], log_dir: str | None = None, host: str = "127.0.0.1",
           start_timeout: float = 120.0, timeout_s: float = 300.0, out: TextIO = sys.stdout,
           emulate_links: bool | None = None) -> int:
    """Runs `command` as the chief of a cluster started here for `cluster` (a description).

    Starts one ps and one worker task per node of the description (the worker with a
    logical CPU per device), runs `command` with TF_CONFIG naming it the chief, reports a
    task that ends early with its log, and stops every task when the command ends, fails
    or is interrupted (Ctrl-C). It watches the tasks' heartbeats: a task lost (dead, or
    silent for `timeout_s`) is named in one line, ended, and written to the file in the
    chief's HETPIPE_LOST_TASK_FILE (its error then names the task); a chief still running
    10 s later is ended. With `emulate_links` (None: the description's ``links.emulate``)
    each node's tasks run in a network namespace of their own, joined by emulated links
    (:mod:`hetpipe_tf.distributed.netlinks`), and `host` is not used. A node of GPUs gets them as
    under launch="processes" (:mod:`hetpipe_tf.distributed.gpus`). Returns the command's exit status.
    """

    description = load_cluster(cluster)
    nodes = description.nodes
    links = None
    if description.emulate_links if emulate_links is None else emulate_links:
        links = EmulatedLinks(len(nodes), 8 * description.inter_node_bandwidth, description.inter_node_latency)
    with contextlib.ExitStack() as stack:
        if links is not None:
            stack.enter_context(links)
        return _launch(description, command, links, log_dir, host, start_timeout, timeout_s, out)


def _launch(description: Cluster, command: Sequence[str], links: EmulatedLinks | None, log_dir: str | None,
            host: str, start_timeout: float, timeout_s: float, out: TextIO) -> int:
    nodes = description.nodes
    local = LocalCluster(num_ps=len(nodes), worker_cpus=[n.count for n in nodes], host=host, log_dir=log_dir,
                         start_timeout=start_timeout, timeout_s=timeout_s, task_starters=True, links=links,
                         cpu_quotas=description.node_quotas(), gpus=local_gpus(description))
    local.start()
    lost_file = os.path.join(local.log_dir, "lost-task.json")
    lost_at: list[float] = []

    def report(lost: LostTask) -> None:
        with open(lost_file + ".tmp", "w") as f:
            json.dump({"job": lost.job, "index": lost.index, "address": lost.address, "reason": lost.reason}, f)
        os.replace(lost_file + ".tmp", lost_file)
        lost_at.append(time.monotonic())

    local.on_lost(report)
    local.watch()
    print(f"hetpipe launch: {len(nodes)} ps and {len(nodes)} worker tasks for cluster '{description.name}' "
          f"({', '.join(f'{n.name}: {n.count} devices' for n in nodes)}); task logs in {local.log_dir}",
          file=out, flush=True)
    chief = subprocess.Popen(command, env=dict(os.environ, TF_CONFIG=local.tf_config(),
                                               **{LOST_TASK_FILE_ENV: lost_file, AUTHKEY_ENV: local.authkey.hex()}))
    reported: set[tuple[str, int]] = set()
    try:
        while chief.poll() is None:
            if lost_at and time.monotonic() - lost_at[0] > 10.0:
                print("hetpipe launch: the chief did not end within 10 s of losing a task; ending it",
                      file=out, flush=True)
                _end(chief)
                break
            for job, i in local.tasks:
                status = local.exit_status(job, i)
                if status and (job, i) not in reported:
                    reported.add((job, i))
                    with open(local.task_log(job, i)) as f:
                        tail = f.read()[-2000:]
                    print(f"hetpipe launch: task {job}:{i} ended ({status}); its log "
                          f"({local.task_log(job, i)}):\n{tail}", file=out, flush=True)
            time.sleep(0.5)
        return chief.returncode if chief.returncode >= 0 else 1  # ended by a signal
    except KeyboardInterrupt:
        _end(chief)
        print("hetpipe launch: interrupted; every task stopped", file=out, flush=True)
        return 130
    finally:
        local.monitor.stop()
        local.stop()


def _end(proc: "subprocess.Popen[bytes]") -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
