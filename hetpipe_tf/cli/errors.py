"""How the command-line binaries (``hetpipe-train``, ``hetpipe``) end on an error.

The rule, for both binaries:

- **usage error**, exit status 2: what the user gave cannot be used: a flag (absl
  reports it while parsing, validators included), a command line, a device list, a
  cluster description, a data set that is not prepared, stage boundaries, a model or
  optimizer the pipeline cannot run, a plan that cannot be made. Classes:
  :class:`hetpipe_tf.errors.HetPipeUsageError` and ``absl.app.UsageError``.
- **failed run**, exit status 1: the input was fine but the run failed: an emulated
  device ran out of memory, the loss or a gradient became NaN or infinite, a cluster
  task did not start or was lost, nothing made progress in time, the custom ops or an
  optional package are missing. Classes: :class:`hetpipe_tf.errors.HetPipeRunError`
  and ``TimeoutError``.
- anything else is an **internal error** and keeps Python's traceback (status 1).

An error counts as the first of these classes found in it or in the errors it was
raised from (``raise ... from``): a stage that failed because its device ran out of
memory is a failed run. A stage's failure (:class:`PipelineError`, and a stage stopped
by another's, :class:`PipelineAborted`) only carries what it was raised from: on its
own it is an internal error. A usage error or failed run prints one line,
``PROGRAM: error: MESSAGE`` or ``PROGRAM: failed: MESSAGE``, and no traceback unless
asked for with ``--verbosity=1`` (or higher) or the environment variable
``HETPIPE_TRACEBACK=1``.
"""
import os
import sys
import traceback
from collections.abc import Callable

from absl import app, flags

from hetpipe_tf.distributed.heartbeat import TaskLostError
from hetpipe_tf.errors import HetPipeRunError, HetPipeUsageError
from hetpipe_tf.pipeline.executor import PipelineError
from hetpipe_tf.pipeline.mailbox import PipelineAborted

USAGE_STATUS = 2
FAILED_RUN_STATUS = 1
TRACEBACK_ENV = "HETPIPE_TRACEBACK"

USAGE_ERRORS = (HetPipeUsageError, app.UsageError)
FAILED_RUNS = (HetPipeRunError, TimeoutError)
# Decided by what they were raised from (a stage's own error), never by themselves.
CARRIERS = (PipelineError, PipelineAborted)


def classify(exc: BaseException) -> tuple[int | None, BaseException]:
    """(exit status, the error that decided it) for a usage error or failed run; (None, exc)
    for an internal error. Looks at `exc`, then at what it was raised from."""
    seen: BaseException | None = exc
    while seen is not None:
        if not isinstance(seen, CARRIERS):
            if isinstance(seen, USAGE_ERRORS):
                return USAGE_STATUS, seen
            if isinstance(seen, FAILED_RUNS):
                return FAILED_RUN_STATUS, seen
        seen = seen.__cause__
    return None, exc


def wants_traceback() -> bool:
    """--verbosity=1 or more, or HETPIPE_TRACEBACK=1: usage errors and failed runs show their traceback."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        return True
    return flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1


def run(main: Callable[[list[str]], object], program: str) -> None:
    """``absl.app.run(main)`` for the binary `program`, ending on errors by the rule above."""
    app.run(_reporting(main, program), flags_parser=lambda argv: _parse_flags(argv, program))


def _parse_flags(argv: list[str], program: str) -> list[str]:
    """absl's parsing; a flag absl rejects (its validators included) is a usage error."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as exc:
        sys.stderr.write(f"{program}: error: {exc}\nPass --helpfull to see the flags.\n")
        sys.exit(USAGE_STATUS)


def _reporting(main: Callable[[list[str]], object], program: str) -> Callable[[list[str]], object]:
    def reporting_main(argv: list[str]) -> object:
        try:
            return main(argv)
        except Exception as exc:  # noqa: BLE001 - internal errors are re-raised with their traceback
            status, reason = classify(exc)
            if status is None:
                raise
            if wants_traceback():
                traceback.print_exception(exc)
            word = "error" if status == USAGE_STATUS else "failed"
            sys.stderr.write(f"{program}: {word}: {reason}\n")
            if isinstance(reason, TaskLostError):
                # Threads may still sit in calls to the cluster until their timeouts, and
                # TensorFlow's teardown would wait for them: end now, the reason is out.
                sys.stderr.flush()
                os._exit(status)
            sys.exit(status)
    return reporting_main
