"""The chief's images/s of a run with a process per virtual worker
(:class:`hetpipe_tf.distributed.process_runner.UpdateTimes`, behind ``ProcessRunner.images_per_s``):
the samples of every worker's updates over the time from the train's start to its last update, as
``BoundWorkers.images_per_s`` in one process. ``ProcessRunner`` feeds it each worker's Started and
Done as they reach the chief (tests/runtime/test_replan_processes.py checks that in a run, slow)."""
import pytest

from hetpipe_tf.distributed.process_runner import UpdateTimes


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

