"""Uneven minibatches: each virtual worker's minibatch size by its predicted throughput.

Pure Python. Beyond the paper (HetPipe §3 gives every virtual worker the same minibatch
size, so under WSP the fast ones wait for the stragglers, §8.4); Whale, Cannikin and
Poplar size minibatches by device speed for plain data parallelism. The rule here:

* **sizes** (:func:`proportional_sizes`): a global batch of B samples per round (one
  minibatch of every worker) is split as b_i ∝ r_i, worker i's predicted images/s when it
  trains alone at the even size; each b_i is at most worker i's memory cap, and what a
  capped worker cannot take goes to the others in proportion (water filling); the shares
  are rounded by largest remainder so that Σ b_i = B exactly. Every worker gets at least
  one sample, or the plan fails with an error that says why.
* **memory** (:func:`memory_cap`, :func:`check_sizes`): the partitioner's per-stage
  memory check (§7) at the new size, on the worker's own cut and Nm. Only the activations
  a stage holds grow with the minibatch size (:func:`hetpipe_tf.planning.profile.static_profile`
  counts them per example times the batch size), so a stage fits b samples iff
  ``fixed + activations × b / b_profile <= capacity``, exactly.
* **times** (:func:`at_batch_size`): a profile at another batch size keeps each task's
  fixed overhead and scales the per-segment compute, FLOPs and activation traffic in
  proportion (the measured or roofline times' batch-linear part: an approximation, the
  one the prediction of an uneven plan uses).

The parameter servers then weight every push by its worker's share of the samples
(:func:`push_weights`), so that the global update stays an unbiased average.
"""
import math
from collections.abc import Sequence

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.planning.partitioner import Partition
from hetpipe_tf.planning.profile import Profile, SegmentTimes


class UnevenMinibatchError(HetPipeUsageError, ValueError):
    """Minibatch sizes that cannot be given: a worker's share does not fit, or is zero."""


