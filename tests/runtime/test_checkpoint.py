"""Checkpoint and resume of a run of virtual workers (hetpipe_tf.runtime.checkpoint): a run
stopped after some epochs and resumed by a new strategy and model ends with the weights of
a run that was never stopped (issue 12, items 1 and 3)."""
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.cli import models
from hetpipe_tf.data import datasets
from hetpipe_tf.runtime.checkpoint import Checkpoints, PlanCuts, RunState, epoch_shares, for_workers, reconcile_cuts
from tests.helpers.checkpoints import stopped_and_resumed, two_workers


def _one_worker(directory, resume=False):
    """One virtual worker of 4 host-CPU stages at Nm = 2, SGD with momentum on the digits, no shuffling."""
    strategy = HetPipeStrategy(cluster="local_cpu", policy="ed", vw_size=4, num_in_flight=2, staleness_bound=0,
                               launch="in_process", dilation=1, checkpoint_dir=directory, resume=resume)
    with strategy.scope():
        data = datasets.load_image_classification("hetpipe_digits", "train", batch_size=16, shuffle=False)
        keras.utils.set_random_seed(0)
        model = models.build_model("mlp", tuple(data.element_spec[0].shape[1:]), 10)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return strategy, model, data


@pytest.mark.slow
def test_two_workers_resumed_end_with_the_weights_of_an_uninterrupted_run(tmp_path):
    diff, got, expected = stopped_and_resumed(two_workers, tmp_path, epochs=4, stop_at=2, steps_per_epoch=16)
    assert diff <= 1e-6, diff
    assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(got, two_workers(None)[1].get_weights()))  # it trained
    saved = sorted(os.listdir(tmp_path / "whole"))
    assert saved == ["checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index", "ckpt-4.data-00000-of-00001",
                     "ckpt-4.index"], saved  # every epoch, the newest two kept
    state = Checkpoints(str(tmp_path / "whole")).latest()
    assert state.epoch == 4 and state.positions == [32, 32] and state.clocks == [16, 16]
    # Optimizer state per model variable: Adam's two slots of each of the 3 trainable variables.
    assert all(len(w["slots"]) == 3 and all(set(s) == {"momentum", "velocity"} for s in w["slots"].values())
               and int(w["scalars"]["iteration"]) == 32 for w in state.optimizers)


def test_one_worker_at_nm_2_resumed_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    diff, _, _ = stopped_and_resumed(_one_worker, tmp_path, epochs=2, stop_at=1, steps_per_epoch=8)
    assert diff <= 1e-6, diff


def _state(epoch, weights):
    return RunState(epoch=epoch, weights=weights, optimizers=[
        {"scalars": {"iteration": np.int64(epoch)}, "slots": {"d/kernel": {"momentum": np.ones(3, "float32")}}}],
                    clocks=[epoch], positions=[4 * epoch], plan=PlanCuts(2, ((0,),)))


def test_a_save_that_did_not_complete_leaves_the_previous_checkpoint_usable(tmp_path):
    checkpoints = Checkpoints(str(tmp_path))
    checkpoints.save(_state(1, [np.full(3, 1.0, "float32")]))
    # A crash while saving epoch 2: its files partly written, the state file not yet updated.
    (tmp_path / "ckpt-2.index").write_bytes(b"\x00partial")
    (tmp_path / "ckpt-2.data-00000-of-00001").write_bytes(b"\x00" * 10)
    state = checkpoints.latest()
    assert state.epoch == 1 and state.positions == [4] and state.clocks == [1]
    np.testing.assert_array_equal(state.weights[0], np.full(3, 1.0, "float32"))
    assert int(state.optimizers[0]["scalars"]["iteration"]) == 1
    np.testing.assert_array_equal(state.optimizers[0]["slots"]["d/kernel"]["momentum"], np.ones(3, "float32"))


