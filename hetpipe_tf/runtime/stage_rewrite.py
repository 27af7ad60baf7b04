"""Rewriting a Keras model into k pipeline stages (HetPipe §2.3, §4).

The model's layer calls, in topological order, are cut into k contiguous ranges.
Each range becomes a Keras sub-model over the same layers (built from the
original graph's tensors, so no layer is copied or re-initialised), with the
tensors that enter the stage as inputs and the tensors later stages need as
outputs. A stage computes with whatever weight values it is given
(``stateless_call``), which is how a minibatch uses its stashed weight version.

Handled:

* skip connections across stages: the tensor is forwarded through the stages in
  between (see :mod:`hetpipe_tf.planning.model_graph`), and its gradient flows back the
  same way, summed with the gradient of any use inside those stages;
* several inputs and outputs: a model input goes from the host to the first
  stage that uses it; model outputs made early are forwarded to the last stage,
  which computes the loss;
* BatchNormalization and other layers with non-trainable state: the new state
  comes back from the stage's forward pass and is kept in that stage;
* Dropout and other ``training``-dependent layers: their random state is stage
  state too, and the backward pass reuses the forward pass's masks (the tape
  holds them);
* layers with no weights (each is one node);
* Sequential and functional models used as layers, at any depth (a keras_hub task
  around its backbone, a backbone called as a layer, a ``keras.applications`` feature
  extractor, a model of models): they are flattened into their layer calls, which are
  the nested model's own layers, so the trained weights land in the nested model too.
  A subclassed model or layer (a class with a ``call()`` of its own) inside is one node;
* a subclassed model (``class MyModel(keras.Model)``) itself: its ``call`` is traced into a
  layer graph over its own layers (:mod:`hetpipe_tf.runtime.subclass_trace`);
* a layer called in several stages (tied weights): each of those stages holds a
  replica, and :attr:`StagedModel.tied` says which stages hold which replica of which
  model variable (the runtime sums the replicas' gradients:
  :mod:`hetpipe_tf.runtime.update_terms`).
"""
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from hetpipe_tf import compat
from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.planning.model_graph import LayerNode, ModelGraph, PartitionError, StageIO, TensorInfo
from hetpipe_tf.planning.partitioner import balanced_boundaries
from hetpipe_tf.runtime.subclass_trace import is_subclassed, traced
from hetpipe_tf.runtime.update_terms import summed


class UnsupportedModelError(HetPipeUsageError, TypeError):
    """A model that has no layer graph to cut (a functional model not made from its inputs and outputs)."""


def _top_graph(model: keras.Model) -> keras.Model:
    """The functional graph of a Sequential or functional model (a Sequential's own), or of a
    subclassed model its trace (:mod:`hetpipe_tf.runtime.subclass_trace`).

    Returns:
        The functional model.

    Raises:
        UnsupportedModelError: the model has no graph to cut (not built, or no layer graph).
    """
    if isinstance(model, keras.Sequential):
        fn = compat.sequential_graph(model)
        if fn is None:
            raise UnsupportedModelError(
                f"Sequential model '{model.name}' is not built: start it with keras.Input(shape) "
                f"or call model.build(input_shape) before cutting it into stages")
        return fn
    if is_subclassed(model):
        return traced(model)
    if not compat.has_nodes_by_depth(model) or not getattr(model, "inputs", None):
        raise UnsupportedModelError(
            f"model '{model.name}' ({type(model).__name__}) has no layer graph to cut: a functional model "
            f"is cut once made from its inputs and outputs (keras.Model(inputs, outputs))")
    return model


def _graph_of(op: keras.Operation) -> keras.Model | None:
    """The functional graph that `op`, a model used as a layer, runs when called; None for a layer
    to keep whole. A Sequential or functional model (a keras_hub task or backbone, a
    ``keras.applications`` model) runs its graph; a model whose class has a ``call()`` of its own
    (subclassed) and every other layer are atomic.

    Returns:
        The functional model, or None.
    """
    if not isinstance(op, keras.Model):
        return None
    owner = next(c for c in type(op).__mro__ if "call" in vars(c))
    if owner is keras.Sequential:
        return compat.sequential_graph(op)
    return op if owner is compat.Functional else None


