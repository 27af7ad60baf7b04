import threading
import time

import pytest

from hetpipe_tf.pipeline.emulation import (
    DeviceOutOfMemoryError, EmulationReport, HostCpu, MemoryAccount, Pacer, calibrate_dilation)


class FakeClock:
    def __init__(self):
        self.t = 0.0
        self.slept = []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def test_pacer_pads_to_dilation_over_speed_times_reference():
    clock = FakeClock()
    pacer = Pacer(speed=0.25, dilation=2.0, clock=clock, sleep=clock.sleep)
    clock.t = 1.0  # the task ran 1 s
    actual, target = pacer.pace(started=0.0, reference=0.5)
    assert (actual, target) == (1.0, 4.0) and clock.t == pytest.approx(4.0)
    clock.t = 14.0  # 10 s: over its 4 s target, no padding
    pacer.pace(started=4.0, reference=0.5)
    assert clock.t == 14.0
    report = pacer.report()
    assert (report.tasks, report.overran, report.overrun_fraction) == (2, 1, 0.5)
    assert report.as_dict()["emulated"] is True


def test_pace_counts_an_overrun_by_the_actual_time_it_returns():
    readings = iter([4.0, 5.0, 6.0])  # the clock moves on by 1 s at every read
    pacer = Pacer(speed=1.0, clock=lambda: next(readings))
    # The host took 4 s of the 4.5 s target: no overrun, though the clock read 5 s a moment later.
    assert pacer.pace(started=0.0, reference=4.5) == (4.0, 4.5)
    assert (pacer.report().tasks, pacer.report().overran) == (1, 0)


def test_a_device_runs_its_tasks_one_after_another_apart_from_the_host():
    clock = FakeClock()
    pacer = Pacer(speed=0.5, dilation=2.0, clock=clock, sleep=clock.sleep)
    clock.t = 0.25  # the host ran the first task for 0.25 s and goes on at once
    assert pacer.occupy(started=0.0, reference=0.5) == (0.0, 2.0) and clock.slept == []
    clock.t = 0.5  # a second task issued at 0.3 waits for the device: it starts when the first ends
    assert pacer.occupy(started=0.3, reference=0.25) == (2.0, 3.0)
    pacer.wait_idle()
    assert clock.t == pytest.approx(3.0)
    clock.t = 5.0  # issued after the device was idle: starts when issued
    assert pacer.occupy(started=4.0, reference=0.25) == (4.0, 5.0)
    assert pacer.report().tasks == 3 and pacer.report().overran == 0


def test_waiting_for_the_device_ends_when_told_to_stop():
    pacer = Pacer(speed=1.0)
    pacer.occupy(started=time.perf_counter(), reference=30.0)  # busy for half a minute
    stop = threading.Event()
    stop.set()
    pacer.wait_idle(stop)  # returns at once


def test_host_cpu_reads_the_busy_share_of_every_core(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3\n")
    host = HostCpu(str(stat)).start()
    # 300 more ticks: 150 busy (user, system, steal), 150 idle or iowait
    stat.write_text("cpu  200 0 130 820 130 0 0 20 0 0\n")
    assert host.busy_fraction() == 0.5
    assert HostCpu(str(tmp_path / "missing")).start().busy_fraction() is None


def test_pacer_rejects_bad_settings():
    with pytest.raises(ValueError, match="speed must be > 0"):
        Pacer(0)
    with pytest.raises(ValueError, match="dilation must be >= 1"):
        Pacer(1, dilation=0.5)


def test_reports_combine():
    r = EmulationReport.combine([EmulationReport(3.0, 10, 1), EmulationReport(3.0, 30, 1)])
    assert (r.tasks, r.overran, r.overrun_fraction) == (40, 2, 0.05)
    assert EmulationReport.combine([]) is None


def test_memory_account_fails_like_an_out_of_memory():
    m = MemoryAccount("stage 1 (emulated)", capacity=1000)
    m.allocate("weights", 600)
    m.allocate("activations", 300)
    m.free("activations", 300)
    with pytest.raises(DeviceOutOfMemoryError,
                       match=r"out of memory on stage 1 \(emulated\) \(emulated capacity 1000 B\): allocating "
                             r"500 B for stashed versions would hold 1.1 KiB \(now holding: weights 600 B\)"):
        m.allocate("stashed versions", 500)
    assert m.peak == 900 and m.held() == {"weights": 600, "activations": 0}
    MemoryAccount("unlimited").allocate("weights", 10 ** 12)


def test_slowdown_makes_chosen_minibatches_slower():
    pacer = Pacer(0.5, dilation=2.0, slowdown=lambda p: 2.0 if p == 3 else 1.0)
    assert pacer.target(0.01, minibatch=2) == pytest.approx(0.04)
    assert pacer.target(0.01, minibatch=3) == pytest.approx(0.08)
    assert pacer.target(0.01) == pytest.approx(0.04)
    with pytest.raises(ValueError, match="slowdown factor must be >= 1, got 0.5 for minibatch 1"):
        Pacer(1.0, slowdown=lambda p: 0.5).target(0.01, minibatch=1)


def test_calibration_takes_the_first_dilation_whose_probe_overran_little():
    overrun = {1.0: 0.6, 1.5: 0.2, 2.0: 0.03, 3.0: 0.01, 4.0: 0.0, 6.0: 0.0}
    probed = []

    def probe(d):
        probed.append(d)
        return EmulationReport(d, 100, round(overrun[d] * 100))

    tried = ((1.0, 0.6), (1.5, 0.2), (2.0, 0.03), (3.0, 0.01))
    assert calibrate_dilation(probe, candidates=tuple(overrun), extra_steps=0) == (3.0, tried)
    assert probed == [1.0, 1.5, 2.0, 3.0]  # no probe past the one that passed
    assert calibrate_dilation(probe, candidates=tuple(overrun), extra_steps=1) == (4.0, tried)
    assert calibrate_dilation(probe, candidates=tuple(overrun)) == (6.0, tried)  # two steps of margin
    assert calibrate_dilation(probe, candidates=(1.0, 1.5, 2.0, 3.0))[0] == 3.0  # no more candidates
    assert calibrate_dilation(probe, candidates=(1.0, 1.5))[0] == 1.5  # none passed: the largest


def test_a_report_above_five_percent_is_not_faithful_and_says_so():
    assert EmulationReport(3.0, 100, 4).faithful and EmulationReport(3.0, 100, 4).warning() is None
    bad = EmulationReport(3.0, 100, 9)
    assert not bad.faithful and bad.as_dict()["emulation_faithful"] is False
    assert bad.warning().startswith("WARNING: the emulation was not faithful: 9 of 100 paced tasks (9.0%)")
