"""A stage's variables on its device: the live weights w_local, the non-trainable state, the
optimizer's copy and the weight stash of the versions w_p (HetPipe §4)."""
import contextlib
from collections.abc import Sequence

import keras
import tensorflow as tf

from hetpipe_tf.ops.weight_stash import WeightStash
from hetpipe_tf.runtime.optimizers import stage_optimizer
from hetpipe_tf.runtime.stage_rewrite import variable_bytes

#: The values of a stage's variables: (trainable, non-trainable, optimizer), each in order.
WeightValues = tuple[list[tf.Tensor], list[tf.Tensor], list[tf.Tensor]]


def is_remote(device: str | None) -> bool:
    """Whether `device` belongs to a task of a cluster rather than to this process."""
    job = tf.DeviceSpec.from_string(device or "").job
    return job not in (None, "localhost")


def _copy(variable: keras.Variable, trainable: bool) -> keras.Variable:
    """A new variable with `variable`'s value, dtype, name and path (what optimizers match their
    settings against, such as AdamW's exclude_from_weight_decay), on the current device."""
    with contextlib.ExitStack() as stack:
        for part in variable.path.split("/")[:-1]:
            stack.enter_context(keras.name_scope(part))
        # From a value (numpy): given a tf.Variable, keras.Variable would reuse it.
        return keras.Variable(variable.numpy(), dtype=variable.dtype, trainable=trainable, name=variable.name)


class StageWeights:
    """Copies of a Keras stage's variables on `device`, its optimizer (one copy per stage of
    `optimizer`) and a stash of at most `num_in_flight` weight versions. `stashed` holds the
    minibatch ids whose versions the stash holds, as the host knows them (no readback)."""

    def __init__(self, stage: keras.Model, device: str, optimizer: keras.optimizers.Optimizer, num_in_flight: int,
                 name: str) -> None:
        self.stage = stage
        with tf.device(device):
            self.trainable = [_copy(v, trainable=True) for v in stage.trainable_variables]
            self.non_trainable = [_copy(v, trainable=False) for v in stage.non_trainable_variables]
            self.optimizer = stage_optimizer(optimizer, stage.trainable_variables, self.trainable)
            self.optimizer.build(self.trainable)
        self.stash = WeightStash(num_in_flight, device=device, name=name)
        self.dtypes = [v.dtype for v in self.trainable]
        #: The bytes of one weight version.
        self.version_bytes = variable_bytes(self.trainable)
        self.stashed: set[int] = set()

    def live(self) -> list[tf.Tensor]:
        """Inside a task's graph: the live weights' values now."""
        return [tf.identity(v.value) for v in self.trainable]

    def version(self, minibatch: tf.Tensor) -> list[tf.Tensor]:
        """Inside a task's graph: the version stashed for `minibatch`, with the weights' shapes."""
        if not self.trainable:  # a stage may have no weights (pooling, activations)
            return []
        version = self.stash.get(minibatch, self.dtypes)
        for t, v in zip(version, self.trainable):
            t.set_shape(v.shape)
        return version

    def stashed_from(self, first_minibatch: int) -> tuple[list[int], tf.Tensor]:
        """The minibatch ids >= `first_minibatch` whose versions are stashed, in order, and the same
        ids padded with -1 to the stash's capacity (one tensor, so one trace of a compiled call)."""
        ids = sorted(p for p in self.stashed if p >= first_minibatch)
        return ids, tf.constant(ids + [-1] * (self.stash.capacity - len(ids)), tf.int64)

    def values(self) -> WeightValues:
        """The variables' values now (tensors share buffers until the variables change)."""
        return ([tf.identity(v.value) for v in self.trainable], [tf.identity(v.value) for v in self.non_trainable],
                [tf.identity(v.value) for v in self.optimizer.variables])

    def assign(self, trainable: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor],
               optimizer: Sequence[tf.Tensor]) -> None:
        """Sets the variables to the given values (as :meth:`values` gives them)."""
        for variables, values in ((self.trainable, trainable), (self.non_trainable, non_trainable),
                                  (self.optimizer.variables, optimizer)):
            for v, value in zip(variables, values):
                v.assign(value)

    def load_model_weights(self) -> None:
        """Sets the live weights and state to the Keras model's own (the optimizer's state stays)."""
        for variables, sources in ((self.trainable, self.stage.trainable_variables),
                                   (self.non_trainable, self.stage.non_trainable_variables)):
            for v, source in zip(variables, sources):
                v.assign(source.value)

    def write_back(self, trainable: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor]) -> None:
        """Writes the given values into the Keras model's own variables."""
        for v, value in zip(self.stage.trainable_variables, trainable):
            v.assign(value)
        for v, value in zip(self.stage.non_trainable_variables, non_trainable):
            v.assign(value)