def _entered(fn: keras.Model, inputs: Any, names: dict[int, str], prefix: str, context: Mapping[str, Any]) -> Any:
    """``fn``'s graph run symbolically on `inputs` (KerasTensors) with every nested graph model
    entered: its layers are called on the tensors of the enclosing graph, at any depth. This is
    ``Functional.call`` of Keras 3.15.1 (the call-context arguments, ``training``, given to a
    model reach every operation inside it), so the flattened graph computes what the nested one
    does. The layers are the model's own: their weights are shared, nothing is copied. `names`
    gets each operation's name qualified by the models that hold it ("backbone/dense").

    Returns:
        The outputs of the run.
    """

    def operation_fn(op: keras.Operation) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            for name, value in context.items():
                if name in compat.call_context_args(op) and value is not None:
                    kwargs[name] = value
            names.setdefault(id(op), prefix + op.name)
            inner = _graph_of(op)
            return op(*args, **kwargs) if inner is None else _enter_model(inner, names, names[id(op)] + "/",
                                                                           *args, **kwargs)
        return call

    return compat.run_through_graph(fn, inputs, operation_fn)


def _enter_model(fn: keras.Model, names: dict[int, str], prefix: str, inputs: Any, training: bool | None = None,
                 mask: Any = None, **kwargs: Any) -> Any:
    """A nested model's call (``Functional.call``'s arguments), entered (:func:`_entered`)."""
    inputs = [_unconverted(x) for x in compat.standardize_inputs(fn, inputs)]
    for x, m in zip(inputs, tree.flatten(mask) if mask is not None else ()):
        if m is not None:
            compat.set_keras_mask(x, m)
    return _entered(fn, inputs, names, prefix, dict(kwargs, training=training))


def _unconverted(x: keras.KerasTensor) -> keras.KerasTensor:
    """`x`, or the tensor it converts when the conversion changes nothing: a model converts its
    inputs to its inputs' dtypes (``ops.convert_to_tensor``), which is no operation for a tensor
    that has them already.

    Returns:
        That tensor.
    """
    history = compat.keras_history(x)
    if isinstance(history.operation, compat.ConvertToTensor):
        source = compat.producing_node(history).input_tensors[0]
        if (source.dtype, source.sparse, source.ragged) == (x.dtype, x.sparse, x.ragged):
            return source
    return x


def _layer_graph(model: keras.Model) -> tuple[keras.Model, dict[int, str]]:
    """(functional graph, {id(operation): qualified name}) of `model`, with every nested
    Sequential or functional model flattened into its layer calls (the model's own graph when it
    nests none).

    Returns:
        The pair.
    """
    fn = _top_graph(model)
    if not any(_graph_of(op) is not None for op in fn.operations):
        return fn, {id(op): op.name for op in fn.operations}
    names: dict[int, str] = {}
    outputs = _entered(fn, fn.inputs, names, "", {})
    flat = keras.Model(inputs=compat.inputs_struct(fn), outputs=outputs, name=fn.name)
    flat.output_names = list(fn.output_names)  # the loss and metrics are keyed by the model's
    return flat, names


def variable_bytes(variables: Iterable[keras.Variable]) -> int:
    """The bytes that `variables` hold (each element's size from its dtype)."""
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))


def _elements(shape: Sequence[int | None]) -> int:
    return int(np.prod([d if d is not None else 1 for d in shape[1:]]))


@dataclass(frozen=True)
class KerasGraph:
    """A :class:`ModelGraph` with the Keras objects behind its indices."""
    graph: ModelGraph
    model: keras.Model  # the functional model the graph was read from, nested models flattened
    tensors: tuple[keras.KerasTensor, ...]  # KerasTensor of every tensor index
    operations: tuple[keras.Operation, ...]  # layer (operation) of every node index


