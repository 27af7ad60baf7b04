"""hetpipe-train and hetpipe end on errors by one rule (hetpipe_tf.cli.errors): a usage error
exits 2 and a failed run 1, each with a line or two and no traceback unless asked for."""
import os
import subprocess
import sys

import pytest
from absl import app

import hetpipe_tf
from hetpipe_tf.cli import errors
from hetpipe_tf.data.datasets import DatasetNotFoundError, DatasetOptionError
from hetpipe_tf.pipeline.emulation import DeviceOutOfMemoryError
from hetpipe_tf.pipeline.executor import PipelineError
from hetpipe_tf.planning.cluster import ClusterError
from hetpipe_tf.planning.devices import DeviceSpecError
from hetpipe_tf.planning.model_graph import SharedLayerError


def _run(module, *args, env=None):
    return subprocess.run([sys.executable, "-m", f"hetpipe_tf.cli.{module}", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def _report(run, program, word):
    """The error report: the lines from `program: word:` to the end of stderr (TFDS may print before it)."""
    lines = run.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"{program}: {word}: "))
    return lines[first:]


@pytest.fixture(scope="module")
def bad_cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "cluster.json"
    path.write_text('{"name": "x", "nodes": [')
    return path


USAGE_ERRORS = [
    ("train", ["--devices=0@1M"], "device '0@1M': speed must be > 0, got 0.0"),
    ("train", ["--num_in_flight=0"], "flag --num_in_flight=0: 0 is not a positive integer"),
    ("train", ["--cluster={cluster}"], "{cluster}: not valid JSON"),
    ("train", ["--dataset=mnist", "--data_dir={tmp}"], "Dataset 'mnist' is not prepared in data_dir"),
    ("train", ["--boundaries=0,99"], "--boundaries gives 2 stages but the default --devices="),
    ("train", ["--devices=1,1", "--boundaries=0,99", "--show_schedule=false"],
     "stage boundaries [0, 99] must be strictly increasing node indices below 22"),
    ("hetpipe", ["frobnicate"], "unknown command 'frobnicate'; the commands are: plan, simulate, launch"),
    ("hetpipe", ["plan", "--cluster={cluster}"], "{cluster}: not valid JSON"),
]


@pytest.mark.parametrize("module,args,message", USAGE_ERRORS, ids=[" ".join(a) for _, a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_or_two_lines(module, args, message, bad_cluster, tmp_path):
    fill = {"cluster": bad_cluster, "tmp": tmp_path}
    quick = ["--epochs=1", "--steps_per_epoch=2"] if module == "train" else []  # should the error not come
    run = _run(module, *(a.format(**fill) for a in args), *quick)
    program = {"train": "hetpipe-train", "hetpipe": "hetpipe"}[module]
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    report = _report(run, program, "error")
    assert len(report) <= 2 and message.format(**fill) in report[0], run.stderr[-3000:]


def test_a_failed_run_exits_1_in_one_line():
    run = _run("train", "--devices=1@1K,1@1K", "--epochs=1", "--steps_per_epoch=2", "--show_schedule=false")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert _report(run, "hetpipe-train", "failed") == [
        "hetpipe-train: failed: out of memory on stage 0 (emulated device (speed 1, memory 1.0 KiB)) (emulated "
        "capacity 1.0 KiB): allocating 74.6 KiB for weights would hold 74.6 KiB (now holding: nothing); give this "
        "device fewer layers, lower Nm or the batch size, or more memory"]


@pytest.mark.parametrize("how", [["--verbosity=1"], {errors.TRACEBACK_ENV: "1"}], ids=["verbosity", "env"])
def test_the_traceback_is_there_when_asked_for(how):
    flags, env = (how, None) if isinstance(how, list) else ([], how)
    run = _run("train", "--devices=0@1M", *flags, env=env)
    assert run.returncode == 2
    assert "Traceback (most recent call last)" in run.stderr and "raise DeviceSpecError" in run.stderr
    assert run.stderr.rstrip().endswith("hetpipe-train: error: device '0@1M': speed must be > 0, got 0.0")


def test_one_rule_for_both_binaries():
    """Usage errors, failed runs (also inside a stage that failed), internal errors."""
    for exc in (app.UsageError("x"), DeviceSpecError("x"), ClusterError("x"), DatasetNotFoundError("x"),
                DatasetOptionError("x"), SharedLayerError("x"), hetpipe_tf.PlanError("x"),
                hetpipe_tf.InfeasiblePartitionError("x"), hetpipe_tf.HetPipeUsageError("x")):
        assert errors.classify(exc) == (errors.USAGE_STATUS, exc)
    oom = DeviceOutOfMemoryError("out of memory on stage 1")
    assert errors.classify(oom) == (errors.FAILED_RUN_STATUS, oom)
    for exc in (hetpipe_tf.TaskLostError("lost task ps:0"), hetpipe_tf.ClusterStartError("x"),
                hetpipe_tf.OpsLibraryError("x"), hetpipe_tf.HetPipeRunError("x"), TimeoutError("x")):
        assert errors.classify(exc) == (errors.FAILED_RUN_STATUS, exc)
    try:
        raise PipelineError("stage 1 failed at Forward(3)") from oom
    except PipelineError as wrapped:
        assert errors.classify(wrapped) == (errors.FAILED_RUN_STATUS, oom)
    stalled = PipelineError("the pipeline stalled")
    stalled.__cause__ = TimeoutError("no stage made progress for 300 s")
    assert errors.classify(stalled)[0] == errors.FAILED_RUN_STATUS
    for internal in (ValueError("x"), KeyError("x"), PipelineError("stage 0 failed: TypeError"),
                     hetpipe_tf.PipelineAborted("stage 1 stopped"),
                     hetpipe_tf.WorkerProcessError("virtual worker 0's process failed: KeyError: 'x'")):
        assert errors.classify(internal) == (None, internal)
