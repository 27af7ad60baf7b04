"""Bulk Synchronous, Stale Synchronous and Asynchronous Parallel on the parameter servers
(HetPipe §2.2; SSP: Ho et al., the paper's [16]) behind the synchronisation seam, beside WSP.

Pure Python. §2.2: under SSP with threshold s "each worker increases its local clock by one for
every iteration, which is the training period of a minibatch", and a worker at clock c uses
weights that hold every update of iterations 0 .. c - s - 1 of every worker; BSP waits for every
other worker to finish minibatch p before p + 1 (s = 0); ASP never waits. Each is WSP's
machinery (:class:`hetpipe_tf.sync.wsp.WSP`: push, pull gated on the clock, merge, with a
:class:`hetpipe_tf.sync.wsp.PushBase` on each stage, the same parameter servers and clock op)
with a wave of one minibatch, so that a clock counts a worker's pushed minibatches, not its
waves (§5): a push after every update, a pull after it, and minibatch p + Nm + 1, the first
whose weight version is stashed after the push of p (§4), waits for that pull's merge. The
pull is answered once every worker has pushed minibatch p - s.

So, with Nm minibatches in flight, minibatch p's weights hold the worker's own updates of
1 .. p - Nm (§4) and every other worker's of 1 .. p - Nm - s: with Nm = 1 exactly SSP's rule
(clock c = p - 1), with more the pipeline's own staleness comes on top, as in WSP.

* ``ssp``: the bound s is `staleness_bound`.
* ``bsp``: the bound is 0; a `staleness_bound` other than 0 is an error (use ``ssp``).
* ``asp``: no bound; pulls are answered at once with what the servers hold, and a minibatch
  waits only for its own pull's answer, never for another worker. `staleness_bound` must stay
  0 (its default; it bounds nothing here): any other is an error (use ``ssp``).
"""
from hetpipe_tf.pipeline.schedule import register_sync
from hetpipe_tf.sync.wsp import WSP


class SSP(WSP):
    """Stale Synchronous Parallel with per-minibatch clocks: a pull after the push of minibatch p
    waits until every worker pushed minibatch p - s (§2.2)."""

    name = "ssp"

    def wave_size(self, num_in_flight: int) -> int:
        """One minibatch per push: a clock is an iteration (§2.2)."""
        return 1

    def checked_bound(self, staleness_bound: int) -> int | None:
        """s itself."""
        if staleness_bound < 0:
            raise ValueError(f"SSP's staleness bound s must be >= 0, got {staleness_bound}")
        return int(staleness_bound)


class BSP(SSP):
    """Bulk Synchronous Parallel: SSP with s = 0, every worker's minibatch p before p + 1 (§2.2)."""

    name = "bsp"

    def checked_bound(self, staleness_bound: int) -> int | None:
        """0, the only bound BSP has."""
        _only_0(staleness_bound, "BSP waits for every worker at every minibatch: its staleness bound is 0")
        return 0


class ASP(SSP):
    """Asynchronous Parallel: a push after every minibatch, pulls that never wait (§2.2)."""

    name = "asp"
    bounded = False  # every worker at its own pace

    def checked_bound(self, staleness_bound: int) -> int | None:
        """None: no bound."""
        _only_0(staleness_bound, "ASP bounds no staleness (its pulls never wait; 0, the default, is not used)")
        return None


def _only_0(staleness_bound: int, why: str) -> None:
    if staleness_bound != 0:
        raise ValueError(f"{why}, so staleness_bound must be 0, got {staleness_bound}; give 0, or sync='ssp' for "
                         f"a bound of {staleness_bound} minibatches (sync='wsp': {staleness_bound} waves)")


SSP_SCHEME = register_sync(SSP())
BSP_SCHEME = register_sync(BSP())
ASP_SCHEME = register_sync(ASP())
