"""A model as plain data: its layer calls in topological order and the tensors between them.

Pure Python (no TensorFlow), so that partitioning, cost models and schedules can
be computed and tested without a device. :func:`hetpipe_tf.runtime.stage_rewrite.describe_model`
builds a :class:`ModelGraph` from a Keras model.

A *stage* is a contiguous range of nodes in topological order (HetPipe §4, §7:
"divide multiple layers of the model into k partitions"). ``boundaries`` are the
index of each stage's first node, so ``(0, 5, 9)`` makes stages [0, 5), [5, 9),
[9, n).

Tensors that cross stages are forwarded through the stages in between: a skip
connection from stage 0 to stage 2 is received by stage 1 and sent on unchanged.
Every stage then talks only to its neighbours, the schedule stays a chain, and
each cut carries exactly the tensors alive across it (what the cost model of §7
charges for that cut). Model inputs come from the host straight to the first
stage that consumes them; labels go straight to the last stage.

A model used as a layer inside another (a backbone in a task, a feature extractor, a
model of models) is not a node: its layer calls are, at any depth, each named after
the models that hold it ("backbone/dense"). A layer called in several stages (tied
weights, such as an input embedding used again for the output logits) is
*replicated*: each of those stages holds a copy of its weights and counts them in its
memory; the copies stay equal when their gradients of a minibatch are summed before
any of them applies (Megatron's embedding group).
"""
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hetpipe_tf.errors import HetPipeUsageError


class PartitionError(HetPipeUsageError, ValueError):
    """Stage boundaries that do not describe a valid cut of the model."""


class SharedLayerError(PartitionError):
    """A layer whose calls fall into different stages where its weights may not be replicated."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the model graph; sizes are per example (no batch dimension)."""
    index: int
    name: str
    shape: tuple[int | None, ...]  # per-example shape; None for unknown dimensions
    itemsize: int  # bytes per element
    producer: int | None  # node index, or None for a model input
    consumers: tuple[int, ...]  # node indices, ascending
    model_input: int | None = None  # position among the model's inputs
    model_output: int | None = None  # position among the model's outputs

    @property
    def bytes_per_example(self) -> int:
        """The tensor's bytes for one example (its shape without the batch dimension)."""
        n = 1
        for d in self.shape:
            n *= d if d is not None else 1
        return n * self.itemsize


@dataclass(frozen=True)
class LayerNode:
    """One call of a layer. A shared layer has several nodes with the same `layer`."""
    index: int
    layer: str  # the layer's name, after the names of the nested models that hold it ("backbone/dense")
    kind: str  # the layer's class name
    inputs: tuple[int, ...]  # tensor indices
    outputs: tuple[int, ...]  # tensor indices
    trainable_bytes: int
    non_trainable_bytes: int
    flops_per_example: int  # a static estimate: 2 x multiply-adds, or elements touched


@dataclass(frozen=True)
class StageIO:
    """Which tensors a stage receives, loads, consumes, produces and sends (by index)."""
    stage: int
    nodes: range
    received: tuple[int, ...]  # from the previous stage, in tensor order
    loaded: tuple[int, ...]  # model inputs first consumed here, from the host
    consumed: tuple[int, ...]  # inputs of this stage's nodes produced elsewhere
    produced: tuple[int, ...]  # outputs of this stage's nodes needed by later stages or the loss
    sent: tuple[int, ...]  # to the next stage (produced + passed through); for the last stage, the model outputs

    @property
    def entering(self) -> tuple[int, ...]:
        """Everything the stage starts a minibatch with: received, then loaded."""
        return self.received + self.loaded


