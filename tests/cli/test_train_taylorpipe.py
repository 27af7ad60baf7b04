"""hetpipe-train --schedule=taylorpipe (seed 003) trains the bundled digits with one virtual
worker, and --schedule=hetpipe-taylor with virtual workers in processes under WSP."""
import json

import pytest

from tests.helpers.cli import CLUSTER_RUN, hetpipe_train


def test_one_virtual_worker_trains_with_taylorpipe(tmp_path):
    run = hetpipe_train(tmp_path, "--schedule=taylorpipe", "--model=mlp", "--epochs=2", "--steps_per_epoch=8",
                        "--devices=1@64M,0.5@64M", "--num_in_flight=3", "--dilation=2", "--show_schedule=true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "taylorpipe schedule: 2 stages" in run.stdout
    assert "CompensateGradient(1, variance_control=2)" in run.stdout  # λ = 2, TaylorPipe's, before each update
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["num_in_flight"] == 3 and 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["emulation"]["emulated"] is True
    assert "EMULATED devices" in run.stdout


@pytest.mark.slow
def test_virtual_workers_in_processes_train_with_the_compensation_under_wsp(tmp_path):
    run = hetpipe_train(tmp_path, *CLUSTER_RUN, "--schedule=hetpipe-taylor", "--sync=wsp")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert [w["worker"] for w in summary["virtual_workers"]] == [0, 1] and summary["test_accuracy"] > 0.2
