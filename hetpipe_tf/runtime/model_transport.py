"""A Keras model sent from the chief to a virtual worker's process (HetPipe §3: a worker's process
builds its own copy of the model and trains its stages).

A Sequential or functional model travels as ``model.to_json()``. A subclassed model (its class is
the user's, often defined in the user's script, and has no ``get_config``) cannot be rebuilt from
its own JSON in another process; its trace travels instead
(:mod:`hetpipe_tf.runtime.subclass_trace`): the functional model of its layer calls, whose layers are
Keras's, keras_hub's or the user's own serializable ones. The worker rebuilds that functional model
and gives its variables the paths and the order of the user's model's, so that the weights the chief
sends (``model.get_weights()``) and the parameter servers' variables (keyed by path) are the same on
both sides.

A layer class a worker could not rebuild is refused on the chief, before any process starts.
"""
import json

import keras

from hetpipe_tf import compat
from hetpipe_tf.errors import HetPipeUsageError

from hetpipe_tf.runtime.subclass_trace import is_subclassed, traced

#: The format of a packed trace (anything else is a model's own JSON).
_TRACE_FORMAT = "hetpipe-trace-1"


class UnsendableModelError(HetPipeUsageError, ValueError):
    """A model whose layers a worker process could not rebuild."""


def pack_model(model: keras.Model) -> str:
    """What a worker process rebuilds `model` from (:func:`unpack_model`): a Sequential or functional
    model's JSON, or a subclassed model's trace with its variables' paths and order.

    Returns:
        The packed model, picklable.

    Raises:
        UnsendableModelError: a layer class of the model cannot be rebuilt in another process.
    """
    if not is_subclassed(model):
        return str(model.to_json())
    graph = traced(model)
    _refuse_unimportable(model, graph)
    text = graph.to_json()
    try:
        rebuilt = keras.models.model_from_json(text)
    except Exception as error:  # a layer whose config does not rebuild it
        raise UnsendableModelError(
            f"model '{model.name}' ({type(model).__name__}) cannot be sent to the worker processes: its traced "
            f"graph does not rebuild from its JSON ({type(error).__name__}: {str(error).splitlines()[0]}); give each "
            f"layer class of your own a get_config that rebuilds it and register it with "
            f"@keras.saving.register_keras_serializable(), or use launch=\"in_process\"") from error
    position = {id(v): i for i, v in enumerate(graph.weights)}
    order = [position[id(v)] for v in model.weights]
    layers = _order_of_layers(model, rebuilt, order)
    return json.dumps({"format": _TRACE_FORMAT, "graph": text, "paths": [v.path for v in model.weights],
                       "order": order, "layers": layers})


def unpack_model(text: str) -> keras.Model:
    """The model :func:`pack_model` packed: for a subclassed model, its traced graph with the user's
    model's variable paths and order (``set_weights`` takes the user's model's ``get_weights``).

    Returns:
        The rebuilt Keras model.
    """
    packed = json.loads(text)
    if not isinstance(packed, dict) or packed.get("format") != _TRACE_FORMAT:
        return keras.models.model_from_json(text)
    model = keras.models.model_from_json(packed["graph"])
    traced_order = model.weights
    for index, path in zip(packed["order"], packed["paths"]):
        compat.set_variable_path(traced_order[index], path)
    layers = compat.model_layers(model)
    compat.set_model_layers(model, [layers[i] for i in packed["layers"]])  # the weights follow the layers' order
    return model


def _order_of_layers(model: keras.Model, rebuilt: keras.Model, order: list[int]) -> list[int]:
    """The permutation of `rebuilt`'s layers under which its weights come in `model`'s order (each
    user's weight i is the traced graph's weight order[i]); refused if there is none.

    Returns:
        The permutation.

    Raises:
        UnsendableModelError: there is none.
    """
    layers = compat.model_layers(rebuilt)
    owner = [i for i, layer in enumerate(layers) for _ in layer.weights]
    permutation = list(dict.fromkeys(owner[i] for i in order))
    permutation += [i for i in range(len(layers)) if i not in permutation]
    weights = [w for i in permutation for w in layers[i].weights]
    position = {id(w): i for i, w in enumerate(rebuilt.weights)}
    if [position[id(w)] for w in weights] != order:
        raise UnsendableModelError(
            f"model '{model.name}' ({type(model).__name__}) cannot be sent to the worker processes: the order of "
            f"its weights interleaves its layers' weights, which the traced graph cannot give; use "
            f"launch=\"in_process\"")
    return permutation


def _refuse_unimportable(model: keras.Model, graph: keras.Model) -> None:
    """Refuses a layer class of `graph` that a worker process could not import and find."""
    for layer in graph.layers:
        cls = type(layer)
        if cls.__module__.startswith(("keras.", "keras_hub.")):
            continue
        registered = keras.saving.get_registered_object(keras.saving.get_registered_name(cls)) is cls
        if cls.__module__ == "__main__" or not registered:
            where = "defined in the script that runs (__main__), which a worker process does not run" \
                if cls.__module__ == "__main__" else f"from module {cls.__module__}, not registered"
            raise UnsendableModelError(
                f"model '{model.name}' ({type(model).__name__}) cannot be sent to the worker processes: layer "
                f"'{layer.name}' is of class {cls.__name__}, {where}; register it as serializable "
                f"(@keras.saving.register_keras_serializable() and a get_config that rebuilds it), make its module "
                f"importable by the workers (not the script itself), or use launch=\"in_process\"")