@dataclass(frozen=True)
class ModelGraph:
    """Layer calls in topological order and the tensors between them.

    Args:
        name: the model's name.
        nodes: the layer calls, in topological order.
        tensors: the tensors between them (a node names its inputs and outputs by index here).
        inputs: the indices of the model's input tensors, in the model's order.
        outputs: the indices of the model's output tensors, in the model's order.
    """
    name: str
    nodes: tuple[LayerNode, ...]
    tensors: tuple[TensorInfo, ...]
    inputs: tuple[int, ...]  # tensor indices of the model inputs, in model order
    outputs: tuple[int, ...]  # tensor indices of the model outputs, in model order

    @property
    def num_nodes(self) -> int:
        """The number of layer calls."""
        return len(self.nodes)

    def at_sequence_length(self, length: int) -> "ModelGraph":
        """This graph with every unknown dimension of a per-example shape (a transformer's
        sequence: Keras gives it as None) set to `length`, so that bytes count every position.
        A layer's static FLOP estimate is per element of its outputs (2 x multiply-adds per
        output position), so it grows as they do.

        Returns:
            The graph.

        Raises:
            ValueError: `length` is not an integer >= 1.
        """
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"a sequence length is an integer >= 1, got {length!r}")

        def bound(shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
            return tuple(length if d is None else d for d in shape)

        tensors = tuple(replace(t, shape=bound(t.shape)) for t in self.tensors)
        nodes: list[LayerNode] = []
        for node in self.nodes:
            before = sum(self.tensors[t].bytes_per_example for t in node.outputs)
            after = sum(tensors[t].bytes_per_example for t in node.outputs)
            nodes.append(replace(node, flops_per_example=node.flops_per_example * after // before if before else
                                 node.flops_per_example))
        return replace(self, nodes=tuple(nodes), tensors=tensors)

    def check_boundaries(self, boundaries: Sequence[int]) -> tuple[int, ...]:
        """Returns `boundaries` as a tuple after checking it is a valid cut.

        Valid: starts at 0, strictly increasing, and every stage has at least one node. A
        layer may have calls in several stages (:meth:`shared_across`): each of them holds a
        replica of its weights.

        Raises:
            PartitionError: it is not a valid cut.
        """
        b = tuple(int(x) for x in boundaries)
        n = self.num_nodes
        if not b or b[0] != 0:
            raise PartitionError(f"stage boundaries must start with 0 (the first node), got {list(b)}")
        if any(b2 <= b1 for b1, b2 in zip(b, b[1:])) or b[-1] >= n:
            raise PartitionError(
                f"stage boundaries {list(b)} must be strictly increasing node indices below "
                f"{n} (the model has {n} layer calls), so that every stage gets at least one")
        return b

    def shared_across(self, boundaries: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """{layer: the stages it is called in} for every layer called in more than one stage
        (tied weights, such as an input embedding used again for the output logits): each of
        those stages holds a replica of the layer's weights.

        Returns:
            The mapping.
        """
        stage_of = self.stage_of_nodes(self.check_boundaries(boundaries))
        by_layer: dict[str, set[int]] = {}
        for node in self.nodes:
            by_layer.setdefault(node.layer, set()).add(stage_of[node.index])
        return {layer: tuple(sorted(stages)) for layer, stages in by_layer.items() if len(stages) > 1}

    def allowed_cuts(self) -> tuple[int, ...]:
        """Node indices a stage may start at without replicating a layer: every cut that keeps
        each layer's calls in one stage.

        Returns:
            The node indices.
        """
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for node in self.nodes:
            first.setdefault(node.layer, node.index)
            last[node.layer] = node.index
        return tuple(c for c in range(1, self.num_nodes)
                     if not any(first[l] < c <= last[l] for l in first))

    def stage_of_nodes(self, boundaries: Sequence[int]) -> tuple[int, ...]:
        """A tuple giving the stage of every node."""
        stage_of: list[int] = []
        s = 0
        for i in range(self.num_nodes):
            while s + 1 < len(boundaries) and i >= boundaries[s + 1]:
                s += 1
            stage_of.append(s)
        return tuple(stage_of)

    def live_across(self, cut: int) -> tuple[int, ...]:
        """Tensors alive across the cut before node `cut`: made before it, needed at or after it.

        Model inputs are not counted: they come from the host to the stage that first
        needs them. Model outputs are needed by the loss, after the last node.

        Returns:
            The tensor indices.
        """
        live: list[int] = []
        for t in self.tensors:
            if t.producer is None or t.producer >= cut:
                continue
            if t.model_output is not None or (t.consumers and t.consumers[-1] >= cut):
                live.append(t.index)
        return tuple(live)

    def _forwarded_inputs_across(self, cut: int) -> tuple[int, ...]:
        """Model inputs first consumed before `cut` but still needed at or after it."""
        return tuple(t.index for t in self.tensors
                     if t.producer is None and t.consumers and t.consumers[0] < cut
                     and (t.consumers[-1] >= cut or t.model_output is not None))

    def crossing(self, cut: int) -> tuple[int, ...]:
        """Every tensor sent across the cut before node `cut`, in tensor order."""
        return tuple(sorted(self.live_across(cut) + self._forwarded_inputs_across(cut)))

    def stage_io(self, boundaries: Sequence[int]) -> tuple[StageIO, ...]:
        """The :class:`StageIO` of every stage for `boundaries`."""
        b = self.check_boundaries(boundaries)
        ends = b[1:] + (self.num_nodes,)
        result: list[StageIO] = []
        received: tuple[int, ...] = ()
        for s, (lo, hi) in enumerate(zip(b, ends)):
            loaded = tuple(t.index for t in self.tensors if t.producer is None and (
                (t.consumers and lo <= t.consumers[0] < hi)
                or (not t.consumers and t.model_output is not None and hi == self.num_nodes)))
            inside: set[int] = set()
            consumed: list[int] = []
            for node in self.nodes[lo:hi]:
                for t in node.inputs:
                    if t not in inside and t not in consumed:
                        consumed.append(t)
                inside.update(node.outputs)
            last = hi == self.num_nodes
            sent = self.outputs if last else self.crossing(hi)
            produced = tuple(t for t in sorted(inside) if t in set(sent))
            result.append(StageIO(stage=s, nodes=range(lo, hi), received=received, loaded=loaded,
                                  consumed=tuple(sorted(consumed)), produced=produced,
                                  sent=tuple(sent)))
            received = tuple(sent)
        return tuple(result)

    def stage_activation_bytes(self, boundaries: Sequence[int], batch_size: int) -> tuple[int, ...]:
        """Per stage: bytes one minibatch keeps alive there until its backward pass.

        Counted as the tensors the stage starts with plus every output of its nodes
        (what the forward pass records for the backward pass), at `batch_size`.

        Returns:
            The bytes of each stage.
        """
        per_stage: list[int] = []
        for io in self.stage_io(boundaries):
            made = {t for node in self.nodes[io.nodes.start:io.nodes.stop] for t in node.outputs}
            total = sum(self.tensors[t].bytes_per_example for t in set(io.entering) | made)
            per_stage.append(total * batch_size)
        return tuple(per_stage)

    def stage_weight_bytes(self, boundaries: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Per stage: (trainable, non-trainable) weight bytes; a layer called in several stages
        counts in each of them (its replicas).

        Returns:
            The pairs, one per stage.
        """
        b = self.check_boundaries(boundaries)
        ends = b[1:] + (self.num_nodes,)
        out: list[tuple[int, int]] = []
        for lo, hi in zip(b, ends):
            seen: set[str] = set()
            tr, ntr = 0, 0
            for node in self.nodes[lo:hi]:
                if node.layer in seen:
                    continue
                seen.add(node.layer)
                tr += node.trainable_bytes
                ntr += node.non_trainable_bytes
            out.append((tr, ntr))
        return tuple(out)
