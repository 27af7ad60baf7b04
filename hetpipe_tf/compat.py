"""Every reach of hetpipe_tf into Keras's and TensorFlow's private parts, in one place.

Cutting a Keras model into stages, running a stage's gradient without Keras's trainer, and
sending a dataset to another process need things neither framework makes public: modules under
``keras.src`` and ``tensorflow.python``, and attributes whose names start with ``_``. Every such
import is made here (a missing one fails the import of this module with an error naming it),
every private attribute is named here with why it is needed, and :func:`missing` tries each on
small objects of the installed versions; ``tests/test_compat.py`` runs it. The other modules use
the names and accessors below and import no ``keras.src`` or ``tensorflow.python`` module
themselves (``tests/test_compat.py`` checks that too).

Each reach was checked on :data:`CHECKED_ON`. To add one: import it with :func:`_imported`, or
name the attribute with :func:`_attribute` (the kind of object that has it, and why) and give
:func:`missing` an object of that kind if it has none yet; then use it from its module.
"""
import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

#: The versions every reach below was checked on.
CHECKED_ON = "Keras 3.15, TensorFlow 2.21"


@dataclass(frozen=True)
class Reach:
    """One private part: `what` (a dotted import, or ``Kind._attribute``) and why it is needed."""

    what: str
    why: str


#: Every reach, in the order made.
REACHES: list[Reach] = []


def _versions() -> str:
    return f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def _imported(module: str, name: str, why: str) -> Any:
    """`module`.`name`, a private import, registered; an ImportError naming it when it is gone."""
    REACHES.append(Reach(f"{module}.{name}", why))
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _gone(f"{module}.{name}", why, e) from e


def _module(module: str, why: str) -> Any:
    """The private module `module`, registered; an ImportError naming it when it is gone."""
    REACHES.append(Reach(module, why))
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _gone(module, why, e) from e


def _gone(what: str, why: str, error: Exception) -> ImportError:
    return ImportError(f"hetpipe_tf needs {what} ({why}); the installed {_versions()} has no such thing "
                       f"(checked on {CHECKED_ON}): {error}")


def _attribute(kind: str, name: str, why: str) -> str:
    """`name`, a private attribute of objects of `kind`, registered for :func:`missing`."""
    REACHES.append(Reach(f"{kind}.{name}", why))
    return name


# Imports ---------------------------------------------------------------------------------------
Functional = _imported("keras.src.models.functional", "Functional",
                       "the class whose call() runs a layer graph: stage cutting enters nested models of it")
clone_keras_tensors = _imported("keras.src.models.functional", "clone_keras_tensors",
                                "a stage's sub-model clones the graph between its cuts")
clone_single_keras_tensor = _imported("keras.src.models.functional", "clone_single_keras_tensor",
                                      "a stage's sub-model clones the graph between its cuts")
find_nodes_by_inputs_and_outputs = _imported("keras.src.models.functional", "find_nodes_by_inputs_and_outputs",
                                             "the nodes between a stage's cuts")
is_input_keras_tensor = _imported("keras.src.models.functional", "is_input_keras_tensor",
                                  "a stage input that is the model's own input is kept, not cloned")
Node = _imported("keras.src.ops.node", "Node", "a stage's sub-model records the cloned layer calls")
ConvertToTensor = _imported("keras.src.ops.core", "ConvertToTensor",
                            "a nested model's input conversion that changes nothing is skipped")
set_keras_mask = _imported("keras.src.backend", "set_keras_mask",
                           "a nested model's input masks, as Functional.call sets them")
compute_output_spec = _imported("keras.src.backend", "compute_output_spec",
                                "the loss head's outputs, built symbolically as Keras's trainer builds them")
CompileLoss = _imported("keras.src.trainers.compile_utils", "CompileLoss",
                        "the loss head gives compile(loss=...) Keras's own meaning")
CompileMetrics = _imported("keras.src.trainers.compile_utils", "CompileMetrics",
                           "the loss head gives compile(metrics=...) Keras's own meaning")
concrete_function = _module("tensorflow.python.eager.polymorphic_function.concrete_function",
                            "a stage's forward and backward as one compiled function pair (runtime/compiled.py)")
FirstOrderTapeGradientFunctions = _imported(
    "tensorflow.python.eager.polymorphic_function.concrete_function", "_FirstOrderTapeGradientFunctions",
    "a stage's forward and backward as one compiled function pair (runtime/compiled.py)")
