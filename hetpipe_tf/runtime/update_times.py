"""When one training run's updates completed, per virtual worker, and when the run started; its
images per second (every worker together) follow from them.

All times are on one clock (``time.perf_counter()``) of the process that counts them: the one
process of an in-process run (:class:`hetpipe_tf.runtime.wsp_runner.BoundWorkers`), or the chief of
a run with a process per virtual worker, as each worker's messages reach it, whichever hosts the
workers' processes run on (:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`).
"""
import threading
from collections.abc import Sequence


class UpdateTimes:
    """One run's update completions per worker, and its start: the first worker's."""

    def __init__(self, workers: int) -> None:
        self._lock = threading.Lock()
        self._start: float | None = None
        self._done: list[list[float]] = [[] for _ in range(workers)]

    def started(self, now: float) -> None:
        """A worker started training at `now` (the first one's time is the run's start)."""
        with self._lock:
            if self._start is None:
                self._start = now

    def done(self, worker: int, now: float) -> None:
        """An update of `worker` completed at `now`."""
        with self._lock:
            self._done[worker].append(now)

    @property
    def start(self) -> float | None:
        """When the run started, or None before it did."""
        return self._start

    def of(self, worker: int) -> list[float]:
        """When each update of `worker` completed so far, in order."""
        with self._lock:
            return list(self._done[worker])

    def images_per_s(self, batch_sizes: Sequence[int]) -> float:
        """The samples of the updates so far (each worker's count times its minibatch size in
        `batch_sizes`), every worker together, over the time from the run's start to the last
        update; 0 before the first update."""
        with self._lock:
            ends = [t for times in self._done for t in times]
            if not ends or self._start is None:
                return 0.0
            images = sum(len(times) * b for times, b in zip(self._done, batch_sizes))
            return images / (max(ends) - self._start)
