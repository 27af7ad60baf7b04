"""A subclassed Keras model (``class MyModel(keras.Model)`` with a ``call`` of its own) traced into a
layer-call graph that the stage rewrite cuts (HetPipe §4 cuts a model's layers into stages).

Keras 3 records a graph when layers and ``keras.ops`` run on symbolic tensors: each call on a
``KerasTensor`` adds a node to its outputs' history. The model's ``call`` is run on symbolic inputs
(``keras.Input``), so its layer calls become the graph's nodes (a ``for`` loop over a list of blocks
unrolls into the blocks' calls) and every ``keras.ops`` call becomes a node of its own; a Sequential
or functional model called inside (a keras_hub backbone) is one node the rewrite flattens. The
result is a functional model over the user's own layers: nothing is copied, so the trained weights
land in the user's model object. ``training`` is left to the run: each layer gets it as Keras's
``fit`` and ``evaluate`` pass it.

A user's own ``Layer`` subclass called inside stays one node, unless its name is given in
``open_layers``: its ``call`` is then traced the same way.

The inputs' spec, in this order: the ``input_spec`` argument of :func:`trace_model`; under
``HetPipeStrategy``'s ``fit``, the data's element spec (:func:`trace_for_data`); the shape the model
was built with (float inputs). An unbuilt model with none of them is refused.

Refused (:class:`UntraceableModelError`), each naming the model's class, the line of ``call`` and the
fix: Python branching on a tensor's value or on ``training``; TensorFlow ops that do not go through
Keras; state kept on ``self`` between calls; ``add_loss`` inside ``call``; layers made inside
``call``; weights the model (or an opened layer) makes itself and uses outside a layer. A model that
traces into one node (its ``call`` calls one layer kept whole) stays one stage, with a warning.
"""
import contextlib
import inspect
import sys
import warnings
import weakref
from types import FrameType, TracebackType
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import tree

from hetpipe_tf import compat
from hetpipe_tf.errors import HetPipeUsageError

#: What an inputs' spec may be: a ``keras.Input``, a ``tf.TensorSpec`` (with its batch dimension),
#: a shape without the batch dimension (float inputs), or a dict, list or tuple of them.
InputSpec = keras.KerasTensor | tf.TensorSpec | tuple | list | dict

#: The trace of each model traced so far (:func:`trace_model`), found again by the stage rewrite.
_TRACES: "weakref.WeakKeyDictionary[keras.Model, keras.Model]" = weakref.WeakKeyDictionary()

#: Why ``add_loss`` in ``call`` is refused, and the fix.
_ADD_LOSS = ("call adds a loss (add_loss): a traced graph's stages do not carry it; give the layers a regularizer, "
             "or add the term to the loss given to compile")

#: Attributes Keras itself sets on a layer while it runs.
_KERAS_SET = frozenset({"built"})


class UntraceableModelError(HetPipeUsageError, ValueError):
    """A subclassed model whose ``call`` cannot be traced into a layer graph."""


def is_subclassed(model: keras.Model) -> bool:
    """Whether `model` runs a ``call`` of its own (neither Sequential nor functional)."""
    owner = next(c for c in type(model).__mro__ if "call" in vars(c))
    return owner not in (keras.Sequential, compat.Functional)


def traced(model: keras.Model) -> keras.Model:
    """The functional trace of subclassed `model`: the one :func:`trace_model` made, else a trace
    on the shape the model was built with.

    Returns:
        The functional model.
    """
    if model not in _TRACES:
        trace_model(model)
    return _TRACES[model]


def trace_for_data(model: keras.Model, element_spec: tuple) -> None:
    """Traces `model`, if it is subclassed and not traced yet, on the inputs of data whose element
    spec is `element_spec` ((inputs, labels), as ``fit`` takes them)."""
    if is_subclassed(model) and model not in _TRACES:
        trace_model(model, input_spec=element_spec[0])