gen_resource_variable_ops = _imported("tensorflow.python.ops", "gen_resource_variable_ops",
                                      "reads and assigns a variable by handle, without Keras's tracking "
                                      "(runtime/fit_loop.py)")
eager_context = _imported("tensorflow.python.eager", "context",
                          "runs a stage's functions on the single-threaded executor (runtime/stage/runtime.py)")
pywrap_tfe = _imported("tensorflow.python", "pywrap_tfe",
                       "calls a stage's traced function with its flat tensors by the C call tf.function's own "
                       "call ends in, without its per-call Python (runtime/compiled.py)")
eager_core = _module("tensorflow.python.eager.core",
                     "turns a failed call's status into TensorFlow's exception, as tf.function's call does")
nested_structure_coder = _imported("tensorflow.python.saved_model", "nested_structure_coder",
                                   "a dataset's element spec sent to a worker process, as tf.data's service does")
struct_pb2 = _imported("tensorflow.core.protobuf", "struct_pb2", "the element spec's protocol buffer")
ClusterResolver = _imported("tensorflow.python.distribute.cluster_resolver.cluster_resolver", "ClusterResolver",
                            "the type of tf.distribute.cluster_resolver's resolvers")
expand_tasks_per_node = _imported("tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver",
                                  "expand_tasks_per_node", "reads Slurm's SLURM_STEP_TASKS_PER_NODE as its "
                                  "resolver does")
device_lib = _imported("tensorflow.python.client", "device_lib",
                       "the memory TensorFlow's allocator may use on each GPU (tf.config gives no such figure "
                       "before the GPU is in use)")

# Private attributes ------------------------------------------------------------------------------
_KERAS_HISTORY = _attribute("KerasTensor", "_keras_history",
                            "which layer call made a symbolic tensor: the graph a stage is cut from")
_INBOUND_NODES = _attribute("Operation", "_inbound_nodes", "the calls of a layer, to follow the graph back")
_CALL_CONTEXT_ARGS = _attribute("Operation", "_call_context_args",
                                "the arguments (training) a nested model passes to each of its layers")
_NODES_BY_DEPTH = _attribute("Functional", "_nodes_by_depth", "a functional model's layer calls in order")
_RUN_THROUGH_GRAPH = _attribute("Functional", "_run_through_graph",
                                "runs a nested model's graph with every layer call replaced (flattening)")
_STANDARDIZE_INPUTS = _attribute("Functional", "_standardize_inputs",
                                 "a nested model's inputs as its call() takes them")
_INPUTS_STRUCT = _attribute("Functional", "_inputs_struct", "a model's inputs in the structure it was made with")
_FUNCTIONAL = _attribute("Sequential", "_functional", "the functional graph a built Sequential runs")
_FLATTEN_LAYERS = _attribute("Layer", "_flatten_layers", "a subclassed model's layers, for its trace")
_LOSSES = _attribute("Layer", "_losses", "add_loss() terms a trace made, taken back after it")
_TRAINABLE_VARIABLES = _attribute("Layer", "_trainable_variables",
                                  "a layer's own trainable variables (not its sublayers')")
_NON_TRAINABLE_VARIABLES = _attribute("Layer", "_non_trainable_variables",
                                      "a layer's own non-trainable variables (not its sublayers')")
_BUILD_SHAPES_DICT = _attribute("Layer", "_build_shapes_dict", "the input shapes a subclassed model was built with")
_LAYERS = _attribute("Model", "_layers", "a rebuilt traced model's layers in the order its weights follow")
_PATH = _attribute("Variable", "_path", "a rebuilt traced model's variables keep the user's model's paths")
_VAR_KEY = _attribute("Optimizer", "_var_key", "matches weight-decay exclusions by variable to their copies")
_EXCLUDE_FROM_WEIGHT_DECAY = _attribute("Optimizer", "_exclude_from_weight_decay",
                                        "an optimizer's weight-decay exclusions by variable, for a stage's copy")
_EXCLUDE_PATTERN = _attribute("Optimizer", "_exclude_from_weight_decay_pattern",
                              "an optimizer's weight-decay exclusions by name, for a stage's copy")
_AS_SERIALIZED_GRAPH = _attribute("Dataset", "_as_serialized_graph",
                                  "a dataset sent to a worker process as its graph, as tf.data's service does")
# Reached in modules of their own (named here so that missing() tries them).
_attribute("Optimizer", "_learning_rate", "a stage optimizer's learning rate variable or schedule "
           "(runtime/fit_loop.py)")
