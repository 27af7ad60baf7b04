"""Heartbeats: a dead task is found at once, a stopped one once a ping went unanswered for
timeout_s, and nothing hangs.

The end-to-end cases run `hetpipe-train --cluster=local --launch=processes` and send
SIGKILL or SIGSTOP to one of its parameter-server or worker tasks, or to the process that
drives a virtual worker, mid-training: the chief must name the lost task in one line and
exit, and every task must end. How soon after the signal depends on the host's load; it is
printed, and each wait has a deadline far beyond it so that a hang fails the test.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from hetpipe_tf.distributed.heartbeat import HeartbeatMonitor, LostTask, Watched
from tests.helpers.processes import alive, responder_process, silent_s, wait_for

TIMEOUT_S = 10.0


def _watch(address, timeout_s):
    lost = []
    monitor = HeartbeatMonitor([Watched("ps", 0, "tf-address", address)], timeout_s, lost.append).start()
    return monitor, lost


def test_a_stopped_task_is_lost_after_timeout_and_a_killed_one_at_once():
    proc, address = responder_process()
    try:
        monitor, lost = _watch(address, 2.0)
        time.sleep(1.0)
        assert not lost  # answering tasks are not lost
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_for(lambda: lost, 60)
        assert str(lost[0]).startswith("lost task ps:0 at tf-address: no heartbeat for")
        assert silent_s(str(lost[0])) >= 2.0  # given up once a ping went unanswered for timeout_s
        monitor.stop()
    finally:
        proc.kill()
        proc.wait()
    proc, address = responder_process()
    monitor, lost = _watch(address, 30.0)
    proc.kill()
    assert wait_for(lambda: lost, 60)
    # Found at once, by its connection's end, not after the 30 s without an answer.
    assert "connection" in lost[0].reason and "no heartbeat" not in lost[0].reason
    monitor.stop()


def test_a_task_ends_when_the_chief_goes_silent_or_ends_and_logs_the_task_it_lost():
    proc, address = responder_process()
    host, port = address.split(":")
    conn = socket.create_connection((host, int(port)))
    t0 = time.monotonic()  # before the last ping: the task ends no sooner than its chief_timeout_s (3 s) after it
    conn.sendall(b"ping\n")
    assert conn.recv(5) == b"pong\n"
    out, _ = proc.communicate(timeout=60)
    assert "END no heartbeat from the chief for 3 s" in out and time.monotonic() - t0 >= 3.0
    conn.close()

    proc, address = responder_process()
    monitor, lost = _watch(address, 30.0)
    monitor.tell_lost(LostTask("worker", 1, "127.0.0.1:5", "killed by signal 9"))
    monitor.stop()  # after the line, on the same connection
    out, _ = proc.communicate(timeout=60)
    assert "NOTE the chief lost task worker:1 127.0.0.1:5 killed by signal 9\nEND the chief closed" in out


def _tasks_of(pid):
    """{(job, index): pid} of the cluster tasks that process `pid` started."""
    tasks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().split(")")[-1].split()[1])
        except OSError:
            continue
        flag = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
        if ppid == pid and "hetpipe_tf.distributed.server" in args:
            tasks[(flag["job_name"], int(flag["task_index"]))] = int(entry)
        elif ppid == pid and "hetpipe_tf.distributed.worker_process" in args:  # a virtual worker's process
            tasks[(f"vw{flag['worker']}", 0)] = int(entry)
    return tasks


def _signal_mid_training(cmd, task, sig):
    """Runs `cmd` (it starts the cluster's tasks as its children), sends `sig` to `task`
    (job, index) after three epochs; returns (stderr, exit status, tasks still alive). Prints how
    long after the signal it ended, and every task had."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    try:
        assert wait_for(lambda: sum("Epoch" in line for line in out) >= 3 or proc.poll() is not None, 300), \
            "training did not start"
        assert proc.poll() is None, "".join(out)[-3000:] + proc.stderr.read()[-3000:]
        tasks = _tasks_of(proc.pid)
        assert {("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)} <= set(tasks), tasks
        os.kill(tasks[task], sig)
        t0 = time.monotonic()
        err = proc.stderr.read()
        proc.wait(timeout=TIMEOUT_S + 60)
        ended_s = time.monotonic() - t0
        wait_for(lambda: not any(alive(p) for p in tasks.values()), 60)
        all_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{cmd[2]} {task[0]}:{task[1]} {sig.name}: it ended {ended_s:.1f} s after the signal, every task {all_s:.1f} s")
    return err, proc.returncode, [t for t, p in tasks.items() if alive(p)]


def _train_command(tmp_path, *flags):
    return [sys.executable, "-m", "hetpipe_tf.cli.train", f"--data_dir={tmp_path / 'tfds'}", "--show_schedule=false",
            "--cluster=local", "--model=mlp", "--epochs=1000", "--steps_per_epoch=8", "--dilation=2",
            "--num_in_flight=2", f"--timeout_s={TIMEOUT_S:g}", *flags]


@pytest.mark.parametrize("job,index,sig", [
    ("ps", 1, signal.SIGKILL),
    pytest.param("ps", 1, signal.SIGSTOP, marks=pytest.mark.slow),
    pytest.param("worker", 1, signal.SIGKILL, marks=pytest.mark.slow),
    pytest.param("worker", 1, signal.SIGSTOP, marks=pytest.mark.slow),
    pytest.param("vw1", 0, signal.SIGKILL, marks=pytest.mark.slow),
    pytest.param("vw1", 0, signal.SIGSTOP, marks=pytest.mark.slow)])
def test_a_lost_task_ends_every_process_with_one_line_naming_it(tmp_path, job, index, sig):
    """ps and worker tasks, and the process that drives virtual worker 1."""
    err, status, left = _signal_mid_training(_train_command(tmp_path, "--launch=processes"),
                                                             (job, index), sig)
    assert not left, f"tasks {left} outlived the chief"
    assert status == 1, err[-3000:]
    why = "killed by signal 9" if sig == signal.SIGKILL else "no heartbeat for"
    # The monitor's line or the failure's, whichever comes first, says why.
    assert re.search(rf"lost task {job}:{index} at 127\.0\.0\.1:\d+: {why}", err), err[-3000:]
    assert re.search(rf"hetpipe-train: failed: lost task {job}:{index} at 127\.0\.0\.1:\d+: ", err), err[-3000:]
    if sig == signal.SIGSTOP:  # given up once a ping went unanswered for timeout_s
        assert silent_s(err) >= TIMEOUT_S, err[-3000:]


@pytest.mark.slow
def test_hetpipe_launch_finds_a_stopped_task_and_ends_the_chief_and_every_task(tmp_path):
    cmd = [sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "launch", "--cluster=local", f"--timeout_s={TIMEOUT_S:g}",
           "--", *_train_command(tmp_path, "--launch=tf_config", "--policy=np")]
    err, status, left = _signal_mid_training(cmd, ("ps", 1), signal.SIGSTOP)
    assert not left, f"tasks {left} outlived hetpipe launch"
    assert status == 1, err[-3000:]
    assert re.search(r"hetpipe: lost task ps:1 at 127\.0\.0\.1:\d+: no heartbeat for", err), err[-3000:]
    assert re.search(r"hetpipe-train: failed: lost task ps:1 at 127\.0\.0\.1:\d+: no heartbeat for", err), err[-3000:]
    assert silent_s(err) >= TIMEOUT_S, err[-3000:]
