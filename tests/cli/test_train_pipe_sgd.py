"""hetpipe-train --sync=pipe-sgd: virtual workers that all-reduce (seed 002) train the bundled digits."""
import json

import pytest

from tests.helpers.cli import CLUSTER_RUN, hetpipe_train


def test_virtual_workers_train_with_pipe_sgd_and_its_compression(tmp_path):
    run = hetpipe_train(tmp_path, *CLUSTER_RUN, "--launch=in_process", "--sync=pipe-sgd", "--pipe_sgd_staleness=1",
                        "--compression=quant8", "--vw_size=2")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert [w["worker"] for w in summary["virtual_workers"]] == [0, 1] and summary["test_accuracy"] > 0.2


def test_pipe_sgds_flags_without_it_are_refused(tmp_path):
    run = hetpipe_train(tmp_path, *CLUSTER_RUN, "--launch=in_process", "--compression=quant8")
    assert run.returncode != 0
    assert "--pipe_sgd_staleness and --compression are Pipe-SGD's: give --sync=pipe-sgd too" in run.stderr


@pytest.mark.slow
def test_virtual_workers_in_processes_all_reduce_on_the_worker_tasks(tmp_path):
    # one process per virtual worker: their collectives meet on the CPUs of the cluster's worker tasks
    run = hetpipe_train(tmp_path, *CLUSTER_RUN, "--sync=pipe-sgd", "--pipe_sgd_staleness=0", "--compression=truncate16")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert [w["worker"] for w in summary["virtual_workers"]] == [0, 1] and summary["test_accuracy"] > 0.2
    # worker 0 mirrors its replica on the servers: one push per minibatch and stage; nothing waits on them
    assert [w["clock"] for w in summary["virtual_workers"]] == [8, 0]
