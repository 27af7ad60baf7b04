"""The classic schedules (GPipe, PipeDream, NaivePipe) trained by a virtual worker: each
scheme's defining property on a small model, against Keras or a hand computation."""
import keras
import numpy as np
import pytest

from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from hetpipe_tf.sync import staleness
from tests.helpers import models
from tests.helpers.data import random_batches
from tests.helpers.models import LOSS, constant_gradient_model, mean_output, scalar_chain
from tests.helpers.references import WEIGHT_VERSIONS, clone, constant_gradients, exact_sgd_case
from tests.helpers.runners import wsp_runner


@pytest.mark.parametrize("schedule", ["gpipe", "gpipe-recompute"])
def test_gpipe_equals_sgd_on_the_concatenated_microbatches(schedule):
    # GPipe with Nm = 3 applies one update per 3 microbatches, from their mean gradient: Keras's
    # train_on_batch on the 3 batches concatenated (mean loss over all samples) does the same.
    # 8 microbatches: two full minibatches and a last one of 2, cut short by the run's end.
    keras.utils.set_random_seed(5)
    model = models.mlp()
    ref = clone(model)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS, jit_compile=False)
    batches = random_batches(model, 8)
    for first in range(0, 8, 3):
        group = batches[first:first + 3]
        ref.train_on_batch(np.concatenate([x for x, _ in group]), np.concatenate([y for _, y in group]))
    vw = VirtualWorker(model, "cpu,cpu,cpu", num_in_flight=3, optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                       loss=LOSS, timeout_s=60, schedule=schedule)
    done = []
    vw.train(iter(batches), 8, on_minibatch_done=lambda p, logs: done.append(p))
    assert sorted(done) == list(range(1, 9))
    assert [rt.optimizer.iterations.numpy() for rt in vw.runtimes] == [3, 3, 3]  # one update per minibatch
    for got, want in zip(model.weights, ref.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)


def _by_hand(schedule, means, lr):
    """The weights (a, b, c) SGD ends with when minibatch p (of mean input means[p-1]) runs
    with the weight versions `WEIGHT_VERSIONS[schedule]` names."""
    stage0, stage1 = [np.array([0.8, 1.2])], [-0.7]  # after 0, 1, 2, ... updates
    for p, xbar in enumerate(means, start=1):
        fwd, bwd, last = (max(v, 0) for v in WEIGHT_VERSIONS[schedule](p))
        (af, bf), (ab, bb), c = stage0[fwd], stage0[bwd], stage1[last]
        stage1.append(stage1[-1] - lr * bf * af * xbar)  # dL/dc = mean(b·a·x), with the forward's a, b
        stage0.append(stage0[-1] - lr * c * xbar * np.array([bb, ab]))  # dL/da = c·b·mean(x), dL/db = c·a·mean(x)
    return np.array([*stage0[-1], stage1[-1]])


@pytest.mark.parametrize("schedule", list(WEIGHT_VERSIONS))
def test_which_weights_a_backward_pass_uses_by_hand(schedule):
    # PipeDream's backward pass uses its forward pass's (stashed) weights, NaivePipe's the live
    # ones, vertical sync one version per minibatch on every stage: on this chain each choice
    # gives other weights after 6 minibatches.
    rng = np.random.default_rng(1)
    batches = [(rng.uniform(0.5, 1.5, size=(4, 1)).astype("float32"), np.zeros((4, 1), "float32"))
               for _ in range(6)]
    means = [float(x.mean()) for x, _ in batches]
    expected = _by_hand(schedule, means, lr=0.1)
    others = {name: _by_hand(name, means, lr=0.1) for name in ("pipedream", "naivepipe", "pipedream-vsync")}
    assert min(np.abs(expected - v).max() for name, v in others.items() if not np.allclose(v, expected)) > 1e-3
    model = scalar_chain()
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=2, boundaries=[0, 2], optimizer=keras.optimizers.SGD(0.1),
                       loss=mean_output, timeout_s=60, schedule=schedule)
    vw.train(iter(batches), 6)
    got = np.array([float(model.get_layer(n).kernel.numpy()[0, 0]) for n in "abc"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "gpipe-recompute", "pipedream", "pipedream-vsync", "naivepipe"])
def test_two_virtual_workers_under_wsp_lose_no_update_and_keep_its_bounds(schedule):
    # Data-only gradients: whatever weights a minibatch saw, the servers must end with w0 - lr x
    # every update; GPipe's update of a minibatch is the mean of its microbatches' gradients.
    # The weights every forward pass used hold the local and global updates WSP requires (§4, §5).
    model = constant_gradient_model()
    n, nm = 6, 2
    data, _ = exact_sgd_case(model, n)
    expected = {v.path: v.numpy().copy() for v in model.trainable_variables}
    group = nm if schedule.startswith("gpipe") else 1
    for batches in data:
        for x, _ in batches:
            for path, g in constant_gradients(model, x).items():
                expected[path] -= 0.05 * g / group
    runner = wsp_runner(model, ("1,1", "1,1"), nm, 0, loss=mean_output, schedule=schedule,
                        record_provenance=True)
    runner.train(data, n)
    for stage in range(2):
        assert staleness.check(runner.provenance(stage), nm, 0, 2) == 2 * n
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)
    assert runner.servers.clock.clocks()[0] == (n // nm, n // nm)