def describe_model(model: keras.Model) -> KerasGraph:
    """The :class:`KerasGraph` of a Sequential or functional Keras model (a subclassed model's
    trace), with the Sequential and functional models used as layers inside it flattened into their
    layer calls.

    Args:
        model: the Keras model (Sequential, functional or subclassed).

    Returns:
        The KerasGraph: the layer graph as plain data and the functional model it came from.

    Raises:
        UnsupportedModelError: the model has no graph to cut (not built, or no layer graph).
        UntraceableModelError: a subclassed model's call cannot be traced.
    """
    fn, names = _layer_graph(model)
    by_depth = compat.nodes_by_depth(fn)
    depths = sorted(by_depth, reverse=True)
    op_order = {id(op): i for i, op in enumerate(fn.operations)}
    ordered = []
    for d in depths:
        ordered += sorted(by_depth[d], key=lambda n: op_order.get(id(n.operation), 0))

    tensor_ids, keras_tensors, producers = {}, [], []

    def tensor_index(kt: keras.KerasTensor, producer: int | None) -> int:
        if id(kt) not in tensor_ids:
            tensor_ids[id(kt)] = len(keras_tensors)
            keras_tensors.append(kt)
            producers.append(producer)
        return tensor_ids[id(kt)]

    for kt in fn.inputs:
        tensor_index(kt, None)
    raw_nodes, operations = [], []
    for node in ordered:
        op = node.operation
        if isinstance(op, keras.layers.InputLayer):
            continue
        index = len(raw_nodes)
        inputs = tuple(tensor_ids[id(t)] for t in node.input_tensors)
        outputs = tuple(tensor_index(t, index) for t in node.output_tensors)
        raw_nodes.append((node, op, inputs, outputs))
        operations.append(op)

    consumers = {i: [] for i in range(len(keras_tensors))}
    for index, (_, _, inputs, _) in enumerate(raw_nodes):
        for t in set(inputs):
            consumers[t].append(index)
    input_pos = {tensor_ids[id(t)]: i for i, t in enumerate(fn.inputs)}
    output_pos = {tensor_ids[id(t)]: i for i, t in enumerate(fn.outputs)}
    tensors = tuple(
        TensorInfo(index=i, name=kt.name, shape=tuple(kt.shape[1:]),
                   itemsize=np.dtype(kt.dtype).itemsize, producer=producers[i],
                   consumers=tuple(sorted(consumers[i])), model_input=input_pos.get(i),
                   model_output=output_pos.get(i))
        for i, kt in enumerate(keras_tensors))

    nodes = []
    for index, (node, op, inputs, outputs) in enumerate(raw_nodes):
        trainable = getattr(op, "trainable_weights", [])
        params = int(sum(np.prod(v.shape) for v in trainable))
        out_elems = sum(_elements(keras_tensors[t].shape) for t in outputs)
        last_dim = keras_tensors[outputs[0]].shape[-1] or 1
        flops = int(2 * params * max(out_elems // max(last_dim, 1), 1) + out_elems)
        nodes.append(LayerNode(
            index=index, layer=names[id(op)], kind=type(op).__name__, inputs=inputs, outputs=outputs,
            trainable_bytes=variable_bytes(trainable),
            non_trainable_bytes=variable_bytes(getattr(op, "non_trainable_weights", [])),
            flops_per_example=flops))
    graph = ModelGraph(name=model.name, nodes=tuple(nodes), tensors=tensors,
                       inputs=tuple(tensor_ids[id(t)] for t in fn.inputs),
                       outputs=tuple(tensor_ids[id(t)] for t in fn.outputs))
    return KerasGraph(graph=graph, model=fn, tensors=tuple(keras_tensors), operations=tuple(operations))


def _one_or_list(values: Sequence[Any]) -> Any:
    return values[0] if len(values) == 1 else list(values)


class Stage:
    """One stage: a Keras sub-model over a range of layer calls, and how it talks to its neighbours.

    ``call(trainable, non_trainable, entering, training)`` runs the stage with the
    given weight values on the tensors in ``io.entering`` order and returns the
    tensors in ``io.sent`` order, the new non-trainable state, and the stage's
    regularisation loss.
    """

    def __init__(self, index: int, io: StageIO, model: keras.Model, device: str | None = None) -> None:
        self.index = index
        self.io = io
        self.model = model
        self.device = device
        self._consumed_pos = [io.entering.index(t) for t in io.consumed]
        produced = {t: i for i, t in enumerate(io.produced)}
        entering = {t: i for i, t in enumerate(io.entering)}
        # Where each sent tensor comes from: ("made", i) or ("entered", i).
        self._sent_from = tuple(("made", produced[t]) if t in produced else ("entered", entering[t])
                                for t in io.sent)
        self._functions = {}

    @property
    def trainable_variables(self) -> list[keras.Variable]:
        """The stage sub-model's trainable variables (the Keras model's own, shared)."""
        return self.model.trainable_variables

    @property
    def non_trainable_variables(self) -> list[keras.Variable]:
        """The stage sub-model's non-trainable variables (its state)."""
        return self.model.non_trainable_variables

    def stateless_call(self, trainable: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor],
                       entering: Sequence[tf.Tensor],
                       training: bool) -> tuple[list[tf.Tensor], list[tf.Tensor], tf.Tensor]:
        """The stage on given weight values and state: (sent tensors, new state, regularisation loss)."""
        inputs = [entering[i] for i in self._consumed_pos]
        outputs, new_state, losses = self.model.stateless_call(
            list(trainable), list(non_trainable), _one_or_list(inputs), training=training,
            return_losses=True)
        outputs = [outputs] if len(self.io.produced) == 1 else list(outputs)
        sent = [outputs[i] if where == "made" else tf.identity(entering[i])
                for where, i in self._sent_from]
        return sent, list(new_state), summed(losses)  # float64 weights' regularisers: float64

    def call(self, trainable: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor], entering: Sequence[tf.Tensor],
             training: bool = True) -> Any:
        """:meth:`stateless_call` as a compiled function, one per value of `training`."""
        fn = self._functions.get(training)
        if fn is None:
            # A partial per stage: TensorFlow keys its retracing warning on a function's code.
            fn = FirstCallLocked(tf.function(functools.partial(self.stateless_call, training=training)))
            self._functions[training] = fn
        return fn(list(trainable), list(non_trainable), list(entering))


