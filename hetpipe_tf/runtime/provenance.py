"""Which updates each weight version of a stage held: the record the staleness checks read
(:func:`hetpipe_tf.sync.staleness.check`, HetPipe §4-§6).

A stage records, for every minibatch p, the local updates (minibatch ids) and the global pushes
((worker, wave) pairs) that the weights p's forward pass used held: the version stashed for p
(w_p, §4) or the live weights. What a version holds is known when it is stashed, and a merge of
pulled global weights (§5) adds the pushes it took in to the live weights and to the versions
stashed since.
"""
from collections.abc import Iterable

#: A global push: (worker, wave).
Push = tuple[int, int]
#: What :meth:`Provenance.snapshot` gives: the used local updates and global pushes per
#: minibatch, and the live weights' pushes.
Snapshot = tuple[dict[int, tuple[int, ...]], dict[int, frozenset[Push]], frozenset[Push]]


class Provenance:
    """The record of one stage (see the module docstring)."""

    def __init__(self) -> None:
        self.live_globals: frozenset[Push] = frozenset()  # (worker, wave) pushes the live weights hold
        self.version_updates: dict[int, tuple[int, ...]] = {}  # p -> local updates w_p holds
        self.version_globals: dict[int, frozenset[Push]] = {}  # p -> global pushes w_p holds
        self.used_versions: dict[int, tuple[int, ...]] = {}  # p -> local updates the weights of p's forward pass held
        self.used_globals: dict[int, frozenset[Push]] = {}  # p -> global pushes the weights of p's forward pass held

    def stashed(self, p: int, applied: Iterable[int]) -> None:
        """w_p was stashed from the live weights, which held the local updates `applied`."""
        self.version_updates[p] = tuple(applied)
        self.version_globals[p] = self.live_globals

    def used(self, p: int, live: bool, applied: Iterable[int]) -> None:
        """p's forward pass used the live weights (`live`, holding the updates `applied`) or w_p."""
        if live:
            self.used_versions[p], self.used_globals[p] = tuple(applied), self.live_globals
        else:
            self.used_versions[p] = self.version_updates.pop(p)
            self.used_globals[p] = self.version_globals.pop(p, frozenset())

    def merged(self, stashed: Iterable[int], included: Iterable[Push]) -> None:
        """A merge made the live weights and the versions `stashed` (minibatch ids) hold the global
        pushes `included`."""
        self.live_globals = frozenset(included)
        for p in stashed:
            self.version_globals[p] = self.live_globals

    def snapshot(self) -> Snapshot:
        return dict(self.used_versions), dict(self.used_globals), self.live_globals

    def restore(self, snapshot: Snapshot) -> None:
        used_versions, used_globals, self.live_globals = snapshot
        self.used_versions, self.used_globals = dict(used_versions), dict(used_globals)

    def drop_pending(self) -> None:
        """Forgets the versions stashed for minibatches that never ran (a stopped run)."""
        self.version_updates.clear()
        self.version_globals.clear()

    def restart(self) -> None:
        """The live weights are the model's again: they hold no global push."""
        self.live_globals = frozenset()
