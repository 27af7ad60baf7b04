"""Re-planning's pure parts: a persistent emulated slowdown, the watch's persistence rule, and the
decision (planner and simulator with measured speeds, hysteresis)."""
import dataclasses
import sys
from pathlib import Path

import pytest

from hetpipe_tf.pipeline.emulation import Pacer, PersistentSlowdown, RunProgress
from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.planning.planner import PlanError, plan
from hetpipe_tf.planning.profile import Profile, SegmentTimes
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime.replan.decide import SwitchRule, decide, predicted_images_per_s, replanned
from hetpipe_tf.runtime.replan.watch import StageWatch, WatchRule

N = 8


def _profile():
    return Profile(model="toy", batch_size=8, starts=tuple(range(N)), weight_bytes=(100,) * N, state_bytes=(10,) * N,
                   activation_bytes=(1000,) * N, cut_bytes=(0,) + (500,) * (N - 1), forward_flops=(1,) * N,
                   backward_flops=(2,) * N, traffic_bytes=(1,) * N, kernels=(1,) * N,
                   layer_names=tuple(f"l{i}" for i in range(N)),
                   times={"host": SegmentTimes((0.001,) * N, (0.002,) * N, 0.0, 0.0, "test")},
                   apply_base=0.0001, apply_per_byte=0.0)


@pytest.fixture(scope="module")
def planned():
    request = PlanRequest(policy="ed", staleness_bound=0)
    return plan(_profile(), load_cluster("local"), request), request


# A persistent slowdown -----------------------------------------------------------------------
def test_persistent_slowdown_follows_the_runs_minibatches_and_stays():
    progress = RunProgress()
    slow = PersistentSlowdown("host-F:1", 3.0, progress, after_minibatches=10)
    mine, other = PersistentSlowdown.for_devices([slow], ["host-F:1", "host-S:1"])
    assert other is None
    pacer = Pacer(1.0, dilation=2.0, slowdown=mine)
    assert pacer.target(0.5, minibatch=1) == pytest.approx(1.0)
    progress.minibatch_done(9)
    assert mine(100) == 1.0  # the worker's own minibatch id plays no part
    progress.minibatch_done()
    assert pacer.target(0.5, minibatch=1) == pytest.approx(3.0)
    progress.minibatch_done(1000)
    assert mine(1) == 3.0  # for good


def test_persistent_slowdown_after_seconds_and_its_checks():
    now = [0.0]
    progress = RunProgress(clock=lambda: now[0])
    slow = PersistentSlowdown("d", 2.0, progress, after_s=5.0)
    progress.start()
    now[0] = 4.9
    assert slow.factor_now() == 1.0
    now[0] = 5.0
    assert slow.factor_now() == 2.0
    with pytest.raises(ValueError, match="exactly one"):
        PersistentSlowdown("d", 2.0, progress)
    with pytest.raises(ValueError, match="factor must be >= 1"):
        PersistentSlowdown("d", 0.5, progress, after_s=1.0)


# The watch -----------------------------------------------------------------------------------
def _watch(rule=WatchRule()):
    expected = {(w, s): 0.01 for w in range(2) for s in range(2)}
    devices = {(0, 0): ("F0", 1.0), (0, 1): ("S0", 0.5), (1, 0): ("F1", 1.0), (1, 1): ("S1", 0.5)}
    return StageWatch(expected, devices, rule)


def _waves(watch, waves, factor_of):
    for c in range(waves):
        for stage in watch.expected:
            watch.observe(stage, 0.01 * 1.3 * factor_of(stage, c))  # the host 1.3x the profile throughout


def test_a_lasting_slowdown_meets_the_rule_with_its_measured_speed():
    watch = _watch()
    _waves(watch, 2, lambda st, c: 1.0)  # the host's factor
    assert watch.host_factor == pytest.approx(1.3)
    _waves(watch, 11, lambda st, c: 3.0 if st == (1, 0) else 1.0)
    assert watch.slowed() == []  # 11 waves: not yet
    _waves(watch, 1, lambda st, c: 3.0 if st == (1, 0) else 1.0)
    [s] = watch.slowed()
    assert (s.device, s.stage, s.waves) == ("F1", (1, 0), 12)
    assert s.measured_speed == pytest.approx(1 / 3)


def test_no_trigger_for_a_slowdown_shorter_than_the_window():
    watch = _watch()
    _waves(watch, 2, lambda st, c: 1.0)
    # slowed 11 waves, one normal wave, slowed 11 waves again: never 12 in a row
    _waves(watch, 23, lambda st, c: 3.0 if st == (1, 0) and c != 11 else 1.0)
    assert watch.slowed() == []


