"""What a stage holds per minibatch between its compiled calls (HetPipe §4: up to Nm minibatches
in flight): what a minibatch brings (inputs, labels, the next stage's gradient message, the
update terms), what a call left for a later one (a split pass's record, weight gradients, the
running sum of microbatch gradients) and what it sends (activations, gradients, logs)."""
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

#: The compiled tasks' outputs a stage keeps per minibatch, by output kind (see :meth:`MinibatchSlots.keep`).
KEPT_BY_MINIBATCH = frozenset({"sent", "logs", "record", "input_grads", "tied", "terms", "applied_terms",
                               "weight_grads"})

#: What a slot holds: a tensor or a nest of tensors (and verdicts, norms, scales).
SlotValue = Any

#: A verdict not read back yet: (verdict, the minibatches of its update, the last one's logs or None).
Unchecked = tuple[tf.Tensor, tuple[int, ...], dict[str, tf.Tensor] | None]


def _in_order(entering: dict[int, tf.Tensor]) -> list[tf.Tensor]:
    """The tensors a pass enters with, from {position: tensor}, in position order."""
    return [entering[i] for i in range(len(entering))]


class MinibatchSlots:
    """The per-minibatch slots of one stage, keyed by minibatch id. `unchecked` holds the
    verdicts of updates not yet read back: (verdict, the minibatches of the update, the last
    one's logs when this stage made them)."""

    def __init__(self, num_received: int, tied_sources: Sequence[int]) -> None:
        self.num_received = num_received
        self.tied_sources = tuple(tied_sources)
        self.entering = {}  # p -> {position: tensor}
        self.labels = {}
        self.out_grads = {}  # p -> (gradient of each float tensor sent, verdict, ...) from the next stage
        self.record = {}  # p -> (weights, entering, labels, record) of a split forward pass
        self.kept = {}  # p -> (entering, labels) of a forward pass to recompute
        self.sent = {}  # p -> tensors for the next stage
        self.weight_grads = {}  # p -> (weight gradients, verdict) not applied in their backward's call
        self.input_grads = {}  # p -> (gradient of each float tensor received, verdict, squared norm, S_p)
        self.tied = {}  # p -> this stage's tied replicas' gradients, for the first stage
        self.tied_in = {}  # p -> {stage: its tied replicas' gradients} (first stage)
        self.terms = {}  # p -> the update terms (made here, or taken from the first stage)
        self.logs = {}  # p -> loss and metrics, tensors (last stage)
        #: When recording provenance: minibatch -> (the global clip's factor, the loss scale S_p) its update took.
        self.applied_terms = {}
        self.accumulated = None  # GPipe: (gradient sum, verdict) since the last flush
        self.summed: list[int] = []  # the microbatches in that sum
        self.unchecked: list[Unchecked] = []

    def set_received(self, p: int, tensors: Sequence[tf.Tensor]) -> None:
        self.entering.setdefault(p, {}).update(enumerate(tensors))

    def set_loaded(self, p: int, tensors: Sequence[tf.Tensor]) -> None:
        self.entering.setdefault(p, {}).update((self.num_received + i, t) for i, t in enumerate(tensors))

    def entering_of(self, p: int) -> list[tf.Tensor]:
        """What minibatch p's pass enters with so far, in order (not taken)."""
        return _in_order(self.entering[p])

    def take(self, kind: str, p: int) -> SlotValue:
        """The input `kind` of minibatch p for a compiled task (see
        :class:`hetpipe_tf.runtime.stage.lowering.CompiledTask`), taken out of its slot."""
        if kind == "entering":
            return _in_order(self.entering.pop(p))
        if kind == "tied_in":
            given = self.tied_in.pop(p)
            return [given[t] for t in self.tied_sources]
        if kind == "acc":
            return self.accumulated
        return getattr(self, kind).pop(p)  # labels, out_grads, record, kept, weight_grads, terms

    def keep(self, kind: str, p: int, value: SlotValue, flush: bool) -> None:
        """Keeps output `kind` of minibatch p of a compiled task; `flush`: whether p's update was
        the flush of the accumulated microbatches."""
        if kind in KEPT_BY_MINIBATCH:
            getattr(self, kind)[p] = value
        elif kind == "acc":
            self.accumulated = value
        elif kind == "verdict":
            minibatches = tuple(self.summed) if flush else (p,)
            if flush:
                self.accumulated, self.summed = None, []
            self.unchecked.append((value, minibatches, self.logs.get(minibatches[-1])))

    def take_unchecked(self) -> list[Unchecked]:
        """The verdicts not read back yet, which are then none."""
        unchecked, self.unchecked = self.unchecked, []
        return unchecked

    def clear(self) -> None:
        """Drops what every minibatch left (the provenance's applied terms stay)."""
        for pending in (self.entering, self.labels, self.out_grads, self.record, self.sent, self.weight_grads,
                        self.input_grads, self.kept, self.unchecked, self.summed, self.logs, self.tied, self.tied_in,
                        self.terms):
            pending.clear()
        self.accumulated = None
