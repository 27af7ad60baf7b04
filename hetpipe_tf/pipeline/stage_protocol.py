"""What the executor asks of a stage runtime.

Pure Python. The stage runtimes (:class:`hetpipe_tf.runtime.stage.runtime.StageRuntime`) belong
to the runtime layer above this one and hold TensorFlow's tensors; the executor
(:mod:`hetpipe_tf.pipeline.executor`) carries out a schedule through this protocol alone, so that
a stage that runs something else (the tests' toy stages) fits too. The tensors a stage hands
over are opaque here (``Any``): the executor only moves them between stages.
"""
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from hetpipe_tf.pipeline.emulation import MemoryAccount
from hetpipe_tf.pipeline.instructions import Instruction


class StashStats(Protocol):
    """How many weight versions a stage's stash holds, and their bytes."""

    @property
    def num_versions(self) -> int:
        """Versions stashed."""

    @property
    def bytes(self) -> int:
        """Their bytes."""


class Stash(Protocol):
    """A stage's stashed weight versions (the custom op, §4)."""

    def stats(self) -> StashStats:
        """What the stash holds now."""


class StageRuntime(Protocol):
    """One stage's runtime, as the executor uses it."""

    device: str
    #: The instruction types the stage's device carries out (in groups, one call of :meth:`run`).
    device_instructions: Collection[type[Instruction]]
    is_last: bool
    #: minibatch -> its loss and metrics (the last stage).
    logs: dict[int, dict[str, Any]]
    memory: MemoryAccount
    stash: Stash

    def execution_scope(self) -> AbstractContextManager[Any]:
        """The scope the stage's thread runs in (its device)."""

    def run(self, instructions: Sequence[Instruction]) -> None:
        """Carries out a group of device instructions in one call."""

    def check_applied(self, logs: Mapping[int, dict[str, Any]] | None = None) -> None:
        """Reads back whether the updates applied since the last check were applied (a loss or
        gradient that was not finite fails the run here)."""

    def end_run(self) -> None:
        """Ends the stage's part of a run."""

    def snapshot(self) -> Any:
        """The stage's state now (weights, optimizer slots, statistics)."""

    def set_loaded(self, minibatch: int, tensors: Any) -> None:
        """The model inputs of `minibatch` this stage consumes."""

    def set_labels(self, minibatch: int, labels: Any) -> None:
        """The labels of `minibatch` (the last stage)."""

    def set_received(self, minibatch: int, tensors: Any) -> None:
        """The previous stage's activations of `minibatch`."""

    def sent(self, minibatch: int) -> Any:
        """What this stage sends the next one for `minibatch`."""

    def set_output_gradients(self, minibatch: int, message: Any) -> None:
        """The next stage's gradient of what this stage sent for `minibatch`."""

    def input_gradients(self, minibatch: int) -> Any:
        """The gradient of what this stage received for `minibatch`, for the previous stage."""

    def update_terms(self, minibatch: int) -> Any:
        """The terms every stage's update of `minibatch` takes (the first stage)."""

    def set_update_terms(self, minibatch: int, terms: Any) -> None:
        """The first stage's update terms of `minibatch`."""

    def tied_gradients(self, minibatch: int) -> Any:
        """The gradients of `minibatch` of this stage's replicas of tied weights."""

    def set_tied_gradients(self, minibatch: int, source: int, grads: Any) -> None:
        """Stage `source`'s gradients of `minibatch` of its tied replicas."""
