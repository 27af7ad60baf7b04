"""Conservation across a kill and a resume (issue 12 items 4 and 5): a run of two virtual workers
in their own processes, checkpointing every epoch, whose chief or parameter server is killed with
SIGKILL mid-epoch, then resumed with --resume's equivalent, applies every minibatch's update
exactly once: the global weights are the start minus lr * g for each of the run's minibatches,
none of the killed epoch's twice and none lost (the run of tests/helpers/counting_run.py,
whose every update is the same -lr * g)."""
import re

import pytest

from hetpipe_tf.runtime.checkpoint import Checkpoints
from tests.helpers.counting_run import applied_exactly, run_counting

EPOCHS, STEPS_PER_EPOCH = 4, 8


def _killed_then_resumed(tmp_path, task, mode="stop"):
    directory = str(tmp_path / "checkpoints")
    # Killed after the chief saw epoch 2's second minibatch, once epoch 2's checkpoint was saved.
    killed, _ = run_counting(mode, kill=(task, "SIGKILL", 2, 1), epochs=EPOCHS, checkpoint_dir=directory)
    saved = Checkpoints(directory).latest()
    assert saved.epoch == 2 and saved.clocks == [4, 4] and saved.positions == [8, 8]
    resumed, result = run_counting(epochs=EPOCHS, checkpoint_dir=directory, resume=True)
    assert resumed.returncode == 0 and result, resumed.stderr[-3000:]
    assert result["epochs"] == EPOCHS - 2 and result["clocks"] == [8, 8]
    # Every update of the 4 epochs applied once: the 16 minibatches of the first two (in the
    # checkpoint), none of what epoch 2 had pushed when it was killed, and the 16 trained again.
    assert applied_exactly(result, EPOCHS * STEPS_PER_EPOCH)
    final = Checkpoints(directory).latest()
    assert final.epoch == EPOCHS and final.positions == [16, 16]
    return killed


@pytest.mark.slow
def test_a_chief_killed_mid_epoch_and_resumed_applies_every_update_once(tmp_path):
    killed = _killed_then_resumed(tmp_path, "chief")
    assert killed.returncode == -9


@pytest.mark.slow
def test_a_lost_parameter_server_ends_the_run_and_resume_continues_from_the_last_checkpoint(tmp_path):
    killed = _killed_then_resumed(tmp_path, "ps", mode="continue")
    # The lost server ends the run with one line naming it, also under on_worker_failure="continue".
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert re.search(r"lost task ps:0 at 127\.0\.0\.1:\d+: killed by signal 9", killed.stderr), killed.stderr[-3000:]
