"""Heartbeats between the chief and every task: a dead or stopped task is found in time.

A gRPC call to a task that was stopped (SIGSTOP) or whose machine vanished can wait
forever, and TensorFlow's eager client has no deadline per op. So every task also
answers heartbeats on a TCP port of its own (:class:`HeartbeatResponder`, started by
:mod:`hetpipe_tf.distributed.server` before its TensorFlow server), and the chief's
:class:`HeartbeatMonitor` pings each task every ``timeout_s / 10`` seconds:

* no answer within ``timeout_s`` (the task is stopped, hung or unreachable), or the
  connection closes (the task exited): the task is **lost**. The monitor calls its
  ``on_lost`` once per task, with a :class:`LostTask` naming the job, index and address; the
  chief then stops training and every task (:class:`hetpipe_tf.distributed.launch.LocalCluster`),
  or, for a virtual worker's process under ``on_worker_failure="continue"``, goes on without it
  and forgets the task (:meth:`HeartbeatMonitor.forget`).
* the other way round, a task that hears no ping for ``timeout_s`` has lost its chief and
  ends itself, so no task is left behind a chief that vanished on another machine.

The protocol is one line each way: ``ping`` -> ``pong``; ``lost JOB:INDEX ADDRESS WHY``
tells a task which task was lost, so that every task's log names it.
"""
import ctypes
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from hetpipe_tf.errors import HetPipeRunError

T = TypeVar("T")


@dataclass(frozen=True)
class LostTask:
    """A task that stopped answering: its job, index, TensorFlow address and why."""
    job: str
    index: int
    address: str
    reason: str

    def __str__(self) -> str:
        return f"lost task {self.job}:{self.index} at {self.address}: {self.reason}"


class TaskLostError(HetPipeRunError, RuntimeError):
    """Training ended because a task of the cluster was lost (dead, stopped or unreachable)."""

    def __init__(self, lost: LostTask) -> None:
        super().__init__(str(lost))
        self.lost = lost


def _read_line(conn: socket.socket, buffer: list[bytes]) -> bytes:
    """One line from `conn` (bytes until a newline; b"" at the end of the stream)."""
    while b"\n" not in buffer[0]:
        chunk = conn.recv(256)
        if not chunk:
            return b""
        buffer[0] += chunk
    line, buffer[0] = buffer[0].split(b"\n", 1)
    return line


