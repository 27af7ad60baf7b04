"""Loads hetpipe_tf's compiled op library, once, and checks what it was built for.

``setup.py`` compiles every ``.cc`` under ``hetpipe_tf/ops/cc`` into one library
and records beside it the TensorFlow version it compiled against
(``_hetpipe_ops_build.json``): a checkout's editable install, ``pip install .`` and a
wheel all carry the library built for the TensorFlow installed at build time. A missing
library or one built for another TensorFlow gives :class:`OpsLibraryError`, naming both
versions and the command that rebuilds the library where this package is
(:func:`rebuild_command`):

* in a source checkout (``setup.py`` beside the package): the checkout's editable install;
* an installed package (a wheel, or ``pip install .``): a reinstall from source, compiled
  against the TensorFlow installed now: ``pip install --force-reinstall --no-deps
  --no-build-isolation --no-binary hetpipe_tf SOURCE``. Without build isolation, because an
  isolated build compiles against the TensorFlow that ``pyproject.toml`` pins, not the one
  that the library must match.

The library is not built at first import instead: every parameter-server and worker task and
every virtual worker's process imports the ops, several of them at once, so a build there would
run concurrently in each, need a compiler and TensorFlow's headers on every machine that trains,
and write into a site-packages that may not be writable; a reinstall builds once, where the
user chooses.
"""
import glob
import json
import os
import threading
import types

from hetpipe_tf.errors import HetPipeRunError

CHECKOUT_REBUILD = "pip install --no-build-isolation -e .  (or: python setup.py build_ext --inplace) in {root}"
INSTALLED_REBUILD = ("pip install --force-reinstall --no-deps --no-build-isolation --no-binary hetpipe_tf SOURCE  "
                     "(SOURCE: hetpipe_tf's source tree or sdist; it compiles against the TensorFlow installed now)")

_LIBRARY_GLOB = "_hetpipe_ops*.so"
_BUILD_INFO = "_hetpipe_ops_build.json"
_lock = threading.Lock()
_library = None


class OpsLibraryError(HetPipeRunError, ImportError):
    """The custom op library is missing or does not match the installed TensorFlow."""


def _ops_directory() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def rebuild_command(directory: str) -> str:
    """The command that rebuilds the op library of the package whose ops are in `directory`:
    the checkout's when ``setup.py`` is beside the package, else a reinstall from source.

    Returns:
        The command, as a shell line.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(directory)))
    if os.path.isfile(os.path.join(root, "setup.py")):
        return CHECKOUT_REBUILD.format(root=root)
    return INSTALLED_REBUILD


def library_path(directory: str | None = None) -> str:
    """The path of the built op library.

    Args:
        directory: where the library is looked for (None: the package's ops directory).

    Returns:
        The path of the library found there.

    Raises:
        OpsLibraryError: there is none (the message says how to build it).
    """
    directory = directory or _ops_directory()
    found = sorted(glob.glob(os.path.join(directory, _LIBRARY_GLOB)))
    if not found:
        raise OpsLibraryError(
            f"hetpipe_tf's custom ops are not built: no {_LIBRARY_GLOB} in {directory}. "
            f"Build them with: {rebuild_command(directory)}")
    return found[0]


def check_build(directory: str, tensorflow_version: str) -> None:
    """Raises OpsLibraryError unless the library in `directory` was built for `tensorflow_version`."""
    path = os.path.join(directory, _BUILD_INFO)
    try:
        with open(path) as f:
            built_for = json.load(f)["tensorflow_version"]
    except (OSError, ValueError, KeyError) as e:
        raise OpsLibraryError(
            f"hetpipe_tf's custom ops have no readable build record ({path}: {e}); "
            f"rebuild them with: {rebuild_command(directory)}") from e
    if built_for != tensorflow_version:
        raise OpsLibraryError(
            f"hetpipe_tf's custom ops were built against TensorFlow {built_for}, "
            f"but TensorFlow {tensorflow_version} is installed; rebuild them with: "
            f"{rebuild_command(directory)}")


def load_ops() -> types.ModuleType:
    """The loaded op module (``tf.load_op_library``), loaded on first use."""
    global _library
    with _lock:
        if _library is None:
            import tensorflow as tf  # late: defers TensorFlow

            path = library_path()
            check_build(os.path.dirname(path), tf.__version__)
            try:
                _library = tf.load_op_library(path)
            except tf.errors.NotFoundError as e:
                raise OpsLibraryError(
                    f"hetpipe_tf's custom ops in {path} do not load into TensorFlow "
                    f"{tf.__version__} ({e}); rebuild them with: {rebuild_command(os.path.dirname(path))}") from e
        loaded: types.ModuleType = _library
        return loaded
