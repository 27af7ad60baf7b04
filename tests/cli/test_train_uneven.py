"""hetpipe-train --uneven_minibatches (issue 14 item 4), end to end in its own process."""
import json

import pytest

from tests.helpers.cli import CLUSTER_RUN, hetpipe_train


def test_uneven_minibatches_needs_a_cluster(tmp_path):
    run = hetpipe_train(tmp_path, "--uneven_minibatches", "--epochs=1")
    assert run.returncode != 0 and "--uneven_minibatches sizes the minibatches of several virtual workers: give " \
                                   "--cluster too" in run.stderr


@pytest.mark.slow
def test_np_workers_in_their_own_processes_train_at_their_own_minibatch_sizes(tmp_path):
    run = hetpipe_train(tmp_path, *CLUSTER_RUN, "--policy=np", "--uneven_minibatches", "--batch_size=32")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    fast, slow = summary["minibatch_sizes"]
    assert summary["allocation"] == "FF SS" and fast + slow == 64 and fast >= slow  # by the measured profile
    assert f"minibatches {fast}+{slow} (uneven)" in run.stdout
    assert [w["clock"] for w in summary["virtual_workers"]] == [4, 4]  # 16 minibatches, 8 each, waves of 2
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["emulation"]["emulated"] is True