_SELF_ATTENTION_LAYER = _attribute("TransformerBlock", "_self_attention_layer",
                                   "a keras_hub TransformerEncoder's or Decoder's attention (its width per head) for "
                                   "the analytic profile (runtime/profiler.py)")
for _name in ("_variables", "_trainable_variables"):
    _attribute("Optimizer", _name, "an optimizer's registries of every variable, its own and the model's, read "
               "to save and restore its slots (runtime/checkpoint.py)")
for _name in ("_inference_function", "_garbage_collector", "_func_graph", "_delayed_rewrite_functions", "_attrs"):
    _attribute("ConcreteFunction", _name, "a stage's forward and backward as one compiled function pair "
               "(runtime/compiled.py)")


_CONTEXT_HANDLE = _attribute("Context", "_handle", "the eager context a stage's function call runs in "
                             "(runtime/compiled.py)")
_NOT_OK_STATUS = _attribute("EagerCore", "_NotOkStatusException", "what a failed eager call raises in C")
_STATUS_TO_EXCEPTION = _attribute("EagerCore", "_status_to_exception",
                                  "the TensorFlow error a failed eager call's status stands for")
_HANDLE_DATA = _attribute("DType", "_handle_data", "whether a function's output is a resource or variant with "
                          "handle data, which only call_flat sets on it")


# Accessors ---------------------------------------------------------------------------------------
def keras_history(tensor: Any) -> Any:
    """The (operation, node_index, tensor_index) of the layer call that made `tensor`."""
    return getattr(tensor, _KERAS_HISTORY)


def set_keras_history(tensor: Any, history: Any) -> None:
    setattr(tensor, _KERAS_HISTORY, history)


def producing_node(history: Any) -> Any:
    """The node (layer call) of a :func:`keras_history`."""
    return getattr(history.operation, _INBOUND_NODES)[history.node_index]


def call_context_args(operation: Any) -> Sequence[str]:
    return tuple(getattr(operation, _CALL_CONTEXT_ARGS, ()))


def has_nodes_by_depth(model: Any) -> bool:
    return hasattr(model, _NODES_BY_DEPTH)


def nodes_by_depth(functional: Any) -> dict[int, list[Any]]:
    return dict(getattr(functional, _NODES_BY_DEPTH))


def run_through_graph(functional: Any, inputs: Any, operation_fn: Callable[[Any], Callable[..., Any]]) -> Any:
    return getattr(functional, _RUN_THROUGH_GRAPH)(inputs, operation_fn=operation_fn)


def standardize_inputs(functional: Any, inputs: Any) -> list[Any]:
    return list(getattr(functional, _STANDARDIZE_INPUTS)(inputs))


def inputs_struct(functional: Any) -> Any:
    return getattr(functional, _INPUTS_STRUCT)


def sequential_graph(model: Any) -> Any:
    """The functional graph of a built Sequential; None before it is built."""
    return getattr(model, _FUNCTIONAL, None)


def sublayers(model: Any, recursive: bool = True) -> list[Any]:
    """`model`'s layers (at every depth, or its own when not `recursive`), itself left out."""
    return list(getattr(model, _FLATTEN_LAYERS)(include_self=False, recursive=recursive))


def own_losses(layer: Any) -> list[Any]:
    """The list of `layer`'s own ``add_loss`` terms (the list itself: deleting from it drops them)."""
    losses: list[Any] = getattr(layer, _LOSSES)
    return losses


def own_variables(layer: Any) -> list[Any]:
    return list(getattr(layer, _TRAINABLE_VARIABLES)) + list(getattr(layer, _NON_TRAINABLE_VARIABLES))


def build_shapes(layer: Any) -> dict[str, Any] | None:
    return getattr(layer, _BUILD_SHAPES_DICT, None)


def model_layers(model: Any) -> list[Any]:
    return list(getattr(model, _LAYERS))


def set_model_layers(model: Any, layers: list[Any]) -> None:
    setattr(model, _LAYERS, layers)


def set_variable_path(variable: Any, path: str) -> None:
    """Keras keeps a variable's path read-only."""
    setattr(variable, _PATH, path)


def weight_decay_exclusions(optimizer: Any) -> tuple[set[str], re.Pattern[str] | None]:
    """(keys of the variables excluded, the pattern of the names excluded) of `optimizer`."""
    return (set(getattr(optimizer, _EXCLUDE_FROM_WEIGHT_DECAY, set())),
            getattr(optimizer, _EXCLUDE_PATTERN, None))


def variable_key(optimizer: Any, variable: Any) -> str:
    return str(getattr(optimizer, _VAR_KEY)(variable))