@dataclass(frozen=True)
class TiedVariable:
    """A model variable that several stages hold a replica of: a variable of a layer called in
    each of them (see :mod:`hetpipe_tf.planning.model_graph`). ``replicas`` gives, per stage, the
    variable's position among that stage's trainable (or, if not ``trainable``, non-trainable)
    variables. Training keeps the trainable replicas equal by summing their gradients of a
    minibatch before any of them applies (Megatron's embedding group); a non-trainable replica
    is updated by its own stage's calls only."""
    path: str  # the model variable's path
    trainable: bool
    replicas: tuple[tuple[int, int], ...]  # (stage, position), in stage order


def _tied_variables(stages: Sequence[Stage]) -> tuple[TiedVariable, ...]:
    """The :class:`TiedVariable` of every variable that more than one of `stages` holds."""
    held: dict[int, tuple[str, bool, list[tuple[int, int]]]] = {}
    for stage in stages:
        for trainable, variables in ((True, stage.trainable_variables), (False, stage.non_trainable_variables)):
            for position, v in enumerate(variables):
                held.setdefault(id(v), (v.path, trainable, []))[2].append((stage.index, position))
    return tuple(TiedVariable(path=path, trainable=trainable, replicas=tuple(replicas))
                 for path, trainable, replicas in held.values() if len(replicas) > 1)


@dataclass(frozen=True)
class StagedModel:
    """A Keras model cut into stages, as :func:`split_model` makes it.

    Args:
        model: the Keras model that was cut.
        keras_graph: its layer graph (a subclassed model's: its trace), as :func:`describe_model`
            gives it.
        boundaries: the index of each stage's first layer call (topological order), from 0.
        stages: the stage sub-models, in order.
        tied: the variables several stages hold a replica of.
    """
    model: keras.Model
    keras_graph: KerasGraph
    boundaries: tuple[int, ...]
    stages: tuple[Stage, ...]
    tied: tuple[TiedVariable, ...]

    @property
    def graph(self) -> ModelGraph:
        """The cut model's layer graph (a :class:`hetpipe_tf.planning.model_graph.ModelGraph`)."""
        return self.keras_graph.graph

    @property
    def num_stages(self) -> int:
        """k, the number of stages."""
        return len(self.stages)

    def input_stages(self) -> tuple[int, ...]:
        """Stages that load model inputs from the host."""
        return tuple(s.index for s in self.stages if s.io.loaded)

    def split_inputs(self, x: Any) -> dict[int, list[tf.Tensor]]:
        """Model inputs `x` (tensor, list/tuple in model order, or dict by input name) by stage."""
        fn = self.keras_graph.model
        if isinstance(x, dict):
            names = [t.name for t in fn.inputs]
            missing = [n for n in names if n not in x]
            if missing:
                raise KeyError(f"inputs {missing} missing from the minibatch; it has {sorted(x)}")
            flat = [x[n] for n in names]
        elif isinstance(x, (list, tuple)):
            flat = list(x)
        else:
            flat = [x]
        if len(flat) != len(fn.inputs):
            raise ValueError(f"the model has {len(fn.inputs)} inputs but the minibatch gives {len(flat)}")
        by_tensor = dict(zip(self.graph.inputs, (tf.convert_to_tensor(v) for v in flat)))
        return {s.index: [by_tensor[t] for t in s.io.loaded] for s in self.stages if s.io.loaded}

    def describe(self) -> str:
        """One line per stage: its device, its layer calls and the tensors it sends."""
        lines = []
        for s in self.stages:
            names = [self.graph.nodes[i].layer for i in s.io.nodes]
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            lines.append(f"stage {s.index} on {s.device}: layer calls {s.io.nodes.start}..{s.io.nodes.stop - 1} "
                         f"({span}), sends {len(s.io.sent)} tensor(s)")
        return "\n".join(lines)


