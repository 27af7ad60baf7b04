"""A run's images/s (:class:`hetpipe_tf.runtime.update_times.UpdateTimes`, behind
``BoundWorkers.images_per_s`` in one process and ``ProcessRunner.images_per_s`` on the chief): the
samples of every worker's updates over the time from the run's start to its last update.
``ProcessRunner`` feeds it each worker's Started and Done as they reach the chief
(tests/runtime/test_replan_processes.py checks that in a run, slow)."""
import pytest

from hetpipe_tf.runtime.update_times import UpdateTimes


def test_images_per_s_counts_each_workers_updates_at_its_minibatch_size_from_the_first_start():
    times = UpdateTimes(2)
    assert times.images_per_s([4, 8]) == 0.0  # before any update
    times.started(10.0)
    times.started(10.5)  # a later worker's start: the train started at the first
    for t in (11.0, 12.0):
        times.done(0, t)
    times.done(1, 12.5)
    # (2 updates x 4 + 1 update x 8) samples over 12.5 - 10.0 s
    assert times.images_per_s([4, 8]) == pytest.approx(16 / 2.5)

    assert times.start == 10.0 and times.of(0) == [11.0, 12.0] and times.of(1) == [12.5]
