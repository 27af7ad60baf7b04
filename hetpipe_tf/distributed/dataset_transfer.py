"""A ``tf.data.Dataset`` sent to another process: its graph, not its elements.

The chief hands every virtual worker's process its shard of the training data as the
dataset's serialized graph and element spec (what tf.data's own service sends): the
process rebuilds the same pipeline and reads the data itself, so no minibatch passes
through the chief. A dataset whose graph holds Python state (``py_function``,
``from_generator``) cannot be rebuilt elsewhere and is refused with a clear error.

These use TensorFlow's internal serializers (``Dataset._as_serialized_graph`` and the
``nested_structure_coder`` of SavedModel), reached through :mod:`hetpipe_tf.compat`.
"""
import tensorflow as tf

from hetpipe_tf import compat
from hetpipe_tf.compat import nested_structure_coder, struct_pb2
from hetpipe_tf.errors import HetPipeUsageError


class DatasetTransferError(HetPipeUsageError, ValueError):
    """A dataset that cannot be rebuilt in another process."""


def dataset_to_bytes(dataset: tf.data.Dataset) -> tuple[bytes, bytes]:
    """(graph, element spec) of `dataset` as bytes, for :func:`dataset_from_bytes`."""
    try:
        graph = compat.serialized_dataset_graph(dataset).numpy()
    except (tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError) as e:
        raise DatasetTransferError(
            f"this dataset cannot be sent to the virtual workers' processes: its pipeline holds state of this "
            f"Python process (py_function, from_generator, ...): {e.message.splitlines()[0]}. Build it from "
            f"files or tensors (tf.data, TensorFlow Datasets), or train with launch='in_process'") from None
    spec = nested_structure_coder.encode_structure(dataset.element_spec).SerializeToString()
    return graph, spec


def dataset_from_bytes(graph: bytes, spec: bytes) -> tf.data.Dataset:
    """The dataset that :func:`dataset_to_bytes` described."""
    value = struct_pb2.StructuredValue()
    value.ParseFromString(spec)
    return tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=graph),
                                             nested_structure_coder.decode_proto(value))