def trace_model(model: keras.Model, input_spec: InputSpec | None = None,
                open_layers: Sequence[str] = ()) -> keras.Model:
    """Traces subclassed `model`'s ``call`` into a functional model over its own layers, keeps it for
    the stage rewrite (which then cuts `model` as that graph) and returns it.

    Args:
      model: a ``keras.Model`` subclass whose ``call`` is made of layer calls and ``keras.ops``.
      input_spec: the inputs (see :data:`InputSpec`); None: the shape `model` was built with.
      open_layers: names of the user's own ``Layer`` subclasses inside `model` whose ``call`` is
        traced too (each otherwise stays one node).

    Returns:
      The functional model over `model`'s own layers.

    Raises:
      UntraceableModelError: `model` is not subclassed, or its ``call`` cannot be traced into a
        layer graph; the message names the class, the line of ``call`` and what to do.
    """
    if not is_subclassed(model):
        raise UntraceableModelError(
            f"model '{model.name}' ({type(model).__name__}) is a Sequential or functional model: it has a layer "
            f"graph already; give it to the rewrite as it is, without trace_model")
    opened = _layers_to_open(model, open_layers)
    owners = [model, *opened]
    _refuse_own_weights(model, owners)
    before = {id(layer) for layer in compat.sublayers(model)}
    attributes = {id(o): _public_attributes(o) for o in owners}
    losses = {id(o): len(compat.own_losses(o)) for o in owners}
    runs = _runs(model, input_spec, opened, owners)
    _refuse_state(model, owners, attributes, losses)
    _refuse_new_layers(model, runs[0][1], before)
    graphs = [keras.Model(inputs, outputs, name=model.name) for inputs, outputs in runs]
    _refuse_training_branches(model, graphs)
    _refuse_unreached(model, graphs[0])
    calls = [op for op in graphs[0].operations if not isinstance(op, keras.layers.InputLayer)]
    if len(calls) == 1 and _is_one_piece(calls[0]):
        warnings.warn(f"model '{model.name}' ({type(model).__name__}) traces into one layer call: it stays one stage; "
                      f"name its own Layer subclass in open_layers to cut inside it", stacklevel=2)
    model.built = True
    _TRACES[model] = graphs[0]
    return graphs[0]


def _runs(model: keras.Model, input_spec: InputSpec | None, opened: list[keras.layers.Layer],
          owners: list[keras.layers.Layer]) -> list[tuple]:
    """(inputs, outputs) of `model`'s call run on symbolic inputs: with training=True, then False
    (a call that takes `training`), or once.

    Returns:
        The pairs.
    """
    runs = []
    for kwargs in ({"training": True}, {"training": False}) if _takes_training(model) else ({},):
        inputs = _symbolic_inputs(model, input_spec)
        with _opened(opened), _named_line(model, owners):
            runs.append((inputs, model.call(inputs, **kwargs)))
    return runs


def _takes_training(model: keras.Model) -> bool:
    return "training" in inspect.signature(model.call).parameters


def _layers_to_open(model: keras.Model, names: Sequence[str]) -> list[keras.layers.Layer]:
    """The layers of `model` named in `names`, each a user's own Layer subclass."""
    layers = {layer.name: layer for layer in compat.sublayers(model)}
    own = sorted(name for name, layer in layers.items() if _is_own(layer))
    unknown = [n for n in names if n not in own]
    if unknown:
        raise UntraceableModelError(
            f"open_layers={list(names)!r}: {unknown} name no Layer subclass of model '{model.name}' "
            f"({type(model).__name__}) with a call of its own; it has {own or 'none'}")
    return [layers[n] for n in names]


