import threading
import time

import pytest
import tensorflow as tf

from hetpipe_tf.ops.wsp_clock import WspClock


def test_clocks_follow_the_slowest_stage_and_worker():
    clock = WspClock([2, 1])
    assert clock.clocks() == ((0, 0), 0)
    clock.push(0, 0, 0)
    assert clock.clocks() == ((0, 0), 0)  # worker 0's clock waits for its slowest stage
    clock.push(0, 1, 0)
    clock.push(1, 0, 0)
    clock.push(1, 0, 1)
    assert clock.clocks() == ((1, 2), 1)


def test_wait_returns_when_every_worker_pushed_the_wave():
    clock = WspClock([1, 1])
    assert clock.wait(-1, timeout=1) == 0  # nothing to wait for
    got = []
    waiter = threading.Thread(target=lambda: got.append(clock.wait(0, timeout=30)))
    waiter.start()
    time.sleep(0.2)
    clock.push(0, 0, 0)
    time.sleep(0.2)
    assert not got  # worker 1 has not pushed wave 0 yet
    clock.push(1, 0, 0)
    waiter.join(timeout=10)
    assert got == [1]


def test_many_waits_hold_no_thread():
    # More pending waits than TensorFlow has inter-op threads: an asynchronous kernel waits
    # without holding one, so all of them complete when the wave arrives.
    clock = WspClock([1, 1])
    results = []
    waiters = [threading.Thread(target=lambda: results.append(clock.wait(0, timeout=30))) for _ in range(40)]
    for t in waiters:
        t.start()
    time.sleep(0.5)
    clock.push(0, 0, 0)
    clock.push(1, 0, 0)
    for t in waiters:
        t.join(timeout=10)
    assert results == [1] * 40


def test_wait_times_out_naming_the_workers_behind():
    clock = WspClock([2, 3])
    clock.push(0, 0, 0)
    clock.push(0, 1, 0)
    clock.push(1, 0, 0)
    t0 = time.perf_counter()
    with pytest.raises(tf.errors.DeadlineExceededError,
                       match=r"waited 0.3 s for every virtual worker to push wave 0; behind: "
                             r"virtual worker 1: stage 1 \(pushed 0 waves\), stage 2 \(pushed 0 waves\)"):
        clock.wait(0, timeout=0.3)
    assert time.perf_counter() - t0 >= 0.3  # it waited its timeout out


def test_pushes_must_come_in_order_once():
    clock = WspClock([1])
    clock.push(0, 0, 0)
    with pytest.raises(tf.errors.FailedPreconditionError, match="pushed wave 0 but its next wave is 1 .*twice"):
        clock.push(0, 0, 0)
    with pytest.raises(tf.errors.FailedPreconditionError, match="pushed wave 3 but its next wave is 1"):
        clock.push(0, 0, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="virtual worker 2 stage 0"):
        clock.push(2, 0, 0)


def test_abort_fails_every_waiting_and_later_wait_at_once():
    clock = WspClock([1, 1])
    errors = []

    def wait():
        try:
            clock.wait(0, timeout=60)
        except tf.errors.AbortedError as exc:
            errors.append(exc.message)

    waiters = [threading.Thread(target=wait) for _ in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.3)
    clock.abort("virtual worker 1 failed")
    for t in waiters:
        t.join(timeout=90)  # past the waits' own 60 s timeout, which would end them without an AbortedError
    assert not any(t.is_alive() for t in waiters)
    assert len(errors) == 3
    assert all("the WSP run was aborted: virtual worker 1 failed" in e for e in errors)
    with pytest.raises(tf.errors.AbortedError, match="virtual worker 1 failed"):
        clock.wait(5, timeout=60)


def test_a_retired_worker_no_longer_holds_back_the_global_clock():
    clock = WspClock([1, 1, 1])
    for w in (0, 1):
        clock.push(w, 0, 0)
        clock.push(w, 0, 1)
    clock.push(2, 0, 0)  # worker 2 stopped after wave 0
    got = []
    waiter = threading.Thread(target=lambda: got.append(clock.wait(1, timeout=30)))
    waiter.start()
    time.sleep(0.3)
    assert not got
    clock.retire(2)
    waiter.join(timeout=10)
    assert got == [2]  # the minimum over workers 0 and 1
    assert clock.clocks() == ((2, 2, 1), 2)  # its own clock stays as it pushed
    with pytest.raises(tf.errors.DeadlineExceededError) as behind:
        clock.wait(2, timeout=0.2)
    assert ("behind: virtual worker 0: stage 0 (pushed 2 waves); virtual worker 1: stage 0 (pushed 2 waves)\n"
            in behind.value.message)  # not the retired one
    clock.retire(2, retired=False)  # its next run: it holds the clock back again
    assert clock.clocks() == ((2, 2, 1), 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="retire of virtual worker 3"):
        clock.retire(3)
