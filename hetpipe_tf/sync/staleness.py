"""Checking the staleness bounds of Wave Synchronous Parallel on recorded weight versions (§4, §5).

Pure Python. A record says, for minibatch p of virtual worker w, which of w's own
minibatches' updates the weights its forward pass used held (local), and which pushed
waves of which workers they held (global). With Nm minibatches in flight
(s_local = Nm - 1) and staleness bound D:

* local bound (§4): the weights hold every local update of minibatches 1 .. p - Nm;
* global bound (§5): for every p > (D + 1)(s_local + 1) + s_local, they hold every other
  worker's updates of minibatches 1 .. p - (s_global + 1), where
  s_global = (D + 1)(s_local + 1) + s_local - 1. Updates are pushed a wave at a time, so
  that means every wave holding any of those minibatches.

Seed 001's example (D = 0, s_local = 3): minibatch 11 must hold the global updates of
minibatches 1..4 (wave 0), minibatch 12 those of 1..8 (waves 0 and 1).
"""
import math
from dataclasses import dataclass


class StalenessViolation(AssertionError):
    """A minibatch's weights missed updates its bound requires."""


@dataclass(frozen=True)
class Bounds:
    num_in_flight: int  # Nm
    staleness_bound: int  # D

    @property
    def s_local(self):
        return self.num_in_flight - 1

    @property
    def s_global(self):
        return (self.staleness_bound + 1) * (self.s_local + 1) + self.s_local - 1

    def local_required(self, p):
        """Own minibatches whose updates w_p must hold."""
        return set(range(1, p - self.num_in_flight + 1))

    def waves_required(self, p):
        """Waves of every other worker that w_p must hold."""
        if p <= (self.staleness_bound + 1) * (self.s_local + 1) + self.s_local:
            return set()
        last = p - (self.s_global + 1)
        return set(range(math.ceil(last / self.num_in_flight)))


def check(records, num_in_flight, staleness_bound, num_workers):
    """Raises StalenessViolation listing every minibatch whose weights broke a bound.

    Args:
      records: {(worker, minibatch): (local minibatch ids, {(worker, wave), ...})}.
    Returns:
      The number of (worker, minibatch) records checked.
    """
    bounds = Bounds(num_in_flight, staleness_bound)
    problems = []
    for (w, p), (local, pushed) in sorted(records.items()):
        missing_local = sorted(bounds.local_required(p) - set(local))
        if missing_local:
            problems.append(f"worker {w} minibatch {p}: local updates {missing_local} missing")
        needed = {(other, wave) for other in range(num_workers) if other != w for wave in bounds.waves_required(p)}
        missing = sorted(needed - set(pushed))
        if missing:
            problems.append(f"worker {w} minibatch {p}: global updates (worker, wave) {missing} missing")
    if problems:
        raise StalenessViolation(f"{len(problems)} minibatch(es) broke the WSP bounds (Nm={num_in_flight}, "
                                 f"D={staleness_bound}, s_global={bounds.s_global}): " + "; ".join(problems[:10]))
    return len(records)
