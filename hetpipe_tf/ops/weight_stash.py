"""Python wrapper of the weight-stash custom op (HetPipe §4).

Minibatch p's forward and backward passes use the weight version w_p, which
holds all local updates of minibatches 1..p-Nm (w_1 = ... = w_Nm = w_0). Each
pipeline stage keeps its versions in a :class:`WeightStash` on its own device:
``put`` after update p-Nm is applied, ``get`` for p's forward pass, ``release``
after p's backward pass. At most Nm versions are live; one more is refused.
"""
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import tensorflow as tf

from hetpipe_tf.ops.loader import load_ops

_ids = itertools.count()


def _minibatch_id(minibatch: int | tf.Tensor) -> tf.Tensor:
    return tf.convert_to_tensor(minibatch, tf.int64)


@dataclass(frozen=True)
class StashStats:
    """What a stash holds: live versions, their bytes and minibatch ids."""
    num_versions: int
    bytes: int
    minibatches: tuple[int, ...]


class WeightStash:
    """Weight versions of one stage, keyed by minibatch id, held by a TF resource.

    Args:
      capacity: Nm, the most versions that may be live at once.
      device: the TensorFlow device the stash (and the tensors it holds) live on.
      name: a readable name used in error messages.
    """

    def __init__(self, capacity: int, device: str | None = None, name: str = "stash") -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity (Nm) must be >= 1, got {capacity}")
        self._ops = load_ops()
        self.capacity = int(capacity)
        self.device = device
        self.name = f"{name}_{next(_ids)}"
        with tf.device(device):
            self._handle = self._ops.hetpipe_weight_stash_handle(shared_name=self.name)
            self._ops.hetpipe_weight_stash_create(self._handle, tf.constant(self.capacity, tf.int64))

    def put(self, minibatch: int | tf.Tensor, values: Sequence[tf.Tensor]) -> None:
        """Stashes `values` (a list of tensors) as minibatch `minibatch`'s version."""
        with tf.device(self.device):
            self._ops.hetpipe_weight_stash_put(self._handle, _minibatch_id(minibatch),
                                               list(values))

    def get(self, minibatch: int | tf.Tensor, dtypes: Sequence[tf.DType]) -> list[tf.Tensor]:
        """The version stashed for `minibatch`, as a list of tensors of `dtypes`."""
        with tf.device(self.device):
            return list(self._ops.hetpipe_weight_stash_get(
                self._handle, _minibatch_id(minibatch), dtypes=list(dtypes)))

    def release(self, minibatch: int | tf.Tensor) -> None:
        """Drops `minibatch`'s version (after its backward pass)."""
        with tf.device(self.device):
            self._ops.hetpipe_weight_stash_release(self._handle, _minibatch_id(minibatch))

    def stats(self) -> StashStats:
        """A :class:`StashStats` of what the stash holds now."""
        with tf.device(self.device):
            num, nbytes, ids = self._ops.hetpipe_weight_stash_stats(self._handle)
        return StashStats(int(num), int(nbytes), tuple(int(i) for i in ids.numpy()))

    def close(self) -> None:
        """Destroys the resource and whatever versions it still holds."""
        if self._handle is not None:
            with tf.device(self.device):
                tf.raw_ops.DestroyResourceOp(resource=self._handle, ignore_lookup_error=True)
            self._handle = None
