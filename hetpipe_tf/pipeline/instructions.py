"""The instruction vocabulary of pipeline schedules.

A schedule gives every stage a program of small immutable instructions that
print like calls: ``Forward(3)``, ``SendActivation(3, to=2)``. The executor maps
each instruction type to one method of a stage and rejects any type it does not
know; the simulator gives each one a duration. Neither decides the order: the
program does.

Each instruction declares the keys it ``requires`` at its own stage before its
task may start (a message that must have arrived, a weight version that must be
stashed) and the keys it ``provides`` when it is done, and to which stage. A
task is ready when every key it requires from outside itself is there; its
*ready time* is when the last of them arrived. The executor and the simulator
derive readiness from these keys alone.
"""
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import overload

ACTIVATION = "activation"
GRADIENT = "gradient"
INPUTS = "inputs"
LABELS = "labels"
WEIGHTS = "weights"
SLOT = "activation slot"
UPDATE_TERMS = "update terms"
TIED_GRADIENTS = "tied gradients"
#: The destination of what a stage sends to the parameter servers.
PARAMETER_SERVER = "ps"

#: A key a task requires or provides: (kind, minibatch or wave), or (kind, minibatch, stage)
#: for a stage's tied gradients.
Key = tuple[str, int] | tuple[str, int, int]
#: Where an instruction provides a key: a stage, or :data:`PARAMETER_SERVER`.
Destination = int | str
#: A key made present at a destination.
Delivery = tuple[Destination, Key]


@dataclass(frozen=True, repr=False)
class Instruction:
    """One step of a stage's program, about one minibatch."""
    minibatch: int

    def requires(self) -> tuple[Key, ...]:
        """Keys that must be present at this stage before the task starts."""
        return ()

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        """(stage, key) pairs this instruction makes present when it is done."""
        return ()

    def applies(self) -> tuple[int, ...]:
        """The minibatches whose updates this instruction puts into the stage's live weights."""
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.minibatch})"


@dataclass(frozen=True, repr=False)
class LoadMinibatch(Instruction):
    """Takes minibatch p from the input pipeline; routes inputs and labels by minibatch id."""
    inputs_to: tuple[int, ...] = ()  # other stages that consume model inputs
    labels_to: int = 0  # the last stage, which computes the loss

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        return tuple((s, (INPUTS, self.minibatch)) for s in self.inputs_to) + (
            (self.labels_to, (LABELS, self.minibatch)),)


@dataclass(frozen=True, repr=False)
class RecvInputs(Instruction):
    """Takes the model inputs of minibatch p that this stage consumes first."""

    def requires(self) -> tuple[Key, ...]:
        return ((INPUTS, self.minibatch),)


@dataclass(frozen=True, repr=False)
class RecvLabels(Instruction):
    """Takes the labels of minibatch p (last stage): they are keyed by p, never by arrival order."""

    def requires(self) -> tuple[Key, ...]:
        return ((LABELS, self.minibatch),)


@dataclass(frozen=True, repr=False)
class RecvActivation(Instruction):
    """Takes minibatch p's activations from the previous stage."""

    def requires(self) -> tuple[Key, ...]:
        return ((ACTIVATION, self.minibatch),)


@dataclass(frozen=True, repr=False)
class Send(Instruction):
    """An instruction that hands what this stage made for minibatch p to other stages: it runs
    right after the instructions that made it (:mod:`hetpipe_tf.pipeline.executor`)."""


@dataclass(frozen=True, repr=False)
class SendActivation(Send):
    """Sends minibatch p's activations (and forwarded skip tensors) to the next stage."""
    to: int = field(default=0, kw_only=True)

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        return ((self.to, (ACTIVATION, self.minibatch)),)

    def __repr__(self) -> str:
        return f"SendActivation({self.minibatch}, to={self.to})"


@dataclass(frozen=True, repr=False)
class RecvGradient(Instruction):
    """Takes the gradient of minibatch p's sent tensors from the next stage."""

    def requires(self) -> tuple[Key, ...]:
        return ((GRADIENT, self.minibatch),)


