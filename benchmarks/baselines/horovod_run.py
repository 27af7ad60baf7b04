"""Running the Horovod baseline from the main venv (for the comparison scripts and the tests):
``horovodrun --gloo`` of ``benchmarks/horovod/train_horovod.py`` on localhost in the Horovod venv.

The venv is ``build/horovod-venv`` unless HOROVOD_VENV names another one; ``bash
benchmarks/horovod/setup.sh`` (or ``make horovod``) builds it. Every process ends when the
caller does and the run has a deadline (:mod:`benchmarks.baselines.processes`).
"""
import os

from benchmarks.baselines import processes, ranks

SCRIPT = os.path.join(ranks.ROOT, "benchmarks", "horovod", "train_horovod.py")


def venv():
    return os.environ.get("HOROVOD_VENV") or os.path.join(ranks.ROOT, "build", "horovod-venv")


def missing():
    """Why the Horovod baseline cannot run here, or None when its venv is built."""
    if os.path.exists(os.path.join(venv(), ".horovod-built")):
        return None
    return (f"the Horovod venv is not built at {venv()}: run `bash benchmarks/horovod/setup.sh` "
            f"(5 to 9 minutes on a 2-core machine; HOROVOD_VENV=... for another folder)")


def command(count, argv, wrap=None):
    """horovodrun's command line for `count` ranks on localhost and the script's flags `argv`;
    `wrap(rank_command)`, if given, is what horovodrun starts for every rank instead of the
    script's command (e.g. in a CPU-quota group by the rank's HOROVOD_RANK:
    :func:`hetpipe_tf.distributed.cgroups.rank_command`)."""
    bin_dir = os.path.join(venv(), "bin")
    rank = [os.path.join(bin_dir, "python"), SCRIPT, *argv]
    return [os.path.join(bin_dir, "horovodrun"), "--gloo", "-np", str(count), "-H", f"localhost:{count}",
            *(wrap(rank) if wrap else rank)]


def launch(count, argv, deadline_s=1800, wrap=None):
    """Runs the baseline on `count` ranks (`wrap` as :func:`command`'s); returns horovodrun's stdout."""
    reason = missing()
    if reason:
        raise processes.BaselineRunError(reason)
    env = dict(os.environ, PATH=os.path.join(venv(), "bin") + os.pathsep + os.environ.get("PATH", ""),
               TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    return processes.run_all([command(count, argv, wrap)], deadline_s, [env])[0]


def run(count, argv, deadline_s=1800, wrap=None):
    """Runs the baseline on `count` ranks (`wrap` as :func:`command`'s) and returns its JSON line as a dict."""
    (line,) = processes.json_lines(launch(count, argv, deadline_s, wrap))
    return line
