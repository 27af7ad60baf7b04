"""One lock for the first call of the process's graph functions.

A graph function is traced at its first call and instantiated at its first run (TensorFlow
then adds it to the eager context's function library and prepares it for its devices). Two
stage threads doing so at once hung, rarely, in TensorFlow 2.21 (CI of 27 Nov: a stage's first
task of a resumed run; here, two stages' first merge of a wave): a call that never returned.
:data:`FIRST_CALLS` makes those first calls one at a time; later calls, which run an
instantiated function, take no lock. A function whose run may wait for other workers (a pull
gated by the clock, a collective) is only traced under the lock, so that the wait never
holds it.
"""
import threading
from collections.abc import Callable
from typing import Any

#: Held while a graph function is traced, and while a function that waits for no one runs the first time.
FIRST_CALLS = threading.RLock()


class FirstCallLocked:
    """`fn`, a graph function, whose first call holds :data:`FIRST_CALLS`: traced (a
    ``tf.function``) and run under it, or with `waits` (its run may wait for other workers; a
    ``tf.function``) only traced under it (``get_concrete_function`` of the call's arguments)."""

    def __init__(self, fn: Callable, waits: bool = False):
        self._fn = fn
        self._waits = waits
        self._warm = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._warm:
            return self._fn(*args, **kwargs)
        if self._waits:
            with FIRST_CALLS:
                self._fn.get_concrete_function(*args, **kwargs)
            out = self._fn(*args, **kwargs)
        else:
            with FIRST_CALLS:
                out = self._fn(*args, **kwargs)
        self._warm = True
        return out
