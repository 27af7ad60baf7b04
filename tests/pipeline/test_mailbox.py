import threading

import pytest

from hetpipe_tf.pipeline.mailbox import DuplicateMessageError, Mailbox, PipelineAborted


def test_messages_are_taken_by_key_not_arrival_order():
    mb = Mailbox("stage 2", threading.Event())
    mb.put(("labels", 2), "y2")
    mb.put(("labels", 1), "y1")
    assert mb.take(("labels", 1)) == "y1" and mb.take(("labels", 2)) == "y2"


def test_a_key_delivered_twice_is_an_error():
    mb = Mailbox("stage 0", threading.Event())
    mb.put(("gradient", 3), 1)
    with pytest.raises(DuplicateMessageError, match=r"stage 0 received \('gradient', 3\) twice"):
        mb.put(("gradient", 3), 1)


def test_waits_time_out_with_a_description():
    mb = Mailbox("stage 1", threading.Event())
    with pytest.raises(TimeoutError, match="stage 1 waited 0.05 s with no task ready: needs activation 4"):
        mb.wait_until(lambda: None, 0.05, lambda: "needs activation 4")


def test_waits_wake_on_arrival_and_on_abort():
    abort = threading.Event()
    mb = Mailbox("stage 1", abort)
    threading.Timer(0.05, lambda: mb.put(("activation", 1), "x")).start()
    assert mb.wait_until(lambda: mb.arrival(("activation", 1)), 5, str) is not None
    threading.Timer(0.05, lambda: (abort.set(), mb.wake())).start()
    with pytest.raises(PipelineAborted):
        mb.wait_until(lambda: None, 5, str)
