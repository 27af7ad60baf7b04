"""The root of every error hetpipe_tf raises, and its two branches.

- :class:`HetPipeUsageError`: what was given cannot be used (a device list, a cluster
  description, stage boundaries, a model, an optimizer, a data set, a plan that cannot be
  made). The fix is in the input; the message names what was given, what is allowed and
  the fix. The command-line binaries exit with status 2.
- :class:`HetPipeRunError`: the input was fine but the run failed (a device ran out of
  memory, the loss became NaN, a task of the cluster was lost, the custom ops are
  missing). The command-line binaries exit with status 1.

Every public exception class of the package derives from one of the two, and keeps the
builtin class it had before (``ValueError``, ``RuntimeError``, ...) as a second base, so
``except ValueError`` still catches a bad device list. Catch :class:`HetPipeError` for
anything hetpipe_tf raised on purpose.

This module imports nothing of the package, so every layer, the lowest included, can
derive its errors from it.
"""


class HetPipeError(Exception):
    """Any error hetpipe_tf raises on purpose: a :class:`HetPipeUsageError` or a
    :class:`HetPipeRunError`."""


class HetPipeUsageError(HetPipeError):
    """What was given cannot be used; the message says what was given, what is allowed and
    the fix (the command line exits with status 2)."""


class HetPipeRunError(HetPipeError):
    """The input was fine but the run failed; the message says where and why (the command
    line exits with status 1)."""
