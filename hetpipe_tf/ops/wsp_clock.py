"""Python wrapper of the Wave Synchronous Parallel clock op (HetPipe §5).

The parameter servers keep, for every stage of every virtual worker, how many waves it
has pushed. A worker's clock is its slowest stage's, the global clock the slowest
worker's. ``wait(c - D)`` at the end of clock c returns once every worker has pushed
wave c - D; the kernel is asynchronous (it holds no thread while it waits) and fails
after `timeout` seconds naming the workers and stages that are behind.

The wait runs inside a ``tf.function``: a remote task runs a function's kernels on its
graph executor, where an asynchronous kernel waits without a thread, whereas a single
eager op sent to a task holds one of the task's threads until it completes.
"""
import itertools
from collections.abc import Sequence

import tensorflow as tf

from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.ops.loader import load_ops

_ids = itertools.count()


class WspClock:
    """The WSP clock, a resource on a parameter server's device.

    Args:
      stages_per_worker: the number of stages of each virtual worker.
      device: the parameter server device that holds the clock.
      shared_name: the clock's name on its device; processes that give the same name use the
        same clock (default: a name of this process's own).
      create: False to use a clock that another process created under `shared_name`.
    """

    def __init__(self, stages_per_worker: Sequence[int], device: str | None = None, shared_name: str | None = None,
                 create: bool = True) -> None:
        self._ops = load_ops()
        self.device = device
        self.stages_per_worker = tuple(int(n) for n in stages_per_worker)
        self.name = shared_name or f"wsp_clock_{next(_ids)}"
        with tf.device(device):
            self._handle = self._ops.hetpipe_wsp_clock_handle(shared_name=self.name)
            if create:
                self._ops.hetpipe_wsp_clock_create(self._handle, tf.constant(self.stages_per_worker, tf.int64))
        self._wait_fn = FirstCallLocked(tf.function(self.wait_graph), waits=True)

    def wait_graph(self, wave: tf.Tensor, timeout: tf.Tensor) -> tf.Tensor:
        """The wait op, for use inside a ``tf.function``: returns the global clock."""
        with tf.device(self.device):
            return self._ops.hetpipe_wsp_clock_wait(self._handle, wave, timeout)

    def push_graph(self, worker: int | tf.Tensor, stage: int | tf.Tensor, wave: tf.Tensor) -> tf.Operation:
        """The push op, for use inside a ``tf.function``."""
        with tf.device(self.device):
            return self._ops.hetpipe_wsp_clock_push(self._handle, worker, stage, wave)

    def clocks_graph(self) -> tuple[tf.Tensor, tf.Tensor]:
        """(worker clocks, global clock) as tensors, for use inside a ``tf.function``."""
        with tf.device(self.device):
            workers, global_clock = self._ops.hetpipe_wsp_clock_stats(self._handle)
        return workers, global_clock

    def push(self, worker: int, stage: int, wave: int) -> None:
        """Records that `stage` of `worker` pushed its update of `wave` (in order)."""
        with tf.device(self.device):
            self._ops.hetpipe_wsp_clock_push(self._handle, tf.constant(worker, tf.int64),
                                             tf.constant(stage, tf.int64), tf.constant(wave, tf.int64))

    def wait(self, wave: int, timeout: float) -> int:
        """Blocks until every worker has pushed `wave` (at once if wave < 0); the global clock."""
        return int(self._wait_fn(tf.constant(wave, tf.int64), tf.constant(float(timeout), tf.float32)))

    def abort(self, reason: str) -> None:
        """Ends a failed run: every wait, now and later, fails at once (tf.errors.AbortedError
        naming `reason`), so that no worker waits for a wave nobody will push."""
        with tf.device(self.device):
            self._ops.hetpipe_wsp_clock_abort(self._handle, tf.constant(str(reason)))

    def retire(self, worker: int, retired: bool = True) -> None:
        """A worker that ended its run (stopped early) pushes no more waves: retired, it no
        longer holds back the global clock, so the others' waits for waves it never pushes
        end; retired=False when it starts its next run."""
        with tf.device(self.device):
            self._ops.hetpipe_wsp_clock_retire(self._handle, tf.constant(worker, tf.int64),
                                               tf.constant(bool(retired)))

    def clocks(self) -> tuple[tuple[int, ...], int]:
        """(each worker's clock, the global clock)."""
        with tf.device(self.device):
            workers, global_clock = self._ops.hetpipe_wsp_clock_stats(self._handle)
        return tuple(int(c) for c in workers.numpy()), int(global_clock)
