"""TaylorPipe (seed 003) trained by virtual workers, in TensorFlow: the compensation acts on a
stage's real weights and gradients, λ = 0 is uncompensated pipelined SGD, λ > 0 gives the
update computed by hand, and the schedules run in the executor alone and under WSP."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.pipeline.instructions import (
    ApplyUpdate, Backward, CompensateGradient, Forward, ReleaseWeights, StashWeights)
from hetpipe_tf.pipeline.taylorpipe import HetPipeTaylorSchedule, TaylorPipeSchedule
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from hetpipe_tf.sync import staleness
from tests.helpers import models
from tests.helpers.data import random_batches
from tests.helpers.models import LOSS, constant_gradient_model, mean_output, scalar_chain
from tests.helpers.references import WEIGHT_VERSIONS, clone, exact_sgd_case
from tests.helpers.runners import wsp_runner


def test_the_compensated_update_is_g_plus_lambda_g_g_times_master_minus_local_elementwise():
    # One stage (Dense kernels and biases, vectors): minibatches 1 and 2 both forwarded with
    # W_t = W0; update 1 moves the master to W1; minibatch 2's gradient g (against W0, computed
    # here with Keras) must reach the weights as W2 = W1 - lr·(g + λ·g⊙g⊙(W1 - W0)).
    keras.utils.set_random_seed(2)
    model = models.mlp()
    ref = clone(model)
    lr, lam = 0.1, 2.0
    vw = VirtualWorker(model, "cpu", num_in_flight=2, optimizer=keras.optimizers.SGD(lr), loss=LOSS,
                       timeout_s=60, schedule=TaylorPipeSchedule(variance_control=lam))
    (x1, y1), (x2, y2) = random_batches(model, 2, seed=4)
    vw.prepare(x1, y1)
    [rt] = vw.runtimes
    w0 = [v.numpy() for v in rt.trainable]
    for p, (x, y) in ((1, (x1, y1)), (2, (x2, y2))):
        rt.set_loaded(p, vw.staged.split_inputs(x)[0])
        rt.set_labels(p, y)
        rt.run((StashWeights(p), Forward(p)))
    for p in (1, 2):
        if p == 2:
            w1 = [v.numpy() for v in rt.trainable]
        rt.run((Backward(p), CompensateGradient(p, variance_control=lam), ReleaseWeights(p), ApplyUpdate(p)))
    w2 = [v.numpy() for v in rt.trainable]
    local = [tf.constant(w) for w in w0]
    with tf.GradientTape() as tape:
        tape.watch(local)
        out, _ = ref.stateless_call(local, [v.value for v in ref.non_trainable_variables], x2, training=True)
        loss = LOSS(y2, out)
    grads = [g.numpy() for g in tape.gradient(loss, local)]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(w1, w0))
    assert moved > 1e-3  # the master moved between minibatch 2's forward pass and its update
    for a, b, c, g in zip(w2, w1, w0, grads):
        np.testing.assert_allclose(a, b - lr * (g + lam * g * g * (b - c)), atol=1e-6)
    term = max(float(np.abs(lr * lam * g * g * (b - c)).max()) for b, c, g in zip(w1, w0, grads))
    assert term > 1e-5  # the compensation is what the check above tells apart from plain SGD


def _train(schedule, batches, devices="cpu,cpu", nm=2):
    keras.utils.set_random_seed(5)
    model = models.mlp()
    vw = VirtualWorker(model, devices, num_in_flight=nm, optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                       loss=LOSS, timeout_s=60, schedule=schedule)
    done = []
    vw.train(iter(batches), len(batches), on_minibatch_done=lambda p, logs: done.append(p))
    assert sorted(done) == list(range(1, len(batches) + 1))
    assert [int(rt.optimizer.iterations.numpy()) for rt in vw.runtimes] == [len(batches)] * vw.num_stages
    return [v.numpy() for v in model.weights]


def test_lambda_0_equals_uncompensated_pipelined_sgd_and_lambda_2_does_not():
    # k = 2, Nm = 2: TaylorPipe's order and versions are PipeDream's (weight stashing), so with
    # λ = 0 the final weights are PipeDream's; with TaylorPipe's λ = 2 they differ.
    batches = random_batches(models.mlp(), 8, seed=1)
    plain = _train("pipedream", batches)
    for got, want in zip(_train(TaylorPipeSchedule(variance_control=0.0), batches), plain):
        np.testing.assert_allclose(got, want, atol=1e-6)
    compensated = _train("taylorpipe", batches)
    assert max(float(np.abs(a - b).max()) for a, b in zip(compensated, plain)) > 1e-5


def test_three_stages_admitting_the_seeds_replicas_finish_in_the_executor():
    # Nm = 5 on k = 3: stages admit min(5, 5), min(5, 3) and 1 minibatches (Figure 2).
    _train("taylorpipe", random_batches(models.mlp(), 9, seed=2), devices="cpu,cpu,cpu", nm=5)


def _by_hand(versions, means, lr, lam):
    """The weights (a, b, c) TaylorPipe ends with on the scalar chain when minibatch p runs with
    the weight versions `versions(p)` names, each gradient g compensated against the master
    (the stage's weights after every earlier update) before it is applied."""
    stage0, stage1 = [np.array([0.8, 1.2])], [np.array([-0.7])]  # after 0, 1, 2, ... updates
    for p, xbar in enumerate(means, start=1):
        fwd, bwd, last = (max(v, 0) for v in versions(p))
        (af, bf), (ab, bb), (c,) = stage0[fwd], stage0[bwd], stage1[last]
        g1 = np.array([bf * af * xbar])  # dL/dc = mean(b·a·x), with the forward's a, b
        g0 = c * xbar * np.array([bb, ab])  # dL/da = c·b·mean(x), dL/db = c·a·mean(x)
        stage1.append(stage1[-1] - lr * (g1 + lam * g1 * g1 * (stage1[-1] - stage1[last])))
        stage0.append(stage0[-1] - lr * (g0 + lam * g0 * g0 * (stage0[-1] - stage0[bwd])))
    return np.array([*stage0[-1], *stage1[-1]])


@pytest.mark.parametrize("schedule,versions", [("taylorpipe", WEIGHT_VERSIONS["pipedream"]),
                                               ("hetpipe-taylor", WEIGHT_VERSIONS["hetpipe"])])
def test_every_update_is_the_compensated_gradient_by_hand(schedule, versions):
    # k = 2, Nm = 2 on x -> a·x -> b·(a·x) | -> c·(b·a·x): TaylorPipe's stage 0 computes g against
    # the version stashed at its forward pass, one update behind its master; HetPipe's versions
    # are one update behind on both stages. With λ = 2 every update is g + λ·g⊙g⊙(W̄ − W_t).
    inputs = np.random.default_rng(1).uniform(0.5, 1.5, size=(6, 4, 1)).astype("float32")
    expected = _by_hand(versions, inputs.mean(axis=(1, 2)), lr=0.1, lam=2.0)
    assert np.abs(expected - _by_hand(versions, inputs.mean(axis=(1, 2)), lr=0.1, lam=0.0)).max() > 1e-4
    model = scalar_chain()
    vw = VirtualWorker(model, "cpu,cpu", num_in_flight=2, boundaries=[0, 2], optimizer=keras.optimizers.SGD(0.1),
                       loss=mean_output, timeout_s=60, schedule=schedule)
    vw.train(iter([(x, np.zeros_like(x)) for x in inputs]), 6)
    got = np.array([float(model.get_layer(n).kernel.numpy()[0, 0]) for n in "abc"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["hetpipe-taylor", "taylorpipe"])
def test_two_virtual_workers_under_wsp_train_with_the_compensation_and_keep_its_bounds(schedule):
    # The compensation inside WSP: the weights every forward pass used hold the local and global
    # updates WSP requires (D = 0, Nm = 2), every wave is pushed, and the global weights moved.
    model = constant_gradient_model()
    n, nm = 6, 2
    data, _ = exact_sgd_case(model, n)
    start = [v.numpy().copy() for v in model.trainable_variables]
    runner = wsp_runner(model, ("1,1", "1,1"), nm, 0, loss=mean_output, schedule=schedule,
                        record_provenance=True)
    runner.train(data, n)
    for stage in range(2):
        assert staleness.check(runner.provenance(stage), nm, 0, 2) == 2 * n
    assert runner.servers.clock.clocks()[0] == (n // nm, n // nm)
    after = [v.numpy() for v in model.trainable_variables]
    assert all(np.isfinite(w).all() for w in after)
    assert max(float(np.abs(a - b).max()) for a, b in zip(after, start)) > 1e-3
    assert isinstance(runner.vws[0].pipeline_schedule, (TaylorPipeSchedule, HetPipeTaylorSchedule))
