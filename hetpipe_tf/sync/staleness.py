"""Checking the staleness bounds of the parameter servers' schemes on recorded weight versions
(§4, §5; BSP, SSP and ASP, §2.2).

Pure Python. A record says, for minibatch p of virtual worker w, which of w's own
minibatches' updates the weights its forward pass used held (local), and which pushed
waves of which workers they held (global). With Nm minibatches in flight
(s_local = Nm - 1) and staleness bound D:

* local bound (§4): the weights hold every local update of minibatches 1 .. p - Nm;
* global bound (§5): for every p > (D + 1)(s_local + 1) + s_local, they hold every other
  worker's updates of minibatches 1 .. p - (s_global + 1), where
  s_global = (D + 1)(s_local + 1) + s_local - 1. Updates are pushed a wave at a time, so
  that means every wave holding any of those minibatches: waves 0 .. (p - Nm) // Nm - D - 1.

The HetPipe dissertation's example (D = 0, s_local = 3): minibatch 11 must hold the global updates of
minibatches 1..4 (wave 0), minibatch 12 those of 1..8 (waves 0 and 1).

The same rule with waves of g minibatches (a push per g; g = 1 under BSP, SSP and ASP,
:mod:`hetpipe_tf.sync.ssp`): waves 0 .. (p - Nm) // g - D - 1, s_global = (D + 1)·g + Nm - 2;
for g = 1, every other worker's minibatches 1 .. p - Nm - s. D = None (ASP) requires nothing
global.
"""
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from hetpipe_tf.errors import HetPipeRunError
from hetpipe_tf.pipeline.schedule import SyncScheme, get_sync
from hetpipe_tf.sync.wsp import WSP

#: What a run recorded of (worker, minibatch): (its own minibatches in the weights it used,
#: {(worker, wave), ...} of the others' pushes in them).
Records = Mapping[tuple[int, int], tuple[Collection[int], Collection[tuple[int, int]]]]


class StalenessViolation(HetPipeRunError, AssertionError):
    """A minibatch's weights missed updates its bound requires."""


@dataclass(frozen=True)
class Bounds:
    """The staleness bounds of one run (§5), and the updates a minibatch's weights must hold.

    Args:
        num_in_flight: Nm.
        staleness_bound: D (WSP), s (SSP), 0 (BSP); None: no bound (ASP).
        wave_size: minibatches per push (per clock); None: Nm, a wave of WSP.
    """
    num_in_flight: int  # Nm
    staleness_bound: int | None  # D (WSP), s (SSP), 0 (BSP); None: no bound (ASP)
    wave_size: int | None = None  # minibatches per push (per clock); None: Nm, a wave of WSP

    @property
    def s_local(self) -> int:
        """The local staleness, Nm - 1 minibatches (§4)."""
        return self.num_in_flight - 1

    @property
    def s_global(self) -> int | None:
        """How many of another worker's latest minibatches w_p may miss, less one (None: any)."""
        if self.staleness_bound is None:
            return None
        return (self.staleness_bound + 1) * (self.wave_size or self.num_in_flight) + self.s_local - 1

    def local_required(self, p: int) -> set[int]:
        """Own minibatches whose updates w_p must hold."""
        return set(range(1, p - self.num_in_flight + 1))

    def waves_required(self, p: int) -> set[int]:
        """Waves of every other worker that w_p must hold."""
        if self.staleness_bound is None:
            return set()
        return set(range(max((p - self.num_in_flight) // (self.wave_size or self.num_in_flight)
                             - self.staleness_bound, 0)))


def check(records: Records, num_in_flight: int, staleness_bound: int, num_workers: int,
          sync: str | SyncScheme = "wsp") -> int:
    """Raises StalenessViolation listing every minibatch whose weights broke a bound.

    Args:
      records: {(worker, minibatch): (local minibatch ids, {(worker, wave), ...})}.
      num_in_flight: Nm of the run.
      staleness_bound: the `staleness_bound` the run was given (D of WSP, s of SSP).
      sync: the run's scheme, of the parameter servers' (a registered name or the scheme): its
        wave size and the bound it keeps for `staleness_bound`.
      num_workers: the number of virtual workers of the run.

    Returns:
      The number of (worker, minibatch) records checked.

    Raises:
      StalenessViolation: a minibatch's weights missed updates its bound requires.
      ValueError: `sync` is not a scheme with clocks and waves (wsp, ssp, bsp, asp).
    """
    scheme = get_sync(sync)
    if not isinstance(scheme, WSP):
        raise ValueError(f"the staleness rules are those of the schemes with clocks and waves (wsp, ssp, bsp, asp), "
                         f"got sync={scheme.name!r}")
    bounds = Bounds(num_in_flight, scheme.checked_bound(staleness_bound), scheme.wave_size(num_in_flight))
    problems: list[str] = []
    for (w, p), (local, pushed) in sorted(records.items()):
        missing_local = sorted(bounds.local_required(p) - set(local))
        if missing_local:
            problems.append(f"worker {w} minibatch {p}: local updates {missing_local} missing")
        needed = {(other, wave) for other in range(num_workers) if other != w for wave in bounds.waves_required(p)}
        missing = sorted(needed - set(pushed))
        if missing:
            problems.append(f"worker {w} minibatch {p}: global updates (worker, wave) {missing} missing")
    if problems:
        raise StalenessViolation(f"{len(problems)} minibatch(es) broke the {scheme.name.upper()} bounds "
                                 f"(Nm={num_in_flight}, D={bounds.staleness_bound}, s_global={bounds.s_global}): "
                                 + "; ".join(problems[:10]))
    return len(records)