KILLED_SAVE = """
import sys, numpy as np
from hetpipe_tf.runtime.checkpoint import Checkpoints, PlanCuts, RunState
state = lambda e, w: RunState(epoch=e, weights=w, optimizers=[None], clocks=[e], positions=[e],
                              plan=PlanCuts(1, ((0,),)))
checkpoints = Checkpoints(sys.argv[1])
checkpoints.save(state(1, [np.ones(3, "float32")]))
print("saving", flush=True)
checkpoints.save(state(2, [np.full(2 ** 20, i, "float32") for i in range(50)]))  # 200 MB
print("saved", flush=True)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_usable(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.stdout.readline().strip() == "saving"
    # Killed once it writes the new checkpoint's files (first temporary ones), which takes far longer
    # than this loop's look at the directory every 5 ms.
    def writing():
        return any(p.name.startswith("ckpt-2") for p in tmp_path.iterdir())

    while not writing() and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL and not proc.stdout.read()  # killed before it completed
    assert writing()  # ... while it wrote
    state = Checkpoints(str(tmp_path)).latest()
    assert state.epoch == 1 and state.clocks == [1]
    np.testing.assert_array_equal(state.weights[0], np.ones(3, "float32"))


def test_resuming_from_nothing_or_from_another_model_says_what_was_given_and_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="resume=True needs the checkpoint_dir to resume from, got checkpoint_dir=None"):
        HetPipeStrategy(launch="in_process", resume=True)
    missing = tmp_path / "missing"
    _, model, data = two_workers(str(missing), resume=True)
    with pytest.raises(FileNotFoundError, match=f"cannot resume: the checkpoint directory '{missing}' does not exist; "
                                                f"give the checkpoint_dir .* or start without resume"):
        model.fit(data, epochs=1, verbose=0)
    (tmp_path / "empty").mkdir()
    _, model, data = two_workers(str(tmp_path / "empty"), resume=True)
    with pytest.raises(FileNotFoundError, match="'.*empty' holds no complete checkpoint"):
        model.fit(data, epochs=1, verbose=0)
    Checkpoints(str(tmp_path / "other")).save(_state(1, [np.ones((6, 7), "float32")]))
    _, model, data = two_workers(str(tmp_path / "other"), resume=True)
    with pytest.raises(ValueError, match=r"is not of this model: it holds 1 variables, the model 5, and variable 0 "
                                         r"differs \(\(\(6, 7\), 'float32'\) saved, \(\(6, 5\), 'float32'\) in the "
                                         r"model: shape, dtype\); give the checkpoint_dir of this model's run"):
        model.fit(data, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="BackupAndRestore cannot restore a HetPipeStrategy run .* give "
                                         r"HetPipeStrategy\(checkpoint_dir=..., resume=True\)"):
        model.fit(data, epochs=1, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    with pytest.raises(ValueError, match="save_every_epochs must be an integer >= 1, got 0"):
        Checkpoints(str(tmp_path), save_every_epochs=0)


def test_resumed_under_another_allocation_and_nm_it_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, capsys):
    # Saved by 2 workers of 2 stages at Nm = 2 (NP), resumed by 2 workers of 2 stages at Nm = 1 (ED):
    # every stage takes its variables' optimizer slots wherever the cuts fall. Gradients that depend
    # on the data only make the result independent of Nm, so it must equal the run never stopped.
    whole, model, data = two_workers(str(tmp_path / "whole"))
    model.fit(data, epochs=2, steps_per_epoch=16, verbose=0)
    expected = [v.numpy() for v in model.variables]
    _, model, data = two_workers(str(tmp_path / "stopped"))
    model.fit(data, epochs=1, steps_per_epoch=16, verbose=0)
    resumed, model, data = two_workers(str(tmp_path / "stopped"), resume=True, policy="ed", num_in_flight=1)
    history = model.fit(data, epochs=2, steps_per_epoch=16, verbose=0)
    assert len(history.history["loss"]) == 1 and resumed.runner.num_in_flight == 1
    nodes = lambda strategy: [d.node for d in strategy.plan.workers[0].devices]  # noqa: E731
    assert nodes(whole) == ["host-A", "host-A"] and nodes(resumed) == ["host-A", "host-B"]  # NP, then ED
    assert "saved under the plan {'num_in_flight': 2, " in capsys.readouterr().out
    diff = max(float(np.max(np.abs(v.numpy() - e))) for v, e in zip(model.variables, expected))
    assert diff <= 1e-6, diff


def test_resumed_by_another_number_of_workers_each_starts_from_the_saved_workers_mean(tmp_path):
    directory = str(tmp_path / "stopped")
    _, model, data = two_workers(directory)
    model.fit(data, epochs=1, steps_per_epoch=16, verbose=0)
    saved = Checkpoints(directory).latest()
    assert len(saved.optimizers) == 2 and saved.positions == [8, 8] and saved.clocks == [4, 4]
    # The rule: every new worker's slots and iterations are the saved workers' mean, its clock the
    # global clock, its position its new shard's after the epochs done.
    assert for_workers(saved, 2, 16) is saved
    four = for_workers(saved, 4, 16)
    assert four.clocks == [4] * 4 and four.positions == [4] * 4
    for path, slots in saved.optimizers[0]["slots"].items():
        for slot, value in slots.items():
            mean = (value + saved.optimizers[1]["slots"][path][slot]) / 2
            for worker in four.optimizers:
                np.testing.assert_allclose(worker["slots"][path][slot], mean, rtol=1e-6)
    # Resumed by 4 workers of 1 stage each (another partition), it trains epoch 1 from there.
    resumed, model, data = two_workers(directory, resume=True, vw_size=1)
    history = model.fit(data, epochs=2, steps_per_epoch=16, verbose=0)
    assert len(history.history["loss"]) == 1 and len(resumed.plan.workers) == 4
    final = Checkpoints(directory).latest()
    assert final.epoch == 2 and final.positions == [8] * 4 and final.clocks == [6] * 4
    assert [int(w["scalars"]["iteration"]) for w in final.optimizers] == [8 + 4] * 4


def _rewrite_plan_as_dict(directory, plan):
    """The newest checkpoint in `directory` written again with `plan`, a literal dict of the format
    that checkpoints held before their cuts were a PlanCuts ({"num_in_flight", "boundaries"})."""
    path = tf.train.latest_checkpoint(directory)
    reader = tf.train.load_checkpoint(path)
    key = "{}/.ATTRIBUTES/VARIABLE_VALUE"
    meta = json.loads(reader.get_tensor(key.format("meta")))
    meta["plan"] = plan
    names = reader.get_variable_to_shape_map()
    def count(prefix):
        return sum(1 for n in names if n.startswith(prefix + "/") and n.endswith("VARIABLE_VALUE"))

    with tf.device("/device:CPU:0"):
        checkpoint = tf.train.Checkpoint(
            meta=tf.Variable(json.dumps(meta)),
            weights=[tf.Variable(reader.get_tensor(key.format(f"weights/{i}"))) for i in range(count("weights"))],
            optimizers=[tf.Variable(reader.get_tensor(key.format(f"optimizers/{i}")))
                        for i in range(count("optimizers"))])
    tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2, checkpoint_name="ckpt").save(
        checkpoint_number=meta["epoch"])


def test_a_checkpoint_whose_cuts_are_the_dict_format_resumes_at_its_saved_cuts(tmp_path):
    # Gradients that depend on the data only: the run never stopped is the reference whatever the cuts.
    _, model, data = two_workers(str(tmp_path / "whole"))
    model.fit(data, epochs=2, steps_per_epoch=16, verbose=0)
    expected = [v.numpy() for v in model.variables]
    stopped, model, data = two_workers(str(tmp_path / "stopped"))
    model.fit(data, epochs=1, steps_per_epoch=16, verbose=0)
    other = 3 - stopped.cuts.boundaries[0][1]  # the model has 3 layer calls: the other cut of two stages
    _rewrite_plan_as_dict(str(tmp_path / "stopped"), {"num_in_flight": 2, "boundaries": [[0, other], [0, other]]})
    resumed, model, data = two_workers(str(tmp_path / "stopped"), resume=True)
    model.fit(data, epochs=2, steps_per_epoch=16, verbose=0)
    assert resumed.cuts == PlanCuts(2, ((0, other), (0, other)))  # the saved cuts, not the planner's
    assert resumed.run_config.num_in_flight == 2 and resumed.runner.num_in_flight == 2
    diff = max(float(np.max(np.abs(v.numpy() - e))) for v, e in zip(model.variables, expected))
    assert diff <= 1e-6, diff


def test_saved_cuts_are_kept_under_a_plan_of_their_shape_only():
    planned = PlanCuts(2, ((0, 2), (0, 1)))
    assert reconcile_cuts(None, planned) is planned
    assert reconcile_cuts(PlanCuts(2, ((0, 1), (0, 2))), planned) == PlanCuts(2, ((0, 1), (0, 2)))
    assert reconcile_cuts(PlanCuts(1, ((0, 1), (0, 2))), planned) is planned  # another Nm
    assert reconcile_cuts(PlanCuts(2, ((0, 1, 2), (0, 2))), planned) is planned  # another number of stages
    # Uneven minibatch sizes: the saved ones while the plan is uneven, none once it is even.
    uneven = PlanCuts(2, ((0, 2), (0, 1)), (5, 3))
    assert reconcile_cuts(PlanCuts(2, ((0, 1), (0, 1)), (6, 2)), uneven).minibatch_sizes == (6, 2)
    assert reconcile_cuts(PlanCuts(2, ((0, 1), (0, 1))), uneven).minibatch_sizes == (5, 3)
    assert reconcile_cuts(PlanCuts(2, ((0, 1), (0, 1)), (6, 2)), planned).minibatch_sizes is None
    old = {"num_in_flight": 2, "boundaries": [[0, 1], [0, 2]], "minibatch_sizes": [6, 2]}
    assert PlanCuts.from_dict(old) == PlanCuts(2, ((0, 1), (0, 2)), (6, 2)) and PlanCuts.from_dict(old).to_dict() == old


def test_each_epoch_deals_its_minibatches_to_the_workers_in_turn():
    for steps, workers in [(3, 2), (44, 3), (8, 4), (5, 5)]:
        for epoch in range(5):
            shares, nxt = epoch_shares(epoch, steps, workers), epoch_shares(epoch + 1, steps, workers)
            assert sum(shares) == epoch * steps and sum(nxt) - sum(shares) == steps
            assert max(nxt) - min(nxt) <= 1 and all(b >= a for a, b in zip(shares, nxt))


def test_an_epoch_of_steps_no_multiple_of_the_workers_resumes_exactly(tmp_path):
    """3 minibatches an epoch over 2 workers: 2 and 1 in the first epoch, 1 and 2 in the second.
    Resumed after the first, the run ends as the one never stopped (it waited forever for a
    minibatch no worker trained when each worker took ceil(3 / 2) every epoch)."""
    diff, _, _ = stopped_and_resumed(two_workers, tmp_path, epochs=3, stop_at=1, steps_per_epoch=3)
    assert diff <= 1e-6
    assert Checkpoints(str(tmp_path / "stopped")).latest().positions == [5, 4]
    _, model, data = two_workers(str(tmp_path / "few"))
    with pytest.raises(ValueError, match="steps_per_epoch=1 is fewer than the 2 virtual workers"):
        model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