@dataclass(frozen=True, repr=False)
class SendGradient(Send):
    """Sends the gradient of minibatch p's received tensors to the previous stage."""
    to: int = field(default=0, kw_only=True)

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        return ((self.to, (GRADIENT, self.minibatch)),)

    def __repr__(self) -> str:
        return f"SendGradient({self.minibatch}, to={self.to})"


@dataclass(frozen=True, repr=False)
class SendUpdateTerms(Send):
    """The first stage, the last to end minibatch p's backward pass (§4), sends the stages `to` the
    terms every stage's update of p takes: whether it applies at all (every stage's gradient
    finite), the factor of a clip by the norm of all the stages' gradients together, the loss
    scale after p, the sums of tied weights' replicas' gradients (:class:`hetpipe_tf.pipeline.schedule.WorkerUpdate`)."""
    to: tuple[int, ...] = field(default=(), kw_only=True)

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        return tuple((t, (UPDATE_TERMS, self.minibatch)) for t in self.to)

    def __repr__(self) -> str:
        return f"SendUpdateTerms({self.minibatch}, to={list(self.to)})"


@dataclass(frozen=True, repr=False)
class RecvUpdateTerms(Instruction):
    """Takes minibatch p's update terms from the first stage."""

    def requires(self) -> tuple[Key, ...]:
        return ((UPDATE_TERMS, self.minibatch),)


@dataclass(frozen=True, repr=False)
class SendTiedGradients(Send):
    """Sends the first stage the gradients of minibatch p of this stage's replicas of tied
    weights (a layer that several stages call), which it sums with its own for every replica."""
    to: int = field(default=0, kw_only=True)

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        return ((self.to, (TIED_GRADIENTS, self.minibatch, stage)),)

    def __repr__(self) -> str:
        return f"SendTiedGradients({self.minibatch}, to={self.to})"


@dataclass(frozen=True, repr=False)
class RecvTiedGradients(Instruction):
    """Takes the gradients of minibatch p of stage `source`'s tied replicas."""
    source: int = field(default=0, kw_only=True)

    def requires(self) -> tuple[Key, ...]:
        return ((TIED_GRADIENTS, self.minibatch, self.source),)

    def __repr__(self) -> str:
        return f"RecvTiedGradients({self.minibatch}, source={self.source})"


@dataclass(frozen=True, repr=False)
class Forward(Instruction):
    """Forward pass of minibatch p with weight version w_p; the last stage adds the loss.

    With a `window` w, the stage holds at most w minibatches' activations: Forward(p)
    also waits for Backward(p - w) on the same stage. `waits`: further keys it waits for,
    from the synchronisation scheme between virtual workers. With `live`, the pass uses the
    stage's live weights as they are, and no stashed version (GPipe, NaivePipe). With
    `recompute`, the stage keeps only the pass's inputs, not its activations:
    :class:`Recompute` rebuilds them before :class:`Backward`.
    """
    window: int = field(default=0, kw_only=True)
    waits: tuple[Key, ...] = field(default=(), kw_only=True)
    live: bool = field(default=False, kw_only=True)
    recompute: bool = field(default=False, kw_only=True)

    def requires(self) -> tuple[Key, ...]:
        keys: tuple[Key, ...] = () if self.live else ((WEIGHTS, self.minibatch),)
        if self.window and self.minibatch > self.window:
            keys += ((SLOT, self.minibatch),)
        return keys + tuple(self.waits)

    def __repr__(self) -> str:
        flags = "".join(f", {name}=True" for name in ("live", "recompute") if getattr(self, name))
        return f"Forward({self.minibatch}{flags})"


@dataclass(frozen=True, repr=False)
class Recompute(Instruction):
    """Runs minibatch p's forward pass on the stage again, from the inputs its
    ``Forward(p, recompute=True)`` kept, with the stage's live weights, and keeps its
    activations for Backward(p): GPipe's re-materialisation (HetPipe §2.3; the live weights
    are the forward pass's, no update comes in between) and NaivePipe's backward against the
    live weights, whatever updates came in between (TaylorPipe, §2). The stage's non-trainable
    state is not updated twice."""


