"""Starting a baseline's processes and waiting for them with a deadline (standard library only).

Rule: every process started here ends when its caller does. Each one runs in a process group
of its own, gets SIGKILL when the process that started it dies (Linux's parent-death signal),
and when one of them fails, when the deadline passes or when the caller is interrupted, the
whole group of every one of them is killed before the error is raised. Output goes to files,
not pipes, so that a chatty process cannot block on a full pipe while another is waited for.
"""
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

_PR_SET_PDEATHSIG = 1
TAIL_CHARS = 3000


class BaselineRunError(RuntimeError):
    """A baseline's process failed or ran past its deadline."""


def _die_with_parent():
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()


def _tail(path):
    return _read(path)[-TAIL_CHARS:]


def run_all(commands, deadline_s, envs=None):
    """Runs every command (an argv list) at once and waits for all of them, at most `deadline_s`
    seconds in all; returns their stdouts. `envs` gives each one's whole environment."""
    envs = envs or [None] * len(commands)
    with tempfile.TemporaryDirectory(prefix="hetpipe-baseline-") as folder:
        started, outs, errs = [], [], []
        try:
            for i, (command, env) in enumerate(zip(commands, envs)):
                outs.append(os.path.join(folder, f"{i}.out"))
                errs.append(os.path.join(folder, f"{i}.err"))
                with open(outs[-1], "w") as out, open(errs[-1], "w") as err:
                    started.append(subprocess.Popen(command, stdout=out, stderr=err, env=env,
                                                    start_new_session=True, preexec_fn=_die_with_parent))
            deadline = time.monotonic() + deadline_s
            while True:
                codes = [p.poll() for p in started]
                failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    i = failed[0]
                    raise BaselineRunError(f"process {i} ({' '.join(commands[i][:4])} ...) exited with status "
                                           f"{codes[i]}; its stderr ends:\n{_tail(errs[i])}")
                if all(code == 0 for code in codes):
                    return [_read(path) for path in outs]
                if time.monotonic() > deadline:
                    raise BaselineRunError(f"the baseline ran past its deadline of {deadline_s:g} s; process 0's "
                                           f"stderr ends:\n{_tail(errs[0])}")
                time.sleep(0.2)
        finally:
            for process in started:
                _kill(process)


def tree_cpu(root=None):
    """CPU seconds (user and system) of process `root` (default: this one) and of every process
    below it, from /proc: a run's and the tasks' and workers' it started."""
    root = root or os.getpid()
    parents, ticks = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(pid)], ticks[int(pid)] = int(fields[1]), int(fields[11]) + int(fields[12])

    def below_root(pid):
        while pid > 1:
            if pid == root:
                return True
            pid = parents.get(pid, 0)
        return False

    return sum(t for pid, t in ticks.items() if below_root(pid)) / os.sysconf("SC_CLK_TCK")


def json_lines(text):
    """The JSON objects among the lines of `text` (other lines are logs), each line perhaps
    prefixed by horovodrun's ``[RANK]<stdout>:``."""
    found = (re.fullmatch(r"(?:\[\d+\]<stdout>:)?(\{.*\})\s*", line) for line in text.splitlines())
    return [json.loads(m.group(1)) for m in found if m]


def script_result(source, args, root, timeout_s, what):
    """Runs Python `source` with `args` in a fresh interpreter (from `root`, with it on the path and
    TensorFlow's C++ logs off) and returns the JSON of the last line it printed as ``RESULT {...}``;
    raises BaselineRunError naming `what`, with the end of its stderr, if it failed or printed none."""
    proc = subprocess.run([sys.executable, "-c", source, *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout_s, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=root))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise BaselineRunError(f"{what} failed:\n{proc.stderr[-TAIL_CHARS:]}")
    return json.loads(lines[-1][len("RESULT "):])

