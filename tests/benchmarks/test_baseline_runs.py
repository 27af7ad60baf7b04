"""The all-reduce baselines run for real: MultiWorkerMirroredStrategy in the main venv, Horovod in
its own (skipped, with the reason, where it is not built). Three ranks are started, the last one
too small for the model: two train, their replicas stay in sync and the pacing holds."""
import glob
import os

import numpy as np
import pytest

from benchmarks.baselines import horovod_run, mwms

EPOCHS, STEPS, DILATION, SPEEDS = 2, 5, 4, (1.0, 0.5)
FLAGS = [f"--epochs={EPOCHS}", f"--steps_per_epoch={STEPS}", f"--dilation={DILATION}", "--speeds=1,0.5,1",
         "--memory=1G,1G,1M"]


def check_run(line, system, weights_out):
    assert line["system"] == system and line["model"] == "cnn" and line["dataset"] == "hetpipe_digits"
    assert (line["ranks"], line["ranks_started"], line["speeds"]) == (2, 3, list(SPEEDS))
    assert line["left_out"] == [line["left_out"][0]] and line["left_out"][0].startswith(
        "rank 2 left out: its emulated device holds 1.0 MiB, the whole model needs 4.9 MiB")
    assert line["emulated"] is True and line["dilation"] == DILATION and line["reference_measured"] is True
    assert (line["paced_tasks"], line["epochs"], line["steps_per_epoch"]) == (2 * EPOCHS * STEPS, EPOCHS, STEPS)
    assert 0 <= line["overran_tasks"] <= line["paced_tasks"]
    assert line["emulation_faithful"] == (line["overrun_fraction"] < 0.05)
    assert 0 < line["host_cpu_busy"] <= 1 and line["host_saturated"] == (line["host_cpu_busy"] > 0.9)
    assert len(line["epoch_test_accuracy"]) == EPOCHS and all(0 <= a <= 1 for a in line["epoch_test_accuracy"])
    assert len(line["epoch_wall_s"]) == EPOCHS and 0 < line["epoch_wall_s"][0] < line["epoch_wall_s"][1]
    # The pacing held: no step was shorter than the slower rank's emulated compute.
    slowest_step_s = DILATION / min(SPEEDS) * line["reference_ms"] / 1e3
    assert 0 < line["images_per_s"] <= 1.02 * 2 * line["batch_size_per_rank"] / slowest_step_s
    # Replicas in sync: equal weights, though each rank saw its own shard (its BatchNorm
    # statistics, which are not all-reduced, differ).
    files = sorted(glob.glob(os.path.join(weights_out, "*.npz")))
    assert [os.path.basename(f) for f in files] == ["rank_0.npz", "rank_1.npz"]
    first, second = (np.load(f) for f in files)
    trainable = [k for k in first.files if k.startswith("trainable_")]
    state = [k for k in first.files if k.startswith("state_")]
    assert len(trainable) == 22 and all(np.array_equal(first[k], second[k]) for k in trainable)
    assert not all(np.array_equal(first[k], second[k]) for k in state)


def test_mwms_baseline(tmp_path):
    line = mwms.run(["--workers=3", "--deadline_s=600", *FLAGS, f"--weights_out={tmp_path}"])
    check_run(line, "mwms", str(tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(horovod_run.missing() is not None, reason=str(horovod_run.missing()))
def test_horovod_baseline(tmp_path):
    line = horovod_run.run(3, [*FLAGS, f"--weights_out={tmp_path}"], deadline_s=600)
    check_run(line, "horovod", str(tmp_path))