def at_batch_size(profile: Profile, batch_size: int) -> Profile:
    """`profile` at `batch_size` samples per minibatch (see the module docstring: activation and
    cut bytes exactly, compute times, FLOPs and traffic in proportion, task overheads kept).

    Returns:
        The scaled profile.

    Raises:
        UnevenMinibatchError: `batch_size` is not an integer >= 1.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UnevenMinibatchError(f"a minibatch size must be an integer >= 1, got {batch_size!r}")
    r = batch_size / profile.batch_size

    def scaled(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(v * r for v in values)

    times = {k: SegmentTimes(scaled(t.forward), scaled(t.backward), t.forward_overhead, t.backward_overhead,
                             f"{t.source}; scaled from batch {profile.batch_size} to {batch_size}")
             for k, t in profile.times.items()}
    traffic = tuple(max(t - w, 0) * r + w for t, w in zip(profile.traffic_bytes, profile.weight_bytes))
    return Profile(**{**{k: getattr(profile, k) for k in profile.__dataclass_fields__},
                      "batch_size": batch_size, "activation_bytes": scaled(profile.activation_bytes),
                      "cut_bytes": scaled(profile.cut_bytes), "forward_flops": scaled(profile.forward_flops),
                      "backward_flops": scaled(profile.backward_flops), "traffic_bytes": traffic, "times": times})


def memory_cap(partition: Partition, batch_size: int) -> int | None:
    """The largest minibatch size every stage of `partition` (a Partition costed at
    `batch_size`) holds in its memory, with its cut and Nm.

    Returns:
        That size, or None when no stage's memory grows with it.
    """
    caps: list[int] = []
    for st in partition.stages:
        held = st.memory.get("activations", 0)
        if held:
            fixed = st.memory_total - held
            caps.append(math.floor((st.capacity - fixed) * batch_size / held))
    return min(caps) if caps else None


def check_sizes(sizes: Sequence[int], caps: Sequence[int | None], workers: Sequence[str] | None = None) -> None:
    """Checks that every size is an integer >= 1 within its worker's memory cap.

    Args:
        sizes: each worker's minibatch size.
        caps: :func:`memory_cap` of each worker.
        workers: their names, for the message (None: "virtual worker i").

    Raises:
        UnevenMinibatchError: a size is not one per worker, not an integer >= 1, or over its cap.
    """
    names = workers or [f"virtual worker {i}" for i in range(len(caps))]
    if len(sizes) != len(caps):
        raise UnevenMinibatchError(f"{len(sizes)} minibatch sizes {list(sizes)} for {len(caps)} virtual workers: "
                                   f"give one per worker")
    for name, b, cap in zip(names, sizes, caps):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise UnevenMinibatchError(f"{name} was given minibatch size {b!r}: every worker needs an integer "
                                       f">= 1 (a worker with no samples pushes nothing; leave it out of the "
                                       f"cluster instead)")
        if cap is not None and b > cap:
            raise UnevenMinibatchError(f"{name} was given minibatch size {b}, but its stages' memory holds at "
                                       f"most {cap} samples (with its cut and Nm): give it at most {cap}, or "
                                       f"lower Nm")


def proportional_sizes(rates: Sequence[float], total: int, caps: Sequence[int | None] | None = None
                       ) -> tuple[int, ...]:
    """Integer sizes summing to `total`, proportional to `rates` (each worker's predicted
    images/s), each within its cap (None: no cap). A capped worker gets its cap and the rest
    is shared by the others in proportion, again and again; then largest-remainder rounding.

    Args:
        rates: each worker's predicted images/s (> 0).
        total: the global batch, the sum of the sizes.
        caps: each worker's largest size (None: no cap for any).

    Returns:
        Each worker's minibatch size.

    Raises:
        UnevenMinibatchError: a rate is not positive, `total` gives some worker nothing, the caps
            hold fewer than `total` samples, or a worker's share rounds to zero.
    """
    n = len(rates)
    limits: list[int | None] = list(caps) if caps is not None else [None] * n
    if n == 0 or any(r <= 0 for r in rates):
        raise UnevenMinibatchError(f"uneven minibatches need a positive predicted throughput for every worker, "
                                   f"got {list(rates)}")
    if not isinstance(total, int) or total < n:
        raise UnevenMinibatchError(f"a global batch of {total!r} samples cannot give each of {n} virtual workers "
                                   f"at least one: give a batch of at least {n}")
    room: list[float] = [math.inf if c is None else c for c in limits]
    if sum(room) < total:
        raise UnevenMinibatchError(f"the virtual workers' memory holds at most {limits} samples per minibatch, "
                                   f"{sum(room)} together, fewer than the global batch of {total}: give a smaller "
                                   f"batch or lower Nm")
    share, free = [0.0] * n, set(range(n))
    left = float(total)
    while free:  # water filling: cap whoever would exceed its room, share the rest again
        weight = sum(rates[i] for i in free)
        over = {i for i in free if left * rates[i] / weight > room[i]}
        if not over:
            for i in free:
                share[i] = left * rates[i] / weight
            break
        for i in over:
            share[i] = room[i]
            left -= room[i]
        free -= over
    sizes = [math.floor(s) for s in share]
    order = sorted(range(n), key=lambda i: (-(share[i] - sizes[i]), -rates[i]))
    for i in order:
        if sum(sizes) == total:
            break
        if sizes[i] < room[i]:
            sizes[i] += 1
    zero = [i for i in range(n) if sizes[i] == 0]
    if zero:
        raise UnevenMinibatchError(
            f"virtual worker(s) {zero} would get no sample of the global batch of {total} (predicted images/s "
            f"{[round(r, 3) for r in rates]}): give a larger batch, or leave uneven minibatches off")
    return tuple(sizes)


def push_weights(sizes: Sequence[int]) -> tuple[float, ...]:
    """The weight of each worker's pushes: n · b_i / B for n workers of sizes b_i, B = Σ b_j.

    The servers apply w += Σ_i weight_i · u_i, where u_i is worker i's summed local updates
    (each from the gradient of its mean loss over its b_i samples). With D = 0 and Nm = 1 and
    SGD at learning rate η, u_i = -η ∇L_i, so the global step is -η n Σ_i (b_i / B) ∇L_i =
    -η n ∇L, L the mean loss over all B samples of the round: SGD on the concatenated batch
    at learning rate n·η, which is what the servers do with even sizes (every weight 1, the
    paper's unweighted sum of pushes, §5).

    Args:
        sizes: each worker's minibatch size b_i.

    Returns:
        Each worker's push weight.
    """
    total = sum(sizes)
    return tuple(len(sizes) * b / total for b in sizes)
