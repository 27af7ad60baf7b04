"""A run that goes on without a virtual worker whose process was lost, and takes it back.

With ``on_worker_failure="continue"`` (:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`)
a virtual worker whose process is lost (killed, or stopped and given up by the heartbeats,
:mod:`hetpipe_tf.distributed.heartbeat`) is retired at the WSP clock, so that its clock no longer
holds back the global clock (§5: a pull waits for the slowest worker still running); one line
names it, and the others train on. The minibatches it had still to train in that epoch are not
trained (fit counts them as steps without an update). At the end of the epoch, once the others
drained, a new process takes its place: it takes the global weights (and a fresh optimizer),
goes on in its shard where the epoch ended, and rejoins the clock at the global clock (its missed
waves count as empty pushes, :func:`rejoin_at_global_clock`), so it holds no one back. What it
pushed before it was lost stays applied, once: a push is one call that applies the update and
records the wave.
"""
import sys
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetpipe_tf.ops.wsp_clock import WspClock


@dataclass
class LostWorker:
    """A virtual worker whose process was lost in a run that went on without it: why (the
    heartbeat's line, or how its connection ended), its WSP clock when it was retired (the waves
    its stages had all pushed), when it was retired, and the global clock it rejoined at when a new
    process took its place (None until then, or if none could start)."""
    worker: int
    reason: str
    clock: int
    found_at: float  # time.perf_counter() when the chief retired it
    rejoined_at: int | None = None


class LostWorkers:
    """The chief's record of the lost virtual workers of a run (see the module docstring).

    Args:
      cluster: the run's cluster (it names a lost task and forgets it).
      clock: the run's WSP clock (:class:`hetpipe_tf.ops.wsp_clock.WspClock`), where a lost worker is
        retired and a restarted one rejoins.
      timeout_s: the longest to wait for the cluster to name a lost task.
    """

    def __init__(self, cluster: Any, clock: "WspClock", timeout_s: float) -> None:
        self.cluster = cluster
        self.clock = clock
        self.timeout_s = timeout_s
        self.records: list[LostWorker] = []  # every LostWorker, in the order they were lost
        self.gone: set[int] = set()  # workers whose process is gone and not yet replaced

    def lose(self, worker: int, job: str, missing: int, total: int) -> None:
        """Goes on without `worker` (its process, job `job`, is gone): retires it at the clock and
        says so in one line (`missing` of its minibatches of this epoch will not be trained; the
        run has `total` workers)."""
        found = self.cluster.lost_task(job, 0, wait_s=min(self.timeout_s, 5.0))
        reason = str(found) if found else f"lost task {job}:0: its order connection ended"
        self.cluster.forget(job, 0)
        self.gone.add(worker)
        self.clock.retire(worker)
        clock = self.clock.clocks()[0][worker]
        self.records.append(LostWorker(worker, reason, clock, time.perf_counter()))
        print(f"hetpipe: virtual worker {worker} was lost ({reason}) at clock {clock}; training continues "
              f"without it ({total - len(self.gone)} of {total} virtual workers; {missing} of its minibatches of "
              f"this epoch not trained; it restarts at the epoch's end)", file=sys.stderr, flush=True)

    def rejoined(self, workers: Iterable[int], running: Collection[int]) -> None:
        """New processes took the places of `workers` (every other worker drained, `running` the
        workers not lost): each rejoins the clock at the global clock."""
        for w in workers:
            record = next(r for r in reversed(self.records) if r.worker == w)
            record.rejoined_at = rejoin_at_global_clock(self.clock, w, running)
            print(f"hetpipe: virtual worker {w} restarted from the global weights; it rejoins at clock "
                  f"{record.rejoined_at}", file=sys.stderr, flush=True)
        self.gone.difference_update(workers)


def rejoin_at_global_clock(clock: "WspClock", worker: int, running: Collection[int]) -> int:
    """Brings `worker` (retired, its process new) back into the WSP clock `clock` (a
    :class:`hetpipe_tf.ops.wsp_clock.WspClock`) at the global clock of the workers `running` (those
    not lost; between runs each is retired by its run's end, so the clock's own global clock would
    count the lost one too): every wave it missed counts as pushed, empty (the clock only: nothing
    is applied), so that it holds no other worker back (§5), and all its stages go on from one wave
    (a stage that had pushed more than another when its process was lost is caught up with).
    Returns the wave it rejoined at, which its next run's waves count from
    (:meth:`hetpipe_tf.sync.wsp.WSP.handlers`): the global clock, or one past it when it was not
    behind (a stage's next wave is found by pushing it)."""
    import tensorflow as tf  # late: defers TensorFlow

    clocks = clock.clocks()[0]
    global_clock = min((clocks[w] for w in running), default=clocks[worker])
    nexts = []
    for stage in range(clock.stages_per_worker[worker]):
        # The stage's next wave is the first the clock takes; it refuses an earlier one as pushed twice.
        # A stage leads its worker's slowest by a wave or two, never by more than the global clock
        # plus the waves in flight: the bound only keeps a broken clock from looping forever.
        for wave in range(clocks[worker], max(global_clock, clocks[worker]) + 64):
            try:
                clock.push(worker, stage, wave)
                break
            except tf.errors.FailedPreconditionError:
                continue
        else:
            raise RuntimeError(f"virtual worker {worker}'s stage {stage} took no wave from {clocks[worker]} on at the "
                               f"WSP clock (global clock {global_clock}); the clock is not this run's")
        nexts.append(wave + 1)
    rejoined = max(global_clock, *nexts)
    for stage, next_wave in enumerate(nexts):
        for wave in range(next_wave, rejoined):
            clock.push(worker, stage, wave)
    clock.retire(worker, retired=False)
    return rejoined
