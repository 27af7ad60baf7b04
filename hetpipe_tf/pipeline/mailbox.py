"""Keyed messages between the stages of a pipeline, with timeouts on every wait.

Each stage owns one :class:`Mailbox`. Any thread may ``put`` a message under a
key such as ``("activation", 7)``; the stage takes messages by key, never by
arrival order, so a minibatch's activations, gradients and labels cannot be
paired with another minibatch's. A key arriving twice is an error (an update
would be applied twice).
"""
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

from hetpipe_tf.errors import HetPipeRunError


class PipelineAborted(HetPipeRunError, RuntimeError):
    """Another stage failed; this one stops."""


class DuplicateMessageError(HetPipeRunError, RuntimeError):
    """The same key was delivered twice to a stage."""


_Chosen = TypeVar("_Chosen")


class Mailbox:
    """A stage's messages by key (any hashable: the instructions' keys), each with when it arrived."""

    def __init__(self, owner: str, abort_event: threading.Event, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.owner = owner
        self._abort = abort_event
        self._clock = clock
        self._items: dict[Hashable, tuple[float, Any]] = {}  # key -> (arrival time, value)
        self.cond = threading.Condition()

    def put(self, key: Hashable, value: Any = None) -> None:
        """Delivers `value` under `key` and wakes the waiters; a key is delivered once.

        Raises:
            DuplicateMessageError: `key` was delivered already (it would be applied twice).
        """
        with self.cond:
            if key in self._items:
                raise DuplicateMessageError(f"{self.owner} received {key} twice")
            self._items[key] = (self._clock(), value)
            self.cond.notify_all()

    def take(self, key: Hashable) -> Any:
        """Removes and returns the message under `key`, which must be present."""
        with self.cond:
            return self._items.pop(key)[1]

    def arrival(self, key: Hashable) -> float | None:
        """When `key` arrived, or None if it has not."""
        item = self._items.get(key)
        return item[0] if item else None

    def ready_time(self, keys: Iterable[Hashable]) -> float | None:
        """When the last of `keys` arrived (0 for none), or None while one has not."""
        latest = 0.0
        for key in keys:
            item = self._items.get(key)
            if item is None:
                return None
            if item[0] > latest:
                latest = item[0]
        return latest

    def wake(self) -> None:
        """Wakes every waiter to look again (after an abort, say)."""
        with self.cond:
            self.cond.notify_all()

    def wait_until(self, choose: Callable[[], _Chosen | None], timeout: float, describe: Callable[[], str],
                   on_wait: Callable[[], None] | None = None) -> _Chosen:
        """Waits until `choose()` (called under the lock) returns a value, and returns it;
        `on_wait()` is called once if it has to wait.

        Raises:
          PipelineAborted: if the pipeline is aborted meanwhile.
          TimeoutError: after `timeout` seconds, with `describe()` in the message.

        Returns:
          The value `choose()` returned.
        """
        deadline: float | None = None
        with self.cond:
            while True:
                if self._abort.is_set():
                    raise PipelineAborted(f"{self.owner} stopped: another part of the pipeline failed")
                chosen = choose()
                if chosen is not None:
                    return chosen
                if deadline is None:
                    deadline = self._clock() + timeout
                    if on_wait is not None:
                        on_wait()
                left = deadline - self._clock()
                if left <= 0:
                    raise TimeoutError(f"{self.owner} waited {timeout:g} s with no task ready: {describe()}")
                self.cond.wait(min(left, 1.0))
