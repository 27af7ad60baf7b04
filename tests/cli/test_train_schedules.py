"""hetpipe-train --schedule=NAME trains the bundled digits with each classic schedule
(GPipe, PipeDream, NaivePipe): one virtual worker, a few minibatches each."""
import json

import pytest

from tests.helpers.cli import CLUSTER_RUN, hetpipe_train


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("pipedream", marks=pytest.mark.slow),
                                      pytest.param("naivepipe", marks=pytest.mark.slow)])
def test_one_virtual_worker_trains_with_the_schedule_it_is_given(tmp_path, schedule):
    run = hetpipe_train(tmp_path, f"--schedule={schedule}", "--model=mlp", "--epochs=2", "--steps_per_epoch=8",
                        "--devices=1@64M,0.5@64M", "--num_in_flight=2", "--dilation=2", "--show_schedule=true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{schedule} schedule: 2 stages" in run.stdout  # the programs it printed are that schedule's
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["num_in_flight"] == 2 and 0.0 <= summary["test_accuracy"] <= 1.0
    assert "EMULATED devices" in run.stdout


@pytest.mark.slow
def test_virtual_workers_in_processes_train_with_gpipe_under_wsp(tmp_path):
    run = hetpipe_train(tmp_path, *CLUSTER_RUN, "--schedule=gpipe-recompute", "--policy=ed")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert [w["worker"] for w in summary["virtual_workers"]] == [0, 1] and summary["test_accuracy"] > 0.2
