"""Several virtual workers under Wave Synchronous Parallel, in one process (§5).

The multi-process runs on TensorFlow's distributed runtime are in test_launch.py.
"""
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.virtual_worker import Dilation, VirtualWorker
from hetpipe_tf.runtime.wsp_runner import BoundWorkers
from hetpipe_tf.sync import staleness
from tests.helpers import models
from tests.helpers.data import random_batches
from tests.helpers.models import LOSS, constant_gradient_model, mean_output
from tests.helpers.references import constant_gradients, exact_sgd_case
from tests.helpers.processes import wait_for
from tests.helpers.runners import wsp_runner


@pytest.mark.parametrize("speeds,d", [
    (("1,1", "0.5,0.5"), 0),
    (("1,1", "0.25,0.25", "0.5,1"), 1),
    (("1,1", "0.25,0.25"), 4),
])
def test_every_minibatch_of_every_worker_keeps_the_wsp_bounds(speeds, d):
    keras.utils.set_random_seed(0)
    model = models.mlp()
    nm, n = 3, 24
    runner = wsp_runner(model, speeds, nm, d, loss=LOSS, record_provenance=True)
    runner.train([random_batches(model, n, seed=i) for i in range(len(speeds))], n)
    for stage in range(2):
        checked = staleness.check(runner.provenance(stage), nm, d, len(speeds))
        assert checked == n * len(speeds)
    clocks, global_clock = runner.servers.clock.clocks()
    assert clocks == (n // nm,) * len(speeds) and global_clock == n // nm


def test_seed_001_example_d0_nm4():
    keras.utils.set_random_seed(0)
    model = models.mlp()
    runner = wsp_runner(model, ("1,1", "0.5,0.5"), nm=4, d=0, loss=LOSS, record_provenance=True)
    runner.train([random_batches(model, 16, seed=i) for i in range(2)], 16)
    records = runner.provenance(0)
    local, pushed = records[(0, 11)]
    assert set(local) == set(range(1, 8))  # the local updates of 5..7 ...
    assert {(1, 0)} <= set(pushed)  # ... and the other worker's global updates of 1..4
    local, pushed = records[(0, 12)]
    assert {(1, 0), (1, 1)} <= set(pushed)  # minibatch 12 waited for wave 1 of every worker
    staleness.check(records, 4, 0, 2)


@pytest.mark.parametrize("nm,n", [(3, 12), (3, 10), (2, 7)])
def test_global_weights_hold_every_update_of_every_worker_exactly_once(nm, n):
    # With data-only gradients the global result is w0 - lr * (sum of every worker's gradients),
    # whatever the staleness: a lost, or doubly applied, update shows. n % Nm != 0 checks that
    # the last, partial wave is pushed too.
    model = constant_gradient_model()
    frozen = model.get_layer("frozen").get_weights()
    data, expected = exact_sgd_case(model, n)
    runner = wsp_runner(model, ("1,1", "0.5,0.5"), nm, d=1, loss=mean_output)
    runner.train(data, n)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)
    for got, want in zip(model.get_layer("frozen").get_weights(), frozen):
        np.testing.assert_array_equal(got, want)
    assert runner.servers.clock.clocks()[0] == (-(-n // nm),) * 2


def test_a_pull_merges_the_stages_own_push_of_its_wave_however_late_that_push_lands():
    # A stage sends its wave's push on a lane of its own and goes on (§5). Alone, a worker's live
    # weights end equal to the global ones only if every merge held its own push of the wave: a
    # pull answered before that push landed (the bound D = 2 lets it through) would take the
    # wave's update out of the live weights, while the servers still get it.
    keras.utils.set_random_seed(0)
    model = models.mlp()
    runner = wsp_runner(model, ("1,1",), nm=2, d=2, loss=LOSS)
    push = runner.servers.push

    def late(*args):
        time.sleep(0.05)
        push(*args)

    runner.servers.push = late
    runner.train([random_batches(model, 12, seed=0)], 12)
    assert runner.servers.clock.clocks() == ((6,), 6)  # every push landed before the run ended
    global_weights = runner.servers.values()
    for rt in runner.vws[0].runtimes:
        for path, v in zip(rt.synchronisation.paths, rt.synchronisation.variables):
            np.testing.assert_allclose(v.numpy(), global_weights[path].numpy(), atol=1e-6, err_msg=path)


def test_a_second_run_goes_on_where_the_first_ended():
    # As a second keras fit does: its waves follow the first run's at the servers, and the
    # global weights hold every update of both runs exactly once.
    model = constant_gradient_model()
    data, expected = exact_sgd_case(model, 12)
    runner = wsp_runner(model, ("1,1", "0.5,0.5"), nm=3, d=0, loss=mean_output)
    runner.train([d[:7] for d in data], 7)
    assert runner.servers.clock.clocks() == ((3, 3), 3)
    runner.train([d[7:] for d in data], 5)
    assert runner.servers.clock.clocks() == ((5, 5), 5)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)


def test_a_failed_worker_ends_every_pull_and_the_next_run_starts_clean():
    model = constant_gradient_model()
    data, expected = exact_sgd_case(model, 6)

    def fail_at_4(minibatch):
        if minibatch == 4:
            raise RuntimeError("device lost")
        return 1.0

    runner = wsp_runner(model, ("1,1", "1,1"), nm=2, d=0, loss=mean_output, timeout_s=120)
    runner.vws[1].slowdown = fail_at_4
    ended, train = {}, runner.vws[0].train

    def worker_0(*args, **kwargs):  # keeps what ended worker 0's run
        try:
            return train(*args, **kwargs)
        except Exception as exc:
            ended["error"] = exc
            raise

    runner.vws[0].train = worker_0
    with pytest.raises(Exception, match="device lost"):
        runner.train(data, 6)
    # Worker 0 waited in a pull for worker 1's wave: the abort ended it (its pull's, or its pipeline's
    # if that stopped first), not its 120 s timeout.
    assert "aborted" in str(ended["error"]) and "waited" not in str(ended["error"]), ended["error"]
    assert wait_for(lambda: not _pipeline_threads(), 60), _pipeline_threads()
    assert runner.aborted.startswith("virtual worker 1 failed")
    failed = runner.servers
    with pytest.raises(tf.errors.AbortedError, match="virtual worker 1 failed"):
        failed.clock.wait(0, timeout=60)
    # The next run gets new servers, holding the Keras model's weights.
    runner.vws[1].slowdown = None
    runner.train(data, 6)
    assert runner.servers is not failed and runner.servers.clock.clocks() == ((3, 3), 3)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)


