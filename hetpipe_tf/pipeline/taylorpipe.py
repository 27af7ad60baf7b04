"""TaylorPipe (Jang, Yoo and Yook, Applied Sciences 2023): pipelined SGD with a master
and local models per stage and the first-order Taylor compensation of the delayed gradient. A
registration of the schedule seam: "taylorpipe", and "hetpipe-taylor", HetPipe's schedule with
the same compensation, which works inside WSP (TaylorPipe itself runs it without parameter servers).

Pure Python. Algorithm 1, per stage n (computing node n) and minibatch t:

* **local and master models** (§3.1): the stage's live weights are its master model W̄_n; the
  forward pass of t stashes them as the local model W_n^t (weight stashing), and t's backward
  pass differentiates against W_n^t, so forward and backward use one version.
* **Taylor compensation** (§3.2): the gradient g = ∇L(W_n^t) arrives late, once the master has
  moved on by the updates of the minibatches in between; the stage predicts the gradient at the
  master, g + λ·g⊙g⊙(W̄_n − W_n^t) (the Hessian approximated by λ·g⊙g, after DC-ASGD), applies it
  to W̄_n, and the next forward pass copies the updated master (:class:`CompensateGradient`
  before ``ReleaseWeights`` and ``ApplyUpdate``). Each stage compensates its own weights only.
* **work scheduling** (Figure 2): forward and backward passes alternate (PipeDream's 1F1B
  generator, :func:`hetpipe_tf.pipeline.pipedream.one_f_one_b_programs`); node n of N admits
  2(N − n) + 1 minibatches before its first backward pass (seven replicas on the first of four
  nodes, three on the third), here min(Nm, 2(k − q) − 1) for stage q of k (0-based), at most Nm
  versions per stage. With k = 2, Nm = 2 the order is PipeDream's.
* **λ** (the "variance control parameter"): 2.0 in every setting of TaylorPipe's Appendix A
  (Tables A1–A3), the default here; λ = 0 is uncompensated pipelined SGD with weight stashing.

**Inside WSP** ("hetpipe-taylor"): HetPipe's schedule (§4) with the compensation before every
update. W̄ − W_t then holds the local updates since w_p was stashed and, when a merge of pulled
global weights came in between (WSP's merge shifts the live weights, and only the versions of
minibatches that have not started), every other worker's updates that the pull brought: the
compensation also predicts the gradient at the fresher global weights, which is the staleness
of the pulled global weights that WSP's bound D allows.

Another λ: ``TaylorPipeSchedule(variance_control=0.5)`` (or ``HetPipeTaylorSchedule``), given
as the schedule object wherever a schedule name is accepted.
"""
import math

from hetpipe_tf.pipeline.hetpipe import HetPipeSchedule
from hetpipe_tf.pipeline.instructions import CompensateGradient, Instruction
from hetpipe_tf.pipeline.pipedream import PipeDreamSchedule
from hetpipe_tf.pipeline.schedule import register_schedule

#: λ of TaylorPipe, Appendix A (Tables A1-A3: "Variance Control Parameter (λ) 2.0").
DEFAULT_VARIANCE_CONTROL = 2.0


def checked_variance_control(variance_control: float) -> float:
    """λ as a float, or a ValueError saying what was given and what is allowed."""
    try:
        value = float(variance_control)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"TaylorPipe's variance control parameter λ must be a finite number >= 0, got "
                         f"{variance_control!r}; TaylorPipe uses {DEFAULT_VARIANCE_CONTROL:g}, and 0 turns the "
                         f"compensation off")
    return value


class TaylorCompensation:
    """What both TaylorPipe schedules add to theirs: λ (`variance_control`) and, before every
    update, g := g + λ·g⊙g⊙(W̄ − W_t) (§3.2), while W_t, minibatch p's version, is still stashed."""

    variance_control = DEFAULT_VARIANCE_CONTROL
    apply_like: frozenset[type[Instruction]] = frozenset({CompensateGradient})
    #: The compensation takes a stage's own gradient as its backward pass made it: no worker-wide
    #: terms (an unscaled, clipped or summed gradient) before it.
    worker_update = False

    def before_update(self, minibatch: int) -> tuple[Instruction, ...]:
        """The compensation of `minibatch`'s gradient, before its update."""
        return (CompensateGradient(minibatch, variance_control=self.variance_control),)


class TaylorPipeSchedule(TaylorCompensation, PipeDreamSchedule):
    """TaylorPipe (Algorithm 1): 1F1B with weight stashing, stage q admitting
    min(Nm, 2(k - q) - 1) minibatches (Figure 2), each gradient compensated before its update.

    Args:
        variance_control: λ, TaylorPipe's variance control parameter (a finite number >= 0; 0
            turns the compensation off).
        name: the schedule's registered name.

    Raises:
        ValueError: `variance_control` is not a finite number >= 0.
    """

    def __init__(self, variance_control: float = DEFAULT_VARIANCE_CONTROL, name: str = "taylorpipe") -> None:
        super().__init__(vertical_sync=False)
        self.name = name
        self.variance_control = checked_variance_control(variance_control)
        self.instructions = self.instructions | {CompensateGradient}

    def admitted(self, position: int, num_stages: int, num_in_flight: int) -> int:
        """min(Nm, 2(k - q) - 1): node n of N keeps 2(N - n) + 1 replicas (§3.1, Figure 2)."""
        return max(1, min(num_in_flight, 2 * (num_stages - position) - 1))


class HetPipeTaylorSchedule(TaylorCompensation, HetPipeSchedule):
    """HetPipe's schedule (§4) with TaylorPipe's compensation (TaylorPipe §3.2) before every update:
    under WSP it also compensates the staleness of the pulled global weights.

    Args:
        variance_control: λ, as for :class:`TaylorPipeSchedule`.
        name: the schedule's registered name.

    Raises:
        ValueError: `variance_control` is not a finite number >= 0.
    """

    def __init__(self, variance_control: float = DEFAULT_VARIANCE_CONTROL, name: str = "hetpipe-taylor") -> None:
        self.name = name
        self.variance_control = checked_variance_control(variance_control)
        self.instructions = HetPipeSchedule.instructions | {CompensateGradient}


TAYLORPIPE = register_schedule(TaylorPipeSchedule())
HETPIPE_TAYLOR = register_schedule(HetPipeTaylorSchedule())
