"""How the command-line binaries (``hetpipe-train``, ``hetpipe``) end on an error.

The rule, for both binaries:

- **usage error**, exit status 2: what the user gave cannot be used: a flag (absl
  reports it while parsing, validators included), a command line, a device list, a
  cluster description, a data set that is not prepared, stage boundaries, a model or
  optimizer the pipeline cannot run, a plan that cannot be made. Classes:
  :data:`USAGE_ERRORS`, and ``absl.app.UsageError``.
- **failed run**, exit status 1: the input was fine but the run failed: an emulated
  device ran out of memory, the loss or a gradient became NaN or infinite, a cluster
  task did not start, nothing made progress in time, the custom ops or an optional
  package are missing. Classes:
  :data:`FAILED_RUNS`.
- anything else is an **internal error** and keeps Python's traceback (status 1).

An error counts as the first of these classes found in it or in the errors it was
raised from (``raise ... from``): a stage that failed because its device ran out of
memory is a failed run. A usage error or failed run prints one line,
``PROGRAM: error: MESSAGE`` or ``PROGRAM: failed: MESSAGE``, and no traceback unless
asked for with ``--verbosity=1`` (or higher) or the environment variable
``HETPIPE_TRACEBACK=1``.
"""
import os
import sys
import traceback

from absl import app, flags

USAGE_STATUS = 2
FAILED_RUN_STATUS = 1
TRACEBACK_ENV = "HETPIPE_TRACEBACK"

# Module -> class names. A class is looked up only when its module is loaded: an error of a
# class whose module was never imported cannot have been raised, and nothing is imported here.
USAGE_ERRORS = {
    "hetpipe_tf.planning.devices": ("DeviceSpecError",),
    "hetpipe_tf.planning.cluster": ("ClusterError",),
    "hetpipe_tf.distributed.launch": ("ClusterConfigError",),
    "hetpipe_tf.data.datasets": ("DatasetNotFoundError", "DatasetOptionError"),
    "hetpipe_tf.planning.model_graph": ("PartitionError",),  # SharedLayerError included
    "hetpipe_tf.planning.partitioner": ("InfeasiblePartitionError",),
    "hetpipe_tf.planning.allocation": ("AllocationError",),
    "hetpipe_tf.planning.planner": ("PlanError",),
    "hetpipe_tf.runtime.stage_rewrite": ("UnsupportedModelError",),
    "hetpipe_tf.runtime.optimizers": ("UnsupportedOptimizerError",),
    "hetpipe_tf.cli.plots": ("TraceFileError",),
    "hetpipe_tf.cli.models": ("ModelInputError",),
}
FAILED_RUNS = {
    "hetpipe_tf.pipeline.emulation": ("DeviceOutOfMemoryError",),
    "hetpipe_tf.runtime.stage.verdicts": ("NonFiniteError",),
    "hetpipe_tf.distributed.starter": ("ClusterStartError",),
    "hetpipe_tf.distributed.heartbeat": ("TaskLostError",),
    "hetpipe_tf.ops.loader": ("OpsLibraryError",),
    "hetpipe_tf.cli.plots": ("PlottingUnavailableError",),
    "builtins": ("TimeoutError",),
}


def _loaded(table):
    return tuple(getattr(sys.modules[module], name) for module, names in table.items()
                 if module in sys.modules for name in names)


def classify(exc):
    """(exit status, the error that decided it) for a usage error or failed run; (None, exc)
    for an internal error. Looks at `exc`, then at what it was raised from."""
    usage, failed = (app.UsageError, *_loaded(USAGE_ERRORS)), _loaded(FAILED_RUNS)
    seen = exc
    while seen is not None:
        if isinstance(seen, usage):
            return USAGE_STATUS, seen
        if isinstance(seen, failed):
            return FAILED_RUN_STATUS, seen
        seen = seen.__cause__
    return None, exc


def wants_traceback():
    """--verbosity=1 or more, or HETPIPE_TRACEBACK=1: usage errors and failed runs show their traceback."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        return True
    return flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1


def run(main, program):
    """``absl.app.run(main)`` for the binary `program`, ending on errors by the rule above."""
    app.run(_reporting(main, program), flags_parser=lambda argv: _parse_flags(argv, program))


def _parse_flags(argv, program):
    """absl's parsing; a flag absl rejects (its validators included) is a usage error."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as exc:
        sys.stderr.write(f"{program}: error: {exc}\nPass --helpfull to see the flags.\n")
        sys.exit(USAGE_STATUS)


def _reporting(main, program):
    def reporting_main(argv):
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
            if type(reason).__name__ == "TaskLostError":
                # Threads may still sit in calls to the cluster until their timeouts, and
                # TensorFlow's teardown would wait for them: end now, the reason is out.
                sys.stderr.flush()
                os._exit(status)
            sys.exit(status)
    return reporting_main
