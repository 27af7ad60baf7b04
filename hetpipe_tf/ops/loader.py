"""Loads hetpipe_tf's compiled op library, once, and checks what it was built for.

``setup.py`` compiles every ``.cc`` under ``hetpipe_tf/ops/cc`` into one library
and records the TensorFlow version it compiled against. A missing library or one
built for another TensorFlow gives :class:`OpsLibraryError`, naming both
versions and the command that rebuilds the library.
"""
import glob
import json
import os
import threading

from hetpipe_tf.errors import HetPipeRunError

REBUILD_COMMAND = ("pip install --no-build-isolation -e .  "
                   "(or: python setup.py build_ext --inplace) in the hetpipe_tf source tree")

_LIBRARY_GLOB = "_hetpipe_ops*.so"
_BUILD_INFO = "_hetpipe_ops_build.json"
_lock = threading.Lock()
_library = None


class OpsLibraryError(HetPipeRunError, ImportError):
    """The custom op library is missing or does not match the installed TensorFlow."""


def library_path(directory=None):
    """The path of the built op library; OpsLibraryError if there is none."""
    directory = directory or os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(directory, _LIBRARY_GLOB)))
    if not found:
        raise OpsLibraryError(
            f"hetpipe_tf's custom ops are not built: no {_LIBRARY_GLOB} in {directory}. "
            f"Build them with: {REBUILD_COMMAND}")
    return found[0]


def check_build(directory, tensorflow_version):
    """Raises OpsLibraryError unless the library in `directory` was built for `tensorflow_version`."""
    path = os.path.join(directory, _BUILD_INFO)
    try:
        with open(path) as f:
            built_for = json.load(f)["tensorflow_version"]
    except (OSError, ValueError, KeyError) as e:
        raise OpsLibraryError(
            f"hetpipe_tf's custom ops have no readable build record ({path}: {e}); "
            f"rebuild them with: {REBUILD_COMMAND}") from e
    if built_for != tensorflow_version:
        raise OpsLibraryError(
            f"hetpipe_tf's custom ops were built against TensorFlow {built_for}, "
            f"but TensorFlow {tensorflow_version} is installed; rebuild them with: "
            f"{REBUILD_COMMAND}")


def load_ops():
    """The loaded op module (``tf.load_op_library``), loaded on first use."""
    global _library
    with _lock:
        if _library is None:
            import tensorflow as tf

            path = library_path()
            check_build(os.path.dirname(path), tf.__version__)
            try:
                _library = tf.load_op_library(path)
            except tf.errors.NotFoundError as e:
                raise OpsLibraryError(
                    f"hetpipe_tf's custom ops in {path} do not load into TensorFlow "
                    f"{tf.__version__} ({e}); rebuild them with: {REBUILD_COMMAND}") from e
        return _library
