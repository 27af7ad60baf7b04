"""Helpers of the tests that start processes: whether a process still runs, waiting for a
condition, a heartbeat responder in a process of its own, and what a lost task's line says."""
import re
import subprocess
import sys
import time


def alive(pid):
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_gone(pids, timeout_s):
    """The processes of `pids` still alive after waiting up to `timeout_s` for them to end."""
    wait_for(lambda: not any(alive(p) for p in pids), timeout_s)
    return [p for p in pids if alive(p)]


def wait_for(condition, seconds):
    """Whether `condition()` holds, polled for up to `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def responder_process():
    """A task's heartbeat side alone, in a process of its own (so that it can be stopped): it ends
    when its chief is silent for 3 s (printing END and why) and prints NOTE and what the chief
    says it lost. Returns the process and the responder's address."""
    code = ("import os, time\n"
            "from hetpipe_tf.distributed.heartbeat import HeartbeatResponder\n"
            "r = HeartbeatResponder(chief_timeout_s=3.0, on_end=lambda m, f: (print('END', m, flush=True), "
            "os._exit(0)), on_lost_task=lambda m: print('NOTE', m, flush=True)).start()\n"
            "print(r.address, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def silent_s(text):
    """How long the first task `text` names as lost had not answered a ping: the heartbeat
    monitor's "no heartbeat for X s", X measured from the unanswered ping (at least timeout_s)."""
    return float(re.search(r"no heartbeat for ([\d.]+) s", text).group(1))