@dataclass(frozen=True, repr=False)
class Backward(Instruction):
    """Backward pass of minibatch p against w_p, the version its forward pass used.

    With a `window` w, it frees the activation slot that Forward(p + w) waits for.
    """
    window: int = field(default=0, kw_only=True)

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        return ((stage, (SLOT, self.minibatch + self.window)),) if self.window else ()


@dataclass(frozen=True, repr=False)
class ApplyUpdate(Instruction):
    """Applies minibatch p's update to the stage's local weights: w_local += u_p (§4)."""

    def applies(self) -> tuple[int, ...]:
        return (self.minibatch,)


@dataclass(frozen=True, repr=False)
class CompensateGradient(Instruction):
    """TaylorPipe's delay compensation (TaylorPipe §3.2, Algorithm 1) of minibatch p's weight
    gradient g, computed against the version w_p its forward pass used (the local model W_t):
    g := g + λ·g⊙g⊙(W̄ − W_t), the first-order Taylor prediction of the gradient at the stage's
    live (master) weights W̄, with the Hessian approximated by λ·g⊙g. It runs after
    Backward(p) and before ReleaseWeights(p) drops W_t and ApplyUpdate(p) applies the result.
    `variance_control` is λ."""
    variance_control: float = field(default=2.0, kw_only=True)

    def __repr__(self) -> str:
        return f"CompensateGradient({self.minibatch}, variance_control={self.variance_control:g})"


@dataclass(frozen=True, repr=False)
class AccumulateGradient(Instruction):
    """Adds minibatch p's weight gradients to the stage's running sum; applies nothing (GPipe)."""


@dataclass(frozen=True, repr=False)
class ApplyAccumulated(Instruction):
    """GPipe's flush (HetPipe §2.3): one update from the mean of the accumulated gradients of
    microbatches `first`..p, w_local += u(mean); the sum starts again from zero."""
    first: int = field(default=1, kw_only=True)

    def applies(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.minibatch + 1))

    def __repr__(self) -> str:
        return f"ApplyAccumulated({self.minibatch}, first={self.first})"


@dataclass(frozen=True, repr=False)
class StashWeights(Instruction):
    """Stashes the local weights as w_p, the version minibatch p will use."""

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        return ((stage, (WEIGHTS, self.minibatch)),)


@dataclass(frozen=True, repr=False)
class ReleaseWeights(Instruction):
    """Drops w_p after minibatch p's backward pass."""


@dataclass(frozen=True, repr=False)
class SnapshotState(Instruction):
    """Records the stage's state right after update p: weights, optimizer slots, statistics."""


@dataclass(frozen=True)
class Task:
    """Instructions a stage runs back to back, once the task is ready (§4: a forward
    task, a backward task, or on the last stage forward and backward as one task)."""
    stage: int
    kind: str
    minibatch: int
    instructions: tuple[Instruction, ...]

    @cached_property
    def requires(self) -> tuple[Key, ...]:
        """Keys needed from outside the task, in instruction order."""
        provided: set[Key] = set()
        needed: list[Key] = []
        for ins in self.instructions:
            for key in ins.requires():
                if key not in provided and key not in needed:
                    needed.append(key)
            for dst, key in ins.provides(self.stage):
                if dst == self.stage:
                    provided.add(key)
        return tuple(needed)

    def __repr__(self) -> str:
        return f"[{' '.join(map(repr, self.instructions))}]"


class TaskStream(Sequence[Task]):
    """The tasks of one kind on one stage, for minibatches 1..count, made on demand."""

    def __init__(self, kind: str, count: int, make: Callable[[int], Task]) -> None:
        self.kind = kind
        self._count = count
        self._make = make
        self._last: tuple[int, Task] | None = None  # the task made last: a stream's head is asked for repeatedly

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> Task: ...

    @overload
    def __getitem__(self, i: slice) -> list[Task]: ...

    def __getitem__(self, i: int | slice) -> Task | list[Task]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if not -self._count <= i < self._count:
            raise IndexError(i)
        i %= self._count
        if self._last is None or self._last[0] != i:
            self._last = (i, self._make(i + 1))
        return self._last[1]

    def __repr__(self) -> str:
        return f"TaskStream({self.kind!r}, {self._count} tasks)"