def _sub_model(inputs: Sequence[keras.KerasTensor], outputs: Sequence[keras.KerasTensor], name: str) -> keras.Model:
    """The Keras model from `inputs` to `outputs`, tensors of a model's graph.

    Keras 3.15's own way (``keras.Model`` on intermediate tensors, ``clone_graph_nodes``) maps
    the layer that produced an intermediate input to the new input by the layer, not by its
    call, so a later call of the same layer inside the stage (a tied layer whose first call ends
    the stage before) would become an input too. The graph between is cloned here instead, a new
    ``keras.Input`` standing for each intermediate input's call only; the history of each of the
    model's own inputs, which the clone of its input layer's call points at the clone, is put
    back (the model could no longer be saved otherwise).

    Returns:
        The sub-model.
    """
    histories = [compat.keras_history(t) for t in inputs]
    mapping, replaced, cloned_inputs = {}, {}, []
    for t in inputs:
        if compat.is_input_keras_tensor(t):
            clone = t
        else:
            clone = keras.Input(batch_shape=t.shape, dtype=t.dtype, sparse=t.sparse, name=f"{t.name}CLONE")
            replaced[id(compat.producing_node(compat.keras_history(t)))] = compat.keras_history(clone).operation
        cloned_inputs.append(clone)
        mapping[id(t)] = clone
    cloned_outputs = []
    for t in outputs:
        clone = compat.clone_single_keras_tensor(t)
        compat.set_keras_history(clone, compat.keras_history(t))
        cloned_outputs.append(clone)
        mapping[id(t)] = clone
    for node in compat.find_nodes_by_inputs_and_outputs(inputs, outputs):
        operation = replaced.get(id(node), node.operation)
        produced = compat.clone_keras_tensors(node.output_tensors, mapping)
        if operation is node.operation:
            compat.Node(operation, call_args=compat.clone_keras_tensors(node.arguments.args, mapping),
                        call_kwargs=compat.clone_keras_tensors(node.arguments.kwargs, mapping), outputs=produced)
        else:
            compat.Node(operation, call_args=(), call_kwargs={}, outputs=produced)
    model = keras.Model(inputs=_one_or_list(cloned_inputs), outputs=_one_or_list(cloned_outputs), name=name)
    for t, history in zip(inputs, histories):
        compat.set_keras_history(t, history)
    return model


def split_model(model: keras.Model, boundaries: Sequence[int] | None = None, num_stages: int | None = None,
                devices: Sequence[str | None] | None = None, speeds: Sequence[float] | None = None) -> StagedModel:
    """Cuts a Keras model into stages.

    Args:
      model: a Sequential or functional Keras model, built, or a subclassed one, cut as its trace
        (:func:`hetpipe_tf.runtime.subclass_trace.trace_model`). Sequential and functional models
        used as layers inside it are cut inside (:func:`describe_model`).
      boundaries: index of each stage's first layer call (topological order), starting at 0.
      num_stages: instead of `boundaries`, the number of stages; the cut then balances
        a static FLOP estimate (divided by `speeds`), exactly, over the cuts that keep every
        layer's calls in one stage when there are enough such cuts, else over all cuts.
      devices: the TensorFlow device of each stage (default: none).
      speeds: relative device speeds used with `num_stages`.
    Returns:
      A :class:`StagedModel`.

    Raises:
      PartitionError: the boundaries do not describe a cut into the stages asked, or the devices are
        not one per stage.
      UnsupportedModelError: the model has no graph to cut (not built, or no layer graph).
    """
    kg = describe_model(model)
    graph = kg.graph
    if boundaries is None:
        if num_stages is None:
            num_stages = len(devices) if devices else 1
        cuts = graph.allowed_cuts()
        if len(cuts) < num_stages - 1:
            cuts = None  # any cut: a layer called in several stages is replicated
        boundaries = balanced_boundaries([n.flops_per_example for n in graph.nodes], num_stages,
                                         allowed_cuts=cuts, speeds=speeds)
    elif num_stages is not None and len(boundaries) != num_stages:
        raise PartitionError(f"{len(boundaries)} stage boundaries {list(boundaries)} given for {num_stages} stages: "
                             f"give one per stage (each stage's first layer call, starting at 0)")
    boundaries = graph.check_boundaries(boundaries)
    ios = graph.stage_io(boundaries)
    if devices is not None and len(devices) != len(ios):
        raise PartitionError(f"{len(ios)} stages but {len(devices)} devices were given: give one device per stage")
    stages = []
    for io in ios:
        sub = _sub_model([kg.tensors[t] for t in io.consumed], [kg.tensors[t] for t in io.produced],
                         name=f"{model.name}_stage{io.stage}")
        stages.append(Stage(io.stage, io, sub, devices[io.stage] if devices else None))
    return StagedModel(model=model, keras_graph=kg, boundaries=boundaries, stages=tuple(stages),
                       tied=_tied_variables(stages))