def _is_own(layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s class is the user's (not one of Keras's or keras_hub's), with a call of its own."""
    return not type(layer).__module__.startswith(("keras.", "keras_hub.")) and _is_one_piece(layer)


def _is_one_piece(op: keras.Operation) -> bool:
    """Whether the stage rewrite keeps `op` whole: all but a Sequential or functional model, which it
    cuts inside.

    Returns:
        Whether it stays one node.
    """
    return not isinstance(op, keras.Model) or is_subclassed(op)


def _refuse_own_weights(model: keras.Model, owners: list[keras.layers.Layer]) -> None:
    for owner in owners:
        own = compat.own_variables(owner)
        if own:
            raise UntraceableModelError(
                f"model '{model.name}' ({type(model).__name__}): {type(owner).__name__} '{owner.name}' makes weights "
                f"of its own ({', '.join(v.path for v in own)}) and its call uses them outside any layer, which a "
                f"stage could not hold; make them a layer's (a Layer subclass whose call uses them, kept whole)")


def _public_attributes(owner: keras.layers.Layer) -> dict[str, int]:
    return {k: id(v) for k, v in vars(owner).items() if not k.startswith("_") and k not in _KERAS_SET}


def _refuse_state(model: keras.Model, owners: list[keras.layers.Layer], attributes: dict[int, dict[str, int]],
                  losses: dict[int, int]) -> None:
    for owner in owners:
        now = _public_attributes(owner)
        changed = sorted(k for k in now if attributes[id(owner)].get(k) != now[k])
        if changed:
            raise UntraceableModelError(_refusal(
                model, owner, f"self.{changed[0]}", f"call sets self.{changed[0]}: state kept on the model between "
                f"calls is not part of a traced graph; compute it inside call, or keep it in a layer's weights"))
        if len(compat.own_losses(owner)) != losses[id(owner)]:
            del compat.own_losses(owner)[losses[id(owner)]:]
            raise UntraceableModelError(_refusal(
                model, owner, "add_loss", _ADD_LOSS))


def _refuse_training_branches(model: keras.Model, graphs: list[keras.Model]) -> None:
    """Refuses a call whose layer calls under training=True (graphs[0]) and False differ."""
    calls = [[id(op) if isinstance(op, keras.layers.Layer) else type(op).__name__  # keras.ops: new each run
              for op in g.operations if not isinstance(op, keras.layers.InputLayer)] for g in graphs]
    if any(c != calls[0] for c in calls[1:]):
        raise UntraceableModelError(_refusal(
            model, model, "if training", "call branches in Python on `training`: a traced graph runs the same layers "
            "in training and inference; give training to the layers (Dropout, BatchNormalization) instead"))


def _refuse_new_layers(model: keras.Model, outputs: keras.KerasTensor | list | dict, before: set[int]) -> None:
    made = [op for op in _operations(outputs) if isinstance(op, keras.layers.Layer)
            and not isinstance(op, keras.layers.InputLayer) and id(op) not in before]
    if made:
        layer = made[0]
        raise UntraceableModelError(_refusal(
            model, model, f"{type(layer).__name__}(", f"call makes layer '{layer.name}' ({type(layer).__name__}) each "
            f"time it runs: its weights would be new at every call; make it in __init__ and call it in call"))


def _operations(outputs: keras.KerasTensor | list | dict) -> list[keras.Operation]:
    """The operations whose calls made `outputs` (symbolic tensors), from the outputs back."""
    seen, found, stack = set(), [], list(tree.flatten(outputs))
    while stack:
        history = compat.keras_history(stack.pop())
        node = compat.producing_node(history)
        if id(node) not in seen:
            seen.add(id(node))
            found.append(history.operation)
            stack.extend(node.input_tensors)
    return found


def _refuse_unreached(model: keras.Model, graph: keras.Model) -> None:
    reached = {id(v) for v in graph.weights}
    unreached = [layer for layer in compat.sublayers(model, recursive=False)
                 if layer.weights and not any(id(v) in reached for v in layer.weights)]
    if unreached:
        layer = unreached[0]
        raise UntraceableModelError(_refusal(
            model, model, f"self.{_attribute_of(model, layer)}", f"the traced graph does not reach layer "
            f"'{layer.name}' ({type(layer).__name__}) and its weights: a layer called on a constant (not computed "
            f"from call's inputs) ran once while tracing and its result became a constant; compute its input from "
            f"call's inputs (e.g. positions from keras.ops.cumsum(keras.ops.ones_like(ids), axis=1) - 1), or remove "
            f"the layer if call never uses it"))


def _attribute_of(model: keras.Model, layer: keras.layers.Layer) -> str:
    """The attribute of `model` holding `layer` (or a list holding it); its name if none."""
    for key, value in vars(model).items():
        if key.startswith("_"):
            continue
        if value is layer or (isinstance(value, (list, tuple)) and any(v is layer for v in value)):
            return key
    return layer.name


def _refusal(model: keras.Model, owner: keras.layers.Layer, needle: str, what: str) -> str:
    """The message of a refusal found after the trace: the first line of `owner`'s call holding `needle`."""
    lines, first = inspect.getsourcelines(type(owner).call)
    hits = [(first + i, text.strip()) for i, text in enumerate(lines) if needle in text]
    where = f"line {hits[0][0]} of {type(owner).__name__}.call: `{hits[0][1]}`" if hits else \
        f"{type(owner).__name__}.call"
    return f"model '{model.name}' ({type(model).__name__}) cannot be traced into stages: {where}: {what}"


def _symbolic_inputs(model: keras.Model, spec: InputSpec | None) -> keras.KerasTensor | list | dict:
    """``keras.Input``s for `spec`, or for the shape `model` was built with."""
    if spec is None:
        shapes = compat.build_shapes(model)
        if not model.built or not shapes:
            raise UntraceableModelError(
                f"model '{model.name}' ({type(model).__name__}) is subclassed and not built, and no input spec was "
                f"given: call it once on a batch, or call model.build(input_shape), or give "
                f"trace_model(model, input_spec=keras.Input(shape, dtype=...)) (under HetPipeStrategy, fit takes "
                f"the spec from the data)")
        if len(shapes) != 1:
            raise UntraceableModelError(
                f"model '{model.name}' ({type(model).__name__}) was built on several arguments {sorted(shapes)}: give "
                f"trace_model(model, input_spec=...) with one spec per input")
        spec = next(iter(shapes.values()))
        return tree.map_shape_structure(lambda s: keras.Input(batch_shape=(None,) + tuple(s[1:])), spec)
    return _inputs_of(spec, "input")


def _inputs_of(spec: InputSpec, name: str) -> keras.KerasTensor | list | dict:
    """``keras.Input``s for `spec`, each named `name` (a dict's by its keys)."""
    if isinstance(spec, keras.KerasTensor):
        return keras.Input(batch_shape=(None,) + tuple(spec.shape[1:]), dtype=spec.dtype, name=name)
    if isinstance(spec, tf.TensorSpec):
        return keras.Input(batch_shape=(None,) + tuple(spec.shape[1:]), dtype=spec.dtype.name, name=name)
    if isinstance(spec, dict):
        return {k: _inputs_of(v, k) for k, v in spec.items()}
    if isinstance(spec, (tuple, list)) and all(isinstance(d, int) or d is None for d in spec):
        return keras.Input(shape=tuple(spec), name=name)
    if isinstance(spec, (tuple, list)):
        return [_inputs_of(s, f"{name}_{i}") for i, s in enumerate(spec)]
    raise UntraceableModelError(
        f"input_spec={spec!r}: give a keras.Input, a tf.TensorSpec, a shape without the batch dimension, or a "
        f"dict, list or tuple of them")


@contextlib.contextmanager
def _opened(layers: list[keras.layers.Layer]) -> Iterator[None]:
    """While it lasts, calling one of `layers` runs its ``call`` (its layer calls are recorded)."""
    classes = [type(layer) for layer in layers]
    for layer, cls in zip(layers, classes):
        object.__setattr__(layer, "__class__", type(cls.__name__, (cls,), {"__call__": _open_call(cls)}))
    try:
        yield
    finally:
        for layer, cls in zip(layers, classes):
            object.__setattr__(layer, "__class__", cls)


def _open_call(cls: type) -> Callable:
    def call(self: keras.layers.Layer, *args: Any, **kwargs: Any) -> Any:
        if not self.built:
            cls.__call__(self, *args, **kwargs)  # builds the layer (its own weights, its layers)
        return cls.call(self, *args, **kwargs)
    return call


@contextlib.contextmanager
def _named_line(model: keras.Model, owners: list[keras.layers.Layer]) -> Iterator[None]:
    """An error while tracing becomes an :class:`UntraceableModelError` naming the line of a traced
    ``call`` it came from and what to do.

    Yields:
        Nothing; the block runs inside.

    Raises:
        UntraceableModelError: the block raised.
    """
    try:
        yield
    except UntraceableModelError:
        raise
    except Exception as error:
        codes = {type(o).call.__code__: type(o).__name__ for o in owners}
        frames = [(f, n) for f, n in _frames(sys.exc_info()[2]) if f.f_code in codes]
        where = "its call"
        if frames:
            frame, line = frames[-1]
            text = inspect.getframeinfo(frame).code_context
            where = f"line {line} of {codes[frame.f_code]}.call: `{text[0].strip() if text else ''}`"
        raise UntraceableModelError(
            f"model '{model.name}' ({type(model).__name__}) cannot be traced into stages: {where}: {_why(error)} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from error


def _frames(tb: TracebackType | None) -> Iterator[tuple[FrameType, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _why(error: Exception) -> str:
    """What a tracing error means and its fix."""
    text = str(error)
    if "symbolic" in text and ("bool" in text or "NumPy" in text or "numerical value" in text):
        return ("call branches in Python on a tensor's value, which a traced graph does not have; compute both "
                "sides with keras.ops.where or keras.ops.cond")
    if "KerasTensor" in text and ("TF API" in text or "TensorFlow" in text or "tf." in text):
        return "call runs a TensorFlow op that does not go through Keras; use the keras.ops equivalent"
    if "add_loss" in text:
        return _ADD_LOSS
    if "add_metric" in text:
        return "call adds a metric (add_metric); give the metric to compile instead"
    return "this part of call does not run on symbolic tensors; use layers and keras.ops only"
