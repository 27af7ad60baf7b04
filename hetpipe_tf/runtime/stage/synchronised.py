"""What a stage exchanges with the other virtual workers: its synchronised variables.

The synchronisation schemes of :mod:`hetpipe_tf.sync` work on a stage through this surface
(each scheme's ``stage_state`` is given one): reading the synchronised variables, their change
since a push, and adding a change to the live weights and to the versions stashed for the
minibatches that will run on them (the merge of §5). Each operation is one compiled call on the
stage's device (on another task's device one RPC, not one per variable and op).
"""
import functools
from collections.abc import Collection, Sequence

import tensorflow as tf

from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.runtime.provenance import Provenance
from hetpipe_tf.runtime.stage.weights import StageWeights
from hetpipe_tf.sync.parameter_server import synchronised_variables

#: A global update, as provenance records it: (worker, clock) of a push.
Included = Collection[tuple[int, int]]


def _compiled(fn: functools.partial) -> FirstCallLocked:
    """`fn` as a graph function traced and first called under the process's lock."""
    return FirstCallLocked(tf.function(fn))


def _subtract_graph(a: list[tf.Tensor], b: list[tf.Tensor]) -> list[tf.Tensor]:
    return [x - y for x, y in zip(a, b)]


def _sum_graph(a: list[tf.Tensor], b: list[tf.Tensor]) -> list[tf.Tensor]:
    return [x + y for x, y in zip(a, b)]


class SynchronisedWeights:
    """The synchronised variables of one stage (weights, then floating-point state), in the same
    order as their `paths` (the keys of the parameter servers) and `dtypes` (their dtypes' names).
    The stage pushes all but the positions of its `followers`, replicas of tied weights that an
    earlier stage holds too (the servers hold one copy; every replica pulls and merges, so all
    stay equal)."""

    def __init__(self, weights: StageWeights, device: str, followers: Collection[int],
                 provenance: Provenance | None) -> None:
        self.device = device
        self.weights = weights
        self.variables = synchronised_variables(weights.trainable, weights.non_trainable)
        self.paths = [v.path for v in synchronised_variables(weights.stage.trainable_variables,
                                                             weights.stage.non_trainable_variables)]
        self.dtypes = [tf.as_dtype(v.dtype).name for v in self.variables]
        self.pushed_positions = [i for i in range(len(self.variables)) if i not in followers]
        self.provenance = provenance
        # Partials, not methods or lambdas: TensorFlow keys its retracing warning on a function's
        # code, which every stage would share.
        self._read = _compiled(functools.partial(self._read_graph))
        self._change = _compiled(functools.partial(self._change_graph))
        self._add = _compiled(functools.partial(self._add_graph))
        self._merge = _compiled(functools.partial(self._merge_graph))
        self._subtract = _compiled(functools.partial(_subtract_graph))
        self._sum = _compiled(functools.partial(_sum_graph))

    def pushed(self, deltas: Sequence[tf.Tensor]) -> tuple[list[str], list[tf.Tensor]]:
        """(paths, deltas) of what this stage pushes to the parameter servers of `deltas` (one per
        synchronised variable)."""
        return [self.paths[i] for i in self.pushed_positions], [deltas[i] for i in self.pushed_positions]

    def values(self) -> list[tf.Tensor]:
        """Copies of the synchronised variables' values now."""
        with tf.device(self.device):
            return self._read()

    def change(self, since: Sequence[tf.Tensor]) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """(copies of the synchronised variables' values now, their change from `since`), in one
        call on the stage's device."""
        with tf.device(self.device):
            return self._change(list(since))

    def subtract(self, a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """[x - y for x, y in zip(a, b)], computed on the stage's device."""
        with tf.device(self.device):
            return self._subtract(list(a), list(b))

    def sum(self, a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """[x + y for x, y in zip(a, b)], computed on the stage's device."""
        with tf.device(self.device):
            return self._sum(list(a), list(b))

    def add_to_weights(self, deltas: Sequence[tf.Tensor], first_minibatch: int, included: Included) -> None:
        """Adds `deltas` (one per synchronised variable) to the live variables and to the versions
        stashed for minibatches >= `first_minibatch`, which thereby hold the global updates
        `included` ((worker, clock) pushes), as the live weights now do; one compiled call on the
        stage's device."""
        stashed, padded = self.weights.stashed_from(first_minibatch)
        with tf.device(self.device):
            self._add(list(deltas), padded)
        if self.provenance:
            self.provenance.merged(stashed, included)

    def merge_pulled(self, base: Sequence[tf.Tensor], pulled: Sequence[tf.Tensor], first_minibatch: int,
                     included: Included) -> list[tf.Tensor]:
        """:meth:`add_to_weights` of ``pulled - base`` in the same compiled call that computes it (one
        RPC where the device is another task's): the merge of global weights pulled after the
        pushes `included` (§5). Returns ``base + (pulled - base)``, the new base of the next push."""
        stashed, padded = self.weights.stashed_from(first_minibatch)
        with tf.device(self.device):
            new_base = self._merge(list(base), list(pulled), padded)
        if self.provenance:
            self.provenance.merged(stashed, included)
        return new_base

    # The graphs of the calls ---------------------------------------------------------------
    def _read_graph(self) -> list[tf.Tensor]:
        return [tf.identity(v.value) for v in self.variables]

    def _change_graph(self, since: list[tf.Tensor]) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        now = self._read_graph()
        return now, [x - y for x, y in zip(now, since)]

    def _shift_version_graph(self, p: tf.Tensor, deltas: list[tf.Tensor]) -> None:
        stash = self.weights.stash
        version = stash.get(p, self.weights.dtypes)
        stash.release(p)
        stash.put(p, [w + d for w, d in zip(version, deltas)])  # versions: trainable weights only

    def _add_graph(self, deltas: list[tf.Tensor], stashed: tf.Tensor) -> None:
        for v, d in zip(self.variables, deltas):
            v.assign_add(d)
        trainable = len(self.weights.trainable)
        for i in range(self.weights.stash.capacity) if trainable else ():  # a stage without weights stashes nothing
            tf.cond(stashed[i] >= 0, lambda p=stashed[i]: self._shift_version_graph(p, deltas[:trainable]),
                    lambda: None)

    def _merge_graph(self, base: list[tf.Tensor], pulled: list[tf.Tensor], stashed: tf.Tensor) -> list[tf.Tensor]:
        deltas = [x - y for x, y in zip(pulled, base)]
        self._add_graph(deltas, stashed)
        return [x + d for x, d in zip(base, deltas)]
