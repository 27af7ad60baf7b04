"""Starting task processes: on this host, and, for the chief, on the hosts of the other nodes.

HetPipe §8 runs a worker process per virtual worker on a node it uses. On this machine the
chief starts it itself (:class:`hetpipe_tf.distributed.launch.LocalCluster`); when the tasks
run on other hosts (``TF_CONFIG``), the chief asks the worker task of the virtual worker's
home node, whose :class:`TaskStarter` starts it there as a child of its own. So the same
processes run with ``launch="processes"`` and ``launch="tf_config"``, and other hosts need
no command but their ps and worker tasks'.

* :func:`spawn` and :func:`wait_ready`: a task process (``python -m MODULE ARGS``), its output
  in a log file, which ends with its parent and with its chief (``--parent_pid``,
  ``--chief_timeout_s``); and its ready line, ``ready at ADDRESS; heartbeat at HOST:PORT``.
* :class:`TaskStarter`: the service of a worker task. The chief finds its address through
  TensorFlow: the task writes it to :func:`starter_file` on its host, which the chief reads
  with an op placed on the task (:func:`read_starter_address`). Requests come over an
  authenticated connection (``multiprocessing.connection``; the cluster's key, hex, in
  ``HETPIPE_AUTHKEY``, the same for every task and the chief; ``hetpipe launch`` sets it):
  ``("start", job, index, module, args, chief_timeout_s, start_timeout_s)`` ->
  ``("started", address, heartbeat, pid)`` or ``("failed", message)``; ``("end", job,
  index)`` -> ``("ended",)`` (SIGKILL: a stopped process acts on no other signal).
"""
import concurrent.futures
import functools
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hetpipe_tf.distributed.cgroups import HOST_GROUP_ENV, enter_command
from hetpipe_tf.distributed.heartbeat import call_with_deadline
from hetpipe_tf.distributed.ports import free_port
from hetpipe_tf.errors import HetPipeRunError

#: The environment variable holding the cluster's key (hex): it authenticates the chief's
#: connections to the task starters and to the virtual workers' processes.
AUTHKEY_ENV = "HETPIPE_AUTHKEY"


class ClusterStartError(HetPipeRunError, RuntimeError):
    """A task of the cluster did not start."""


