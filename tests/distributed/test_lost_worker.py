"""A lost virtual worker's process (issue 12 item 4): with on_worker_failure="continue" the run
goes on without it (retired at the WSP clock), restarts it at the epoch's end from the global
weights at the global clock, and every update pushed is applied once; with "stop", the error."""
import re

import pytest
import tensorflow as tf

from hetpipe_tf.distributed.heartbeat import HeartbeatMonitor, Watched
from hetpipe_tf.distributed.lost_workers import rejoin_at_global_clock
from hetpipe_tf.ops.wsp_clock import WspClock
from tests.helpers.counting_run import TIMEOUT_S, applied_exactly, run_counting
from tests.helpers.processes import responder_process, silent_s, wait_for

def _check_continued(proc, result, why):
    assert proc.returncode == 0 and result, proc.stderr[-3000:]
    # One line names the lost worker and says that training goes on without it.
    assert re.search(rf"hetpipe: virtual worker 1 was lost \(lost task vw1:0 at 127\.0\.0\.1:\d+: {why}.*\) at "
                     rf"clock \d+; training continues without it \(1 of 2 virtual workers", proc.stderr), \
        proc.stderr[-3000:]
    assert re.search(r"hetpipe: virtual worker 1 restarted from the global weights; it rejoins at clock \d+",
                     proc.stderr), proc.stderr[-3000:]
    assert result["epochs"] == 3
    [lost] = result["lost"]
    assert lost["worker"] == 1
    # Worker 0 trained all its 12 minibatches (6 waves); worker 1, restarted at epoch 1's end, rejoined
    # at the global clock when its new process was up: worker 0's at that end (4) or a wave later, when
    # worker 0 went on into epoch 2 alone while the process started; it pushed epoch 2's 2 waves from there.
    assert result["clocks"] == [6, lost["rejoined_at"] + 2] and lost["rejoined_at"] in (4, 5), result["clocks"]
    # Every wave pushed is applied once, and nothing else: the global weights are the start minus
    # lr * g for every minibatch of every wave pushed (worker 1's before it was lost and after).
    waves = result["clocks"][0] + lost["clock"] + result["clocks"][1] - lost["rejoined_at"]
    assert applied_exactly(result, 2 * waves)
    return lost


def test_a_killed_worker_is_retired_the_others_go_on_and_it_rejoins_at_the_global_clock():
    proc, result = run_counting("continue", ("vw1", "SIGKILL", 0, None))
    lost = _check_continued(proc, result, "killed by signal 9")
    # Killed idle at the end of epoch 0 (clock 2): worker 0's clock went past it, to 4, while it was out.
    assert lost["clock"] == 2, lost
    print(f"worker SIGKILL: retired {lost['detected_s']:.2f} s after the signal")


@pytest.mark.slow
def test_a_stopped_worker_is_given_up_after_timeout_and_the_others_go_on():
    proc, result = run_counting("continue", ("vw1", "SIGSTOP", 1, 1))  # after epoch 1's second minibatch
    lost = _check_continued(proc, result, "no heartbeat for")
    # Given up once a ping went unanswered for timeout_s (how long after the signal is the host's).
    assert silent_s(lost["reason"]) >= TIMEOUT_S, lost
    print(f"worker SIGSTOP: retired {lost['detected_s']:.2f} s after the signal")


@pytest.mark.slow
def test_with_stop_a_killed_worker_ends_the_run_naming_it():
    proc, result = run_counting("stop", ("vw1", "SIGKILL", 0, None))
    assert proc.returncode != 0 and result is None
    assert re.search(r"lost task vw1:0 at 127\.0\.0\.1:\d+: killed by signal 9", proc.stderr), proc.stderr[-3000:]
    assert "training continues" not in proc.stderr


def test_a_rejoining_worker_starts_at_the_global_clock_with_its_stages_caught_up():
    # Worker 1 of 2 stages was lost with stage 1 a wave ahead of stage 0 (clock 1); worker 0 went on to 3.
    clock = WspClock([2, 2])
    for wave in range(3):
        clock.push(0, 0, wave)
        clock.push(0, 1, wave)
    clock.push(1, 0, 0)
    clock.push(1, 1, 0)
    clock.push(1, 1, 1)
    clock.retire(1)
    assert clock.clocks() == ((3, 1), 3)
    assert rejoin_at_global_clock(clock, 1, running=[0]) == 3
    assert clock.clocks() == ((3, 3), 3)
    # Both its stages push wave 3 next; the global clock waits for it again.
    clock.push(0, 0, 3)
    clock.push(0, 1, 3)
    assert clock.clocks()[1] == 3
    clock.push(1, 0, 3)
    with pytest.raises(tf.errors.FailedPreconditionError, match="pushed twice"):
        clock.push(1, 0, 3)
    clock.push(1, 1, 3)
    assert clock.clocks() == ((4, 4), 4)


def test_a_forgotten_task_is_no_longer_lost_and_a_new_one_for_it_is_watched():
    reported = []
    (old, old_address), (new, new_address) = responder_process(), responder_process()
    try:
        first, second = Watched("vw1", 0, "127.0.0.1:1", old_address), Watched("vw1", 0, "127.0.0.1:2", new_address)
        monitor = HeartbeatMonitor([first], timeout_s=5.0, on_lost=reported.append).start()
        old.kill()
        assert wait_for(lambda: reported, 10)
        assert monitor.lost == monitor.reported("vw1", 0) == reported[0]
        monitor.forget("vw1", 0)
        assert monitor.lost is None and monitor.reported("vw1", 0) is None
        monitor.add(second)
        assert monitor.tasks == (second,)
        new.kill()  # the new task is watched: its loss is reported too
        assert wait_for(lambda: len(reported) == 2, 10)
        assert monitor.lost == reported[1] and reported[1].address == "127.0.0.1:2"
        monitor.stop()
    finally:
        for p in (old, new):
            p.kill()
            p.wait()