def self_attention_layer(block: Any) -> Any:
    """The attention layer of a keras_hub TransformerEncoder or TransformerDecoder; None if it has none."""
    return getattr(block, _SELF_ATTENTION_LAYER, None)


def serialized_dataset_graph(dataset: tf.data.Dataset) -> Any:
    """`dataset`'s graph (a string tensor), refusing a pipeline that holds this process's state
    (tf.errors.FailedPreconditionError or InvalidArgumentError)."""
    return getattr(dataset, _AS_SERIALIZED_GRAPH)(
        external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL)


class _FlatCall:
    """What :func:`flat_caller` gives for a function without handle data in its outputs."""

    def __init__(self, function: Any) -> None:
        self.function = function  # held: TensorFlow drops a graph function from its context with its last reference
        self.context = eager_context.context()
        self.context.ensure_initialized()
        self.handle = getattr(self.context, _CONTEXT_HANDLE)
        self.name = function.name.decode()
        self.num_outputs = len(function.function_type.flat_outputs)
        self.not_ok = getattr(eager_core, _NOT_OK_STATUS)
        self.to_exception = getattr(eager_core, _STATUS_TO_EXCEPTION)

    def __call__(self, flat: Sequence[Any]) -> Any:
        ctx = self.context
        options = ctx.function_call_options.as_attrs()  # the thread's (its executor type, say)
        try:
            outputs = pywrap_tfe.TFE_Py_Execute(
                self.handle, ctx.device_name, self.name, list(flat),
                ("executor_type", options["executor_type"], "config_proto", options["config_proto"]), self.num_outputs)
        except self.not_ok as e:
            raise self.to_exception(e) from None
        return outputs or None


def flat_caller(function: Any) -> Callable[[Sequence[Any]], Any]:
    """A call of `function` (a traced graph function: a ConcreteFunction's inference function) with
    its flat input tensors, captured ones last, on the calling thread's device and function
    options, which returns its flat outputs (None for none). It is the call ``call_flat`` makes
    when executing eagerly, without the Python that call repeats each time: it pauses no gradient
    recording and checks for no cancellation (a stage's calls are never recorded or cancelled); a
    function whose outputs carry handle data (resources, variants) goes through ``call_flat``.

    Returns:
        The call: flat input tensors -> flat outputs or None.
    """
    if any(getattr(o.dtype, _HANDLE_DATA) for o in function.function_type.flat_outputs):
        return lambda flat: function.call_flat(*flat)
    return _FlatCall(function)


# The check -----------------------------------------------------------------------------------------
def _probes() -> dict[str, list[Any]]:
    """Small objects of every kind an attribute above is reached on."""
    dense = keras.layers.Dense(2)
    inputs = keras.Input((3,))
    outputs = dense(inputs)
    functional = keras.Model(inputs, outputs)
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.AdamW(1e-3)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.build(functional.trainable_variables)
    exclusions = keras.optimizers.AdamW(1e-3)
    exclusions.exclude_from_weight_decay(var_list=[dense.kernel])
    concrete = tf.function(lambda x: x * 2.0).get_concrete_function(tf.TensorSpec((), tf.float32))
    probes: dict[str, list[Any]] = {
        "KerasTensor": [outputs], "Operation": [dense], "Functional": [functional], "Sequential": [sequential],
        "Layer": [dense], "Model": [functional], "Variable": [dense.kernel], "Optimizer": [optimizer, exclusions],
        "Dataset": [tf.data.Dataset.range(3)], "ConcreteFunction": [concrete],
        "Context": [eager_context.context()], "EagerCore": [eager_core], "DType": [tf.float32]}
    try:
        import keras_hub  # late: optional dependency
    except ImportError:
        return probes  # no keras_hub: its blocks are not profiled either
    blocks = [keras_hub.layers.TransformerEncoder(8, 2), keras_hub.layers.TransformerDecoder(8, 2)]
    for block in blocks:
        block.build((None, 4, 8))
    probes["TransformerBlock"] = blocks
    return probes


def missing() -> list[str]:
    """Every registered private attribute that an object of its kind lacks in the installed
    versions (the imports were checked when this module was imported); [] when all are there."""
    probes = _probes()
    gone = []
    for reach in REACHES:
        kind, _, name = reach.what.partition(".")
        if kind not in probes:
            continue
        if not any(hasattr(obj, name) for obj in probes[kind]):
            gone.append(f"{reach.what} ({reach.why}): not in {_versions()}, checked on {CHECKED_ON}")
    return gone
