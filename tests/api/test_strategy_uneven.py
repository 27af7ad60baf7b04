"""HetPipeStrategy(uneven_minibatches=True) (issue 14 item 4): on an NP allocation, whose virtual
workers are unequal, each trains a minibatch size proportional to its predicted throughput, the
servers weight its pushes by it, and the plan and describe() show each worker's size."""
import numpy as np
import pytest

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.planning.uneven import push_weights
from tests.helpers.checkpoints import stopped_and_resumed, two_workers
from tests.helpers.strategy import compiled_digits


def test_fit_on_np_trains_each_worker_at_its_own_minibatch_size():
    strategy = HetPipeStrategy(cluster="local", policy="np", num_in_flight=2, launch="in_process", dilation=1,
                               uneven_minibatches=True)
    train, test, model = compiled_digits(strategy)  # batches of 16: a global batch of 32 per round
    history = model.fit(train, epochs=1, steps_per_epoch=8, validation_data=test, verbose=0)
    plan = strategy.plan
    assert plan.allocation == "FF SS"  # NP on the local preset: speeds 1 and 0.5
    fast, slow = plan.sizes
    # Proportional to the predicted images/s (not 2:1: the executor's and the links' fixed costs do
    # not scale with the devices' speeds; tests/planning/test_uneven.py checks 2:1 without them), which
    # follow the profile measured here: the fast worker never gets fewer (where fixed costs dwarf the
    # compute, as many).
    assert fast + slow == 32 and fast >= slow, plan.sizes
    # Each worker trained at its size, and the servers weighted its pushes by n * b_i / B.
    assert strategy.runner.batch_sizes == [fast, slow]
    assert strategy.runner.servers.push_weights == pytest.approx(push_weights((fast, slow)))
    assert history.history["global_clock"] == [2]  # 8 minibatches, 4 per worker, in waves of 2
    assert all(np.isfinite(history.history["loss"])) and history.history["val_accuracy"][-1] > 0.1
    text = strategy.describe()
    assert f"minibatches {fast}+{slow} (uneven)" in text
    assert f"virtual worker 0: FF  Max_m=" in text and f"minibatch {fast}  predicted" in text
    assert f"minibatch {slow}  predicted" in text
    assert [w["minibatch_size"] for w in plan.to_dict()["virtual_workers"]] == [fast, slow]
    for st in (s for w in plan.workers for s in w.partition.stages):
        assert st.memory_total <= st.capacity


def test_uneven_minibatches_must_be_a_bool_or_sizes():
    with pytest.raises(ValueError, match="uneven_minibatches must be True, False or a list of minibatch sizes "
                                         r"\(one per virtual worker\), got 'yes'"):
        HetPipeStrategy(launch="in_process", uneven_minibatches="yes")


def _uneven_workers(directory, resume=False):
    """NP on the local preset (speeds 1 and 0.5), minibatches of 5 and 3 out of batches of 4 (given,
    not from a measured profile, so that every run has them), D = 0, on a model whose gradients
    depend on the data only (the result does not depend on the timing)."""
    return two_workers(directory, resume, cluster="local", vw_size=None, uneven_minibatches=[5, 3])


@pytest.mark.slow
def test_a_resumed_uneven_run_keeps_its_sizes_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    from hetpipe_tf.runtime.checkpoint import Checkpoints

    diff, _, _ = stopped_and_resumed(_uneven_workers, tmp_path, epochs=2, stop_at=1, steps_per_epoch=8)
    assert diff <= 1e-6, diff
    saved = Checkpoints(str(tmp_path / "stopped")).latest()
    assert saved.epoch == 2 and saved.plan["minibatch_sizes"] == [5, 3] and saved.positions == [8, 8]