def test_a_worker_that_ends_its_run_early_no_longer_holds_the_others_back():
    # Worker 1 ends after 9 minibatches (stopped, or a shorter share of the data); worker 0's
    # minibatch 16 needs every worker's wave 6 (D = 0, Nm = 2), which worker 1 never pushes:
    # the end of its run retires it at the clock, so worker 0 goes on instead of waiting.
    model = constant_gradient_model()
    data, _ = exact_sgd_case(model, 16)
    _, expected = exact_sgd_case(model, 0)  # the start, then every update applied exactly once:
    for x, _ in data[0] + data[1][:9]:
        for path, g in constant_gradients(model, x).items():
            expected[path] -= 0.05 * g
    servers = wsp_runner(model, ("1,1", "1,1"), nm=2, d=0, loss=mean_output).servers
    config = RunConfig(num_in_flight=2, staleness_bound=0, optimizer=keras.optimizers.SGD(0.05), loss=mean_output,
                       timeout_s=60, dilation=1)
    workers = [BoundWorkers([VirtualWorker.from_config(
        model, WorkerSpec("1,1", (f"/device:CPU:{2 * w}", f"/device:CPU:{2 * w + 1}")), config)], config, servers,
        worker_ids=[w]) for w in (0, 1)]
    short = threading.Thread(target=lambda: workers[1].train([data[1][:9]], 9, Dilation(1.0)))
    short.start()
    [report] = workers[0].train([data[0]], 16, Dilation(1.0))
    short.join()
    assert report.steps == 16  # all of them, none ended by the pull's 60 s timeout
    assert servers.clock.clocks() == ((8, 5), 5)  # worker 1 pushed its partial wave 4; both retired now
    servers.write_to(model)
    for v in model.trainable_variables:  # nothing of the shorter run lost, nothing applied twice
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)


def _pipeline_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("hetpipe-")]


def test_stats_and_trace_show_every_worker():
    keras.utils.set_random_seed(0)
    model = models.mlp()
    runner = wsp_runner(model, ("1,1", "0.5,0.5"), nm=2, d=0, loss=LOSS, dilation=None)  # calibrated
    probes, probe = [], runner.group.probe
    runner.group.probe = lambda d, *args: (probes.append(d), probe(d, *args))[1]
    runner.train([random_batches(model, 4, seed=i) for i in range(2)], 4)
    calibrated = runner.emulation_report().calibration
    assert [d for d, _ in calibrated] == probes  # every worker probed at once, for one dilation
    runner.train([random_batches(model, 8, seed=i) for i in range(2)], 8, trace=True)
    report = runner.emulation_report()  # the run's one dilation: no probe again
    assert len(probes) == len(calibrated) and report.calibration == calibrated
    assert report.dilation >= calibrated[-1][0]  # the first passing probe's, or steps above it
    stats = runner.stats()
    assert [s["worker"] for s in stats] == [0, 1]
    assert all(s["clock"] == 6 and s["clock_distance"] == 0 for s in stats)
    events = runner.trace.events()
    for cat in ("PushUpdate", "Push", "PullWeights", "MergePulled", "PullWait"):
        assert {e["pid"] for e in events if e.get("cat") == cat} == {0, 1}, cat


