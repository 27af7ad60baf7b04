"""hetpipe_tf: HetPipe (USENIX ATC 2020) for TensorFlow.

A Keras model is cut into stages placed on several, possibly different, devices and
trained as a pipeline with Nm minibatches in flight (a virtual worker, HetPipe §3-4);
several virtual workers train together under Wave Synchronous Parallel through
parameter servers (§5), planned and launched by :class:`HetPipeStrategy`.

The public API is below. Names load on first use, so that the pure modules
(``schedule``, ``simulator``, ``emulation``, ``model_graph``, ``partitioner``) import
without TensorFlow.

TensorFlow is not a hard requirement of the package, so that installing hetpipe_tf never
replaces a GPU build of TensorFlow by the CPU wheel: ``pip install '.[cpu]'`` or
``'.[gpu]'`` brings one. Without any, ``import hetpipe_tf`` says in one line what to
install, and every name that needs TensorFlow raises ImportError with that line.
"""
import importlib
import importlib.util
import sys
from typing import Any

TENSORFLOW_NEEDED = ("hetpipe_tf needs TensorFlow 2.21 with Keras 3, and none is installed: "
                     "pip install tensorflow-cpu==2.21.0 (or tensorflow[and-cuda]==2.21.0 for GPUs)")


def _tensorflow_missing() -> bool:
    try:
        return importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None
    except (ImportError, ValueError):  # an import hook refused it, or a broken install
        return True


if _tensorflow_missing():
    print(TENSORFLOW_NEEDED, file=sys.stderr)

