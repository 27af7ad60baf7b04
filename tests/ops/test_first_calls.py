"""The first call of a graph function holds FIRST_CALLS (hetpipe_tf.ops.first_calls); later calls,
and the runs of a function that may wait for others, do not."""
import threading

import tensorflow as tf

from hetpipe_tf.ops.first_calls import FIRST_CALLS, FirstCallLocked


def _held_elsewhere():
    """Whether another thread holds FIRST_CALLS now."""
    got = []

    def try_it():
        got.append(FIRST_CALLS.acquire(timeout=0.05))
        if got[0]:
            FIRST_CALLS.release()

    t = threading.Thread(target=try_it)
    t.start()
    t.join()
    return not got[0]


def test_the_first_call_traces_and_runs_under_the_lock_and_later_calls_without_it():
    seen = []

    def probe(x):  # runs as Python at tracing, and at every run through a py_function
        seen.append(("trace", _held_elsewhere()))
        return tf.py_function(lambda v: seen.append(("run", _held_elsewhere())) or v, [x], tf.float32)

    fn = FirstCallLocked(tf.function(probe))
    fn(tf.constant(1.0))
    fn(tf.constant(2.0))
    assert seen == [("trace", True), ("run", True), ("run", False)]


def test_a_function_that_may_wait_is_traced_under_the_lock_and_runs_without_it():
    seen = []

    def probe(x):
        seen.append(("trace", _held_elsewhere()))
        return tf.py_function(lambda v: seen.append(("run", _held_elsewhere())) or v, [x], tf.float32)

    FirstCallLocked(tf.function(probe), waits=True)(tf.constant(1.0))
    assert seen == [("trace", True), ("run", False)]