class HeartbeatResponder:
    """A task's side: answers pings. Calls `on_end(message, failed)` when the chief ends its
    connection (failed False) or sends no ping for `chief_timeout_s` (failed True; None:
    never), and `on_lost_task(message)` when the chief says which task it lost."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, chief_timeout_s: float | None = None,
                 on_end: Callable[[str, bool], None] | None = None,
                 on_lost_task: Callable[[str], None] | None = None) -> None:
        self._listener = socket.create_server((host, port))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.chief_timeout_s = chief_timeout_s
        self.on_end = on_end
        self.on_lost_task = on_lost_task

    def start(self) -> "HeartbeatResponder":
        """Answers the monitors' heartbeats from a daemon thread; returns self."""
        threading.Thread(target=self._accept, name="hetpipe-heartbeat", daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(conn,), name="hetpipe-heartbeat-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.chief_timeout_s)
        buffer = [b""]
        try:
            while True:
                line = _read_line(conn, buffer)
                if line == b"ping":
                    conn.sendall(b"pong\n")
                elif line.startswith(b"lost "):
                    if self.on_lost_task is not None:
                        self.on_lost_task(f"the chief lost task {line[5:].decode()}")
                elif not line:
                    self._end("the chief closed its heartbeat connection (it ended)", False)
                    return
        except ConnectionResetError:  # closed with a pong unread: ended all the same
            self._end("the chief closed its heartbeat connection (it ended)", False)
        except socket.timeout:
            self._end(f"no heartbeat from the chief for {self.chief_timeout_s:g} s", True)
        except OSError as e:
            self._end(f"the chief's heartbeat connection failed ({e})", True)
        finally:
            conn.close()

    def _end(self, message: str, failed: bool) -> None:
        if self.chief_timeout_s is not None and self.on_end is not None:
            self.on_end(message, failed)


@dataclass(frozen=True)
class Watched:
    """A task the monitor watches: job, index, TensorFlow address, heartbeat address."""
    job: str
    index: int
    address: str
    heartbeat: str


class HeartbeatMonitor:
    """The chief's side: pings every task; calls `on_lost(LostTask)` once for each task lost.
    `exit_status(job, index)` (optional) says how a task this machine started ended."""

    def __init__(self, tasks: Iterable[Watched], timeout_s: float, on_lost: Callable[[LostTask], None],
                 exit_status: Callable[[str, int], str | None] | None = None) -> None:
        self.tasks = tuple(tasks)
        self.timeout_s = float(timeout_s)
        self.interval_s = min(1.0, self.timeout_s / 10)
        self.on_lost = on_lost
        self.exit_status = exit_status
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._conns: dict[Watched, socket.socket] = {}
        self._reported: dict[Watched, LostTask] = {}  # in the order found
        self._forgotten: set[Watched] = set()

    @property
    def lost(self) -> LostTask | None:
        """The first task found lost and not forgotten (a :class:`LostTask`), or None."""
        with self._lock:
            return next(iter(self._reported.values()), None)

    def reported(self, job: str, index: int) -> LostTask | None:
        """The :class:`LostTask` reported for task (job, index) and not forgotten, or None."""
        with self._lock:
            return next((lost for task, lost in self._reported.items() if (task.job, task.index) == (job, index)),
                        None)

    def forget(self, job: str, index: int) -> None:
        """Stops watching task (job, index) and forgets that it was lost: a virtual worker's
        process the run goes on without (a new one for it is watched by :meth:`add`)."""
        with self._lock:
            tasks = [t for t in self.tasks if (t.job, t.index) == (job, index)]
            self._forgotten.update(tasks)
            for task in tasks:
                self._reported.pop(task, None)
            self.tasks = tuple(t for t in self.tasks if t not in tasks)
            conns = [self._conns.pop(t) for t in tasks if t in self._conns]
        for conn in conns:
            _close(conn)

    def start(self) -> "HeartbeatMonitor":
        """Connects to every watched task's heartbeat port and starts watching them."""
        for task in self.tasks:
            self._connect(task)
        return self

    def add(self, task: Watched) -> None:
        """Watches one more task (a :class:`Watched`) from now on."""
        with self._lock:
            self.tasks += (task,)
            self._forgotten.discard(task)
        self._connect(task)

    def _connect(self, task: Watched) -> None:
        host, port = task.heartbeat.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        with self._lock:
            self._conns[task] = conn
        threading.Thread(target=self._watch, args=(task, conn), name=f"hetpipe-monitor-{task.job}-{task.index}",
                         daemon=True).start()

    def _watch(self, task: Watched, conn: socket.socket) -> None:
        buffer = [b""]
        while not self._stopped.is_set():
            sent = time.monotonic()
            try:
                conn.sendall(b"ping\n")
                line = _read_line(conn, buffer)
                reason = None if line == b"pong" else "its heartbeat connection closed"
            except socket.timeout:
                reason = (f"no heartbeat for {time.monotonic() - sent:.1f} s "
                          f"(timeout_s={self.timeout_s:g}): the task is stopped, hung or unreachable")
            except OSError as e:
                reason = f"its heartbeat connection failed ({e})"
            if reason is not None:
                if not self._stopped.is_set() and task not in self._forgotten:
                    self._report(task, LostTask(task.job, task.index, task.address, self._ended_how(task) or reason))
                return
            self._stopped.wait(self.interval_s)

    def _ended_how(self, task: Watched, wait_s: float = 1.0) -> str | None:
        """How a task this machine started ended ("killed by signal 9"), waiting up to `wait_s`
        for it: its sockets close a moment before its exit can be seen. None if unknown.

        Returns:
            How it ended, or None.
        """
        exit_status = self.exit_status
        if exit_status is None:
            return None
        return poll(lambda: exit_status(task.job, task.index), wait_s, 0.05)

    def _report(self, task: Watched, lost: LostTask) -> None:
        with self._lock:
            if task in self._reported or task in self._forgotten:
                return
            self._reported[task] = lost
        self.on_lost(lost)

    def tell_lost(self, lost: LostTask) -> None:
        """Tells every task still connected that `lost` (a :class:`LostTask`) was lost; each
        logs it (and ends with the chief)."""
        line = f"lost {lost.job}:{lost.index} {lost.address} {lost.reason}\n".encode()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.settimeout(1.0)
                conn.sendall(line)
            except OSError:
                pass

    def stop(self) -> None:
        """Stops watching and closes the connections."""
        self._stopped.set()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            _close(conn)


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()
    except OSError:
        pass


def poll(get: Callable[[], T], wait_s: float, interval_s: float) -> T:
    """`get()`, called every `interval_s` until it returns something true or `wait_s` passed;
    its last value.

    Returns:
        The last value `get()` returned.
    """
    deadline = time.monotonic() + wait_s
    while True:
        value = get()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def call_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()`'s value (or its exception), or a TimeoutError naming `what` once `timeout_s`
    passed: for calls with no deadline of their own (connecting, accepting, reading a
    connection), which would otherwise wait forever on a stopped peer. `fn` goes on in a
    daemon thread.

    Returns:
        `fn()`'s value.

    Raises:
        TimeoutError: `timeout_s` passed first.
        Exception: whatever `fn()` raised.
    """
    result: queue.Queue[tuple[bool, Any]] = queue.Queue()

    def call() -> None:
        try:
            result.put((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result.put((False, e))

    threading.Thread(target=call, name="hetpipe-deadline", daemon=True).start()
    try:
        ok, value = result.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"{what}: no answer within {timeout_s:g} s") from None
    if not ok:
        raise value
    returned: T = value
    return returned


def end_with_parent(parent: int) -> None:
    """Ends this process when process `parent` ends.

    On Linux the kernel sends SIGKILL when the parent dies: the one signal that also ends a
    task that was stopped (SIGSTOP), which could act on no other. Elsewhere a thread polls
    the parent every second."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            try:
                os.kill(parent, 0)
            except OSError:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()