def test_the_transient_stragglers_of_wsp_straggler_never_meet_the_rule():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import wsp_straggler
    finally:
        sys.path.pop(0)
    slow = wsp_straggler.slow_waves("transient", 100, 0)  # the benchmark's seeded pattern
    longest = max(max((len(run) for run in "".join("x" if s else "." for s in row).split(".")), default=0)
                  for row in slow)
    assert longest < WatchRule().window_waves
    watch = _watch()
    _waves(watch, 2, lambda st, c: 1.0)
    _waves(watch, 100, lambda st, c: 2.0 if slow[st[0]][c] else 1.0)
    assert watch.slowed() == []


def test_known_speeds_do_not_trigger_again_but_a_further_slowdown_does():
    watch = _watch()
    _waves(watch, 2, lambda st, c: 1.0)
    _waves(watch, 12, lambda st, c: 3.0 if st == (1, 0) else 1.0)
    watch.known(watch.slowed())
    _waves(watch, 20, lambda st, c: 3.0 if st == (1, 0) else 1.0)
    assert watch.slowed() == []
    _waves(watch, 12, lambda st, c: 6.0 if st == (1, 0) else 1.0)
    [s] = watch.slowed()
    assert s.measured_speed == pytest.approx(1 / 6)


def test_watch_rule_checks():
    with pytest.raises(ValueError, match="threshold must be > 1"):
        WatchRule(threshold=1.0)
    with pytest.raises(ValueError, match="window_waves must be an integer >= 1"):
        WatchRule(window_waves=0)


# The decision --------------------------------------------------------------------------------
def _slowed(speed, device="host-F:1"):
    watch = StageWatch({(1, 0): 0.01}, {(1, 0): (device, 1.0)}, WatchRule(window_waves=1, baseline_waves=1))
    watch.observe((1, 0), 0.01)
    watch.observe((1, 0), 0.01 / speed)
    return watch.slowed()


def test_a_slowed_device_is_replanned_and_the_switch_pays(planned):
    p, request = planned
    d = decide(p, request, _slowed(1 / 3), {}, remaining_images=20000, switch_cost_s=1.0, dilation=1.0)
    assert d.switch, d.reason
    assert d.new_images_per_s > 1.5 * d.current_images_per_s
    assert d.current_images_per_s < predicted_images_per_s(p, {}, 1.0)
    assert d.plan.node_boundaries(1) != p.node_boundaries(1)  # the slowed worker's cuts moved
    figures = d.as_dict()
    assert figures["slowed"][0]["device"] == "host-F:1" and figures["boundaries"]


def test_no_switch_when_the_gain_does_not_pay_for_the_switch(planned):
    p, request = planned
    d = decide(p, request, _slowed(1 / 3), {}, remaining_images=500, switch_cost_s=1.0, dilation=1.0)
    assert not d.switch and "less than 2x the switch" in d.reason


def test_no_switch_when_nothing_better_is_found(planned):
    p, request = planned
    # a device slower by a little: the same cuts and Nm, or a gain under the margin
    d = decide(p, request, _slowed(0.95), {}, remaining_images=10 ** 6, switch_cost_s=0.0, dilation=1.0,
               rule=SwitchRule(min_gain=0.1))
    assert not d.switch
    assert d.new_images_per_s < 1.1 * d.current_images_per_s


def test_uneven_runs_are_refused(planned):
    p, request = planned
    uneven = dataclasses.replace(p, minibatch_sizes=(10, 6))
    with pytest.raises(PlanError, match="uneven minibatches"):
        replanned(uneven, request, {"host-F:1": 1 / 3}, 1.0)
    d = decide(uneven, request, _slowed(1 / 3), {}, 1000, 1.0, 1.0)
    assert not d.switch and "uneven minibatches" in d.reason


def test_a_worker_with_two_devices_of_a_node_is_replanned_with_one_of_them_slowed():
    """One worker of the four devices: the slowed device becomes a type of its own beside its node's
    other device of the same type, and the new plan holds every device once, the slowed one's stage
    shorter."""
    request = PlanRequest(policy="ed", vw_size=4, staleness_bound=0)
    p = plan(_profile(), load_cluster("local"), request)
    new = replanned(p, request, {"host-F:1": 1 / 3}, 1.0)
    assert sorted(d.name for d in new.workers[0].devices) == sorted(d.name for d in p.workers[0].devices)
    part = new.workers[0].partition
    ends = list(part.boundaries[1:]) + [N]
    sizes = {d.name: end - start for d, start, end in zip(part.devices, part.boundaries, ends)}
    assert sizes["host-F:1"] < sizes["host-F:0"]
