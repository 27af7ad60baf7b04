"""Which strategy a ``keras.Model.compile`` call belongs to.

``HetPipeStrategy.scope()`` must see every model compiled inside it, including a subclass whose
own ``compile`` ends in ``super().compile(...)`` (keras_hub's tasks). One wrapper around
``keras.Model.compile`` is installed once per process and never removed; it runs Keras's own
compile and then hands the bound arguments to the innermost scope entered *in the calling
context*. The scopes are kept on a :class:`contextvars.ContextVar` stack, so

- a thread that is in no scope compiles exactly as Keras does (a new thread starts with an empty
  context, whatever other threads have entered);
- nested scopes attach each model to the innermost one, and leaving it gives the next compile
  back to the outer one.
"""
import contextlib
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: Receives the model and compile's bound arguments (defaults applied, ``self`` included).
Attach = Callable[[Any, dict[str, Any]], None]

_scopes: contextvars.ContextVar[tuple[Attach, ...]] = contextvars.ContextVar("hetpipe_compile_scopes", default=())
_install_lock = threading.Lock()
_installed = False


def _install() -> None:
    """Wraps ``keras.Model.compile`` once; the wrapper is a pass-through outside every scope."""
    global _installed
    with _install_lock:
        if _installed:
            return
        import keras  # late: defers TensorFlow

        original = keras.Model.compile
        signature = inspect.signature(original)

        @functools.wraps(original)
        def compile(model: Any, *args: Any, **kwargs: Any) -> None:
            original(model, *args, **kwargs)
            scopes = _scopes.get()
            if scopes:
                bound = signature.bind(model, *args, **kwargs)
                bound.apply_defaults()
                scopes[-1](model, dict(bound.arguments))

        keras.Model.compile = compile
        _installed = True


@contextlib.contextmanager
def attaching(attach: Attach) -> Iterator[None]:
    """Within the block, in this thread (or task), every model compiled goes to `attach` (the
    innermost such block's)."""
    _install()
    token = _scopes.set(_scopes.get() + (attach,))
    try:
        yield
    finally:
        _scopes.reset(token)