_EXPORTS = {
    # Training
    "HetPipeStrategy": "hetpipe_tf.api.strategy",
    "VirtualWorker": "hetpipe_tf.runtime.virtual_worker",
    "WSPRunner": "hetpipe_tf.runtime.wsp_runner",
    "WorkerSpec": "hetpipe_tf.runtime.run_config",
    "RunConfig": "hetpipe_tf.runtime.run_config",
    "PipelineTensorBoard": "hetpipe_tf.api.callbacks",
    "WSPTensorBoard": "hetpipe_tf.api.callbacks",
    # Stages
    "split_model": "hetpipe_tf.runtime.stage_rewrite",
    "describe_model": "hetpipe_tf.runtime.stage_rewrite",
    "StagedModel": "hetpipe_tf.runtime.stage_rewrite",
    "trace_model": "hetpipe_tf.runtime.subclass_trace",
    "ModelGraph": "hetpipe_tf.planning.model_graph",
    "balanced_boundaries": "hetpipe_tf.planning.partitioner",
    # Uneven minibatches per virtual worker (beyond the paper)
    "proportional_sizes": "hetpipe_tf.planning.uneven",
    "push_weights": "hetpipe_tf.planning.uneven",
    "worker_shards": "hetpipe_tf.runtime.worker_data",
    # Schedules and simulation
    "hetpipe_schedule": "hetpipe_tf.pipeline.hetpipe",
    "TaylorPipeSchedule": "hetpipe_tf.pipeline.taylorpipe",
    "HetPipeTaylorSchedule": "hetpipe_tf.pipeline.taylorpipe",
    "Schedule": "hetpipe_tf.pipeline.schedule",
    # The seams: a schedule and a synchronisation scheme are registered objects
    "PipelineSchedule": "hetpipe_tf.pipeline.schedule",
    "SyncScheme": "hetpipe_tf.pipeline.schedule",
    "register_schedule": "hetpipe_tf.pipeline.schedule",
    "register_sync": "hetpipe_tf.pipeline.schedule",
    "simulate": "hetpipe_tf.pipeline.simulator",
    # Devices and emulation
    "DeviceSpec": "hetpipe_tf.planning.devices",
    "parse_devices": "hetpipe_tf.planning.devices",
    "configure_tensorflow_devices": "hetpipe_tf.runtime.logical_devices",
    "Pacer": "hetpipe_tf.pipeline.emulation",
    "MemoryAccount": "hetpipe_tf.pipeline.emulation",
    "EmulationReport": "hetpipe_tf.pipeline.emulation",
    # Parameter servers and clusters (§5, §8.1)
    "ParameterServers": "hetpipe_tf.sync.parameter_server",
    "PipeSGD": "hetpipe_tf.sync.pipe_sgd",
    "LocalCluster": "hetpipe_tf.distributed.launch",
    "TFConfigCluster": "hetpipe_tf.distributed.launch",
    # Custom ops
    "WeightStash": "hetpipe_tf.ops.weight_stash",
    "WspClock": "hetpipe_tf.ops.wsp_clock",
    # Errors: the root and its two branches (hetpipe_tf.errors), then every error by module
    "HetPipeError": "hetpipe_tf.errors",
    "HetPipeUsageError": "hetpipe_tf.errors",
    "HetPipeRunError": "hetpipe_tf.errors",
    "PipelineError": "hetpipe_tf.pipeline.executor",
    "UnknownInstructionError": "hetpipe_tf.pipeline.executor",
    "PipelineAborted": "hetpipe_tf.pipeline.mailbox",
    "DuplicateMessageError": "hetpipe_tf.pipeline.mailbox",
    "ScheduleDeadlock": "hetpipe_tf.pipeline.simulator",
    "DeviceOutOfMemoryError": "hetpipe_tf.pipeline.emulation",
    "StalenessViolation": "hetpipe_tf.sync.staleness",
    "DeviceSpecError": "hetpipe_tf.planning.devices",
    "ClusterError": "hetpipe_tf.planning.cluster",
    "AllocationError": "hetpipe_tf.planning.allocation",
    "SharedLayerError": "hetpipe_tf.planning.model_graph",
    "PartitionError": "hetpipe_tf.planning.model_graph",
    "InfeasiblePartitionError": "hetpipe_tf.planning.partitioner",
    "DataParallelError": "hetpipe_tf.planning.data_parallel",
    "UnevenMinibatchError": "hetpipe_tf.planning.uneven",
    "PlanError": "hetpipe_tf.planning.planner",
    "PlanRequestError": "hetpipe_tf.planning.request",
    "NonFiniteError": "hetpipe_tf.runtime.stage.verdicts",
    "UnsupportedModelError": "hetpipe_tf.runtime.stage_rewrite",
    "UntraceableModelError": "hetpipe_tf.runtime.subclass_trace",
    "UnsendableModelError": "hetpipe_tf.runtime.model_transport",
    "UnsupportedOptimizerError": "hetpipe_tf.runtime.optimizers",
    "CompressionDtypeError": "hetpipe_tf.sync.pipe_sgd",
    "ClusterStartError": "hetpipe_tf.distributed.starter",
    "ClusterConfigError": "hetpipe_tf.distributed.launch",
    "ResolverError": "hetpipe_tf.distributed.resolvers",
    "TaskLostError": "hetpipe_tf.distributed.heartbeat",
    "WorkerProcessError": "hetpipe_tf.distributed.process_runner",
    "DatasetTransferError": "hetpipe_tf.distributed.dataset_transfer",
    "NetLinksError": "hetpipe_tf.distributed.netlinks",
    "CgroupError": "hetpipe_tf.distributed.cgroups",
    "OpsLibraryError": "hetpipe_tf.ops.loader",
    "DatasetNotFoundError": "hetpipe_tf.data.datasets",
    "DatasetOptionError": "hetpipe_tf.data.datasets",
    "ModelInputError": "hetpipe_tf.cli.models",
    "TraceFileError": "hetpipe_tf.cli.plots",
    "PlottingUnavailableError": "hetpipe_tf.cli.plots",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hetpipe_tf' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("tensorflow", "keras"):
            raise ImportError(f"{TENSORFLOW_NEEDED} (hetpipe_tf.{name} needs {exc.name})") from exc
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
