"""A stage's sends on a lane of its own (hetpipe_tf.sync.lanes)."""
import threading
import time

import pytest

from hetpipe_tf.sync.lanes import StageLanes


def test_a_stages_sends_run_in_order_and_settle_waits_for_them():
    lanes, seen = StageLanes("test", worker=0), []

    def send(stage, i):
        time.sleep(0.01 * (3 - i))  # later sends are quicker: only the lane keeps the order
        seen.append((stage, i))

    for i in range(3):
        for stage in (0, 1):
            lanes.submit(stage, f"send {i}", send, stage, i)
    lanes.settle(timeout_s=10)
    assert [i for s, i in seen if s == 0] == [0, 1, 2] and [i for s, i in seen if s == 1] == [0, 1, 2]


def test_settle_raises_a_sends_error():
    lanes = StageLanes("test", worker=0)

    def fail():
        raise ConnectionError("server 1 is gone")

    lanes.submit(0, "push of wave 0", lambda: None)
    lanes.submit(1, "push of wave 0", fail)
    with pytest.raises(ConnectionError, match="server 1 is gone"):
        lanes.settle(timeout_s=10)


def test_a_send_that_does_not_end_is_named_not_waited_for_forever():
    lanes, release = StageLanes("test", worker=3), threading.Event()
    lanes.submit(1, "push of wave 4", release.wait)
    with pytest.raises(TimeoutError, match=r"stage 1's push of wave 4 of virtual worker 3 did not end within 0.2 s"):
        lanes.settle(timeout_s=0.2)
    release.set()