def test_bad_arguments_are_named():
    model = models.mlp()
    with pytest.raises(ValueError, match=r"staleness_bound \(D\) must be an integer >= 0, got -1"):
        wsp_runner(model, ("1,1",), nm=2, d=-1, loss=LOSS)
    runner = wsp_runner(model, ("1,1", "1,1"), nm=2, d=0, loss=LOSS)
    with pytest.raises(ValueError, match="2 workers but data for 1"):
        runner.train([random_batches(model, 4)], 4)
    # An optimizer that keeps the weights in its slots would lose what a pull merges in: one worker only.
    for optimizer in (keras.optimizers.Ftrl(0.1), "schedulefreeadamw"):
        with pytest.raises(ValueError, match=r"(Ftrl|ScheduleFreeAdamW) with 2 virtual workers: it keeps the weights "
                                             r"themselves in its slots"):
            wsp_runner(model, ("1,1", "1,1"), nm=2, d=0, loss=LOSS, optimizer=optimizer)
    wsp_runner(model, ("1,1",), nm=2, d=0, loss=LOSS, optimizer=keras.optimizers.Ftrl(0.1))


# BSP, SSP and ASP (§2.2): WSP's machinery with per-minibatch clocks ------------------------------

def _missed(records, nm):
    """Per (worker, minibatch p): the most of another worker's minibatches 1 .. p - Nm that its
    weights did not hold (a clock is a minibatch: wave c is minibatch c + 1)."""
    workers = {w for w, _ in records}
    return {(w, p): max(max(p - nm, 0) - len({c for v, c in pushed if v == other and c < p - nm})
                        for other in workers - {w})
            for (w, p), (_, pushed) in records.items()}


def _held(batches, first, release):
    """`batches`, all but the first `first` only once `release` is set: a worker held back."""
    yield from batches[:first]
    assert release.wait(120), "the held worker was never released"
    yield from batches[first:]


@pytest.mark.parametrize("sync,s,nm", [("bsp", 0, 1), ("ssp", 1, 1), ("ssp", 2, 2)])
def test_bsp_and_ssp_keep_their_bound_and_a_worker_held_back_makes_the_other_reach_it(sync, s, nm):
    # Minibatch p's weights hold every other worker's minibatches 1 .. p - Nm - s (with Nm = 1
    # and s = 0, BSP: no worker starts p + 1 before every worker pushed p). Worker 1 asks for its
    # minibatch Nm + 1 once it applied and pushed its first, and is held there until worker 0 has
    # done minibatch c + Nm + s, c the minibatches worker 1 pushed: the furthest the bound lets it
    # go, whose weights miss exactly s of worker 1's, whatever the threads' timing.
    keras.utils.set_random_seed(0)
    model = models.mlp()
    n = 10
    runner = wsp_runner(model, ("1,1", "1,1"), nm, s, loss=LOSS, record_provenance=True, sync=sync)
    release = threading.Event()

    def done(w, p, logs):
        if w == 0 and p == runner.servers.clock.clocks()[0][1] + nm + s:
            release.set()

    runner.train([random_batches(model, n, seed=0), _held(random_batches(model, n, seed=1), nm, release)], n,
                 on_minibatch_done=done)
    assert release.is_set()
    for stage in range(2):
        records = runner.provenance(stage)
        assert staleness.check(records, nm, s, 2, sync=sync) == 2 * n
        assert max(m for (w, _), m in _missed(records, nm).items() if w == 0) == s
    assert runner.servers.clock.clocks() == ((n, n), n)  # a clock per minibatch, not per wave


def test_asp_a_stopped_worker_does_not_hold_back_the_others():
    # Worker 1 stops after its first minibatch until worker 0 has done all of its own: under
    # ASP every pull is answered at once, so worker 0 finishes (under BSP or SSP it would wait).
    model = constant_gradient_model()
    data, expected = exact_sgd_case(model, 8)
    release, seen = threading.Event(), {}

    def stopped(batches):
        yield batches[0]
        release.wait(120)
        yield from batches[1:]

    def done(w, p, logs):
        if w == 0 and p == 8:
            seen["clocks"] = runner.servers.clock.clocks()[0]
            release.set()

    runner = wsp_runner(model, ("1", "1"), 1, 0, loss=mean_output, sync="asp", record_provenance=True)
    runner.train([data[0], stopped(data[1])], 8, on_minibatch_done=done)
    assert seen["clocks"][0] >= 7 and seen["clocks"][1] <= 1, seen
    assert staleness.check(runner.provenance(0), 1, 0, 2, sync="asp") == 16  # the local bound only
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)


@pytest.mark.parametrize("sync,s", [("bsp", 0), ("ssp", 1), ("asp", 0)])
def test_bsp_ssp_and_asp_apply_every_update_of_every_worker_exactly_once(sync, s):
    model = constant_gradient_model()
    data, expected = exact_sgd_case(model, 7)
    runner = wsp_runner(model, ("1,1", "0.5,0.5"), 2, s, loss=mean_output, sync=sync)
    runner.train(data, 7)
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), expected[v.path], atol=1e-5, err_msg=v.path)
    assert runner.servers.clock.clocks() == ((7, 7), 7)