def authkey_from(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster's key from HETPIPE_AUTHKEY (bytes), or None if it is not set. A value that
    is not hex is a ValueError naming the variable.

    Returns:
        The key, or None.

    Raises:
        ValueError: the value is not hex.
    """
    text = (environ if environ is not None else os.environ).get(AUTHKEY_ENV)
    if not text:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{AUTHKEY_ENV} must be hex (e.g. from `python -c 'import os; print(os.urandom(16).hex())'`),"
                         f" got {text[:8]!r}...") from None


def spawn(module: str, args: Sequence[str], log_path: str, env: Mapping[str, str] | None = None,
          parent_pid: int | None = None, chief_timeout_s: float = 0.0,
          wrap: Callable[[list[str]], list[str]] | None = None) -> subprocess.Popen[bytes]:
    """Starts ``python -m module args`` with its output in `log_path`; it ends with process
    `parent_pid` (default: this one) and when its chief is silent for `chief_timeout_s`.
    `wrap(cmd)` may prefix the command (e.g. to run it in a network namespace).

    Returns:
        The started process.
    """
    cmd = [sys.executable, "-m", module, *args, f"--parent_pid={parent_pid or os.getpid()}",
           f"--chief_timeout_s={chief_timeout_s}"]
    if wrap is not None:
        cmd = wrap(cmd)
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {})))


def wait_ready(proc: subprocess.Popen[bytes], log_path: str, name: str, timeout_s: float) -> str:
    """The heartbeat address in task `name`'s ready line, once it printed it; ClusterStartError
    with its log's tail if it exits first or is not ready within `timeout_s`.

    Returns:
        The heartbeat address.

    Raises:
        ClusterStartError: the task exited first or was not ready in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with open(log_path) as f:
            ready = re.search(r"ready at .*; heartbeat at (\S+)", f.read())
        if ready:
            return ready.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as f:
                tail = f.read()[-2000:]
            why = f"exited with {proc.returncode}" if proc.returncode is not None else \
                f"was not ready after {timeout_s:g} s"
            raise ClusterStartError(f"task {name} {why}; its log ({log_path}):\n{tail}")
        time.sleep(0.1)


def starter_file(address: str) -> str:
    """Where the worker task at TensorFlow address `address` writes its starter's address, on
    its own host.

    Returns:
        The path.
    """
    return f"/tmp/hetpipe_starter_{address.replace(':', '_')}"


class TaskStarter:
    """A worker task's service that starts processes on its host for the chief (see the module
    docstring). `host` is the task's address, `log_dir` where the processes' logs go."""

    def __init__(self, host: str, authkey: bytes, log_dir: str) -> None:
        self.host = host
        self.log_dir = log_dir
        self._listener = multiprocessing.connection.Listener((host, 0), authkey=authkey)
        self.address = f"{host}:{self._listener.address[1]}"
        self._procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self._closed = False
        # Children are made by one thread that lives as long as the task: on Linux a child's
        # end-with-parent signal (PR_SET_PDEATHSIG) fires when the thread that made it ends.
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetpipe-starter-spawn")

    def start(self, task_address: str) -> "TaskStarter":
        """Serves requests from now on, and writes this starter's address to the task's
        :func:`starter_file`.

        Returns:
            Self.
        """
        path = starter_file(task_address)
        with open(path + ".tmp", "w") as f:
            f.write(self.address)
        os.replace(path + ".tmp", path)
        threading.Thread(target=self._accept, name="hetpipe-starter", daemon=True).start()
        return self

    def close(self) -> None:
        """Stops serving (a task's starter serves as long as the task lives)."""
        self._closed = True
        host, port = self.address.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()  # wakes the accept, which then ends
        self._listener.close()
        self._spawner.shutdown(wait=False)

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError) as e:
                if self._closed:
                    return
                print(f"hetpipe_tf task starter: refused a connection ({type(e).__name__}: {e})", flush=True)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="hetpipe-starter-conn", daemon=True).start()

    def _serve(self, conn: multiprocessing.connection.Connection) -> None:
        with conn:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    return
                conn.send(self.handle(*request))

    def handle(self, kind: str, *args: Any) -> tuple[Any, ...]:
        """The answer to one request."""
        if kind == "start":
            return self._start(*args)
        if kind == "end":
            proc = self._procs.get(tuple(args))
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            return ("ended",)
        return ("failed", f"unknown request {kind!r}; allowed: start, end")

    def _start(self, job: str, index: int, module: str, args: Sequence[str], chief_timeout_s: float,
               start_timeout_s: float) -> tuple[Any, ...]:
        address = f"{self.host}:{free_port(self.host)}"
        log = os.path.join(self.log_dir, f"{job}-{index}.log")
        host_group = os.environ.get(HOST_GROUP_ENV)  # a quota node's task: its children run outside its group
        proc = self._spawner.submit(spawn, module, [*args, f"--address={address}"], log,
                                    chief_timeout_s=chief_timeout_s,
                                    wrap=functools.partial(enter_command, host_group) if host_group else None).result()
        self._procs[(job, index)] = proc
        try:
            heartbeat = wait_ready(proc, log, f"{job}:{index}", start_timeout_s)
        except ClusterStartError as e:
            if proc.poll() is None:
                proc.kill()
            return ("failed", str(e))
        print(f"hetpipe_tf task starter: started {job}:{index} (pid {proc.pid}) at {address}; its log {log}",
              flush=True)
        return ("started", address, heartbeat, proc.pid)



class StarterClient:
    """The chief's connection to one worker task's :class:`TaskStarter`; every request has a
    deadline (a task that is stopped answers nothing)."""

    def __init__(self, address: str, authkey: bytes, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = float(timeout_s)
        host, port = address.rsplit(":", 1)
        self._conn = call_with_deadline(lambda: multiprocessing.connection.Client((host, int(port)), authkey=authkey),
                                        self.timeout_s, f"connecting to the task starter at {address}")

    def request(self, timeout_s: float, *request: Any) -> Any:
        """Sends `request` to the starter.

        Returns:
            The starter's answer.

        Raises:
            TimeoutError: no answer within `timeout_s`.
        """
        def ask() -> Any:
            self._conn.send(request)
            return self._conn.recv()

        return call_with_deadline(ask, timeout_s, f"request {request[0]!r} to the task starter at {self.address}")

    def start(self, job: str, index: int, module: str, args: Sequence[str], chief_timeout_s: float,
              start_timeout_s: float) -> tuple[str, str, int]:
        """Starts ``python -m module args`` as task (job, index) on the starter's host; returns
        (TensorFlow address, heartbeat address, pid) or raises ClusterStartError.

        Returns:
            The task's TensorFlow address, heartbeat address and pid.

        Raises:
            ClusterStartError: the task did not start.
        """
        answer = self.request(start_timeout_s + self.timeout_s, "start", job, index, module, list(args),
                              chief_timeout_s, start_timeout_s)
        if answer[0] != "started":
            raise ClusterStartError(answer[1])
        _, address, heartbeat, pid = answer
        return str(address), str(heartbeat), int(pid)

    def end(self, job: str, index: int) -> None:
        """Kills task (job, index) if this starter started it (waits at most timeout_s)."""
        self.request(self.timeout_s, "end", job, index)

    def close(self) -> None:
        """Closes the connection to the starter."""
        self._conn.close()
