"""The messages between the chief and a virtual worker's process, as typed values both sides use.

The chief (:class:`hetpipe_tf.distributed.process_runner.ProcessRunner`) sends *orders*; the
worker's process (:mod:`hetpipe_tf.distributed.worker_process`) answers each with the order's
``answer`` type, or with :class:`Error` when it failed. While it trains it also sends the
*training messages* :class:`Started`, :class:`Done` (one per minibatch), then :class:`Finished`
or :class:`Failed`. The connection is ``multiprocessing.connection`` authenticated by the
cluster's key; messages are pickled, so every value here pickles.
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hetpipe_tf.pipeline.emulation import EmulationReport
from hetpipe_tf.pipeline.trace import Event

if TYPE_CHECKING:  # a worker's process imports TensorFlow only once it has started its heartbeat
    import numpy as np

    from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
    from hetpipe_tf.runtime.virtual_worker import Dilation
    from hetpipe_tf.sync.parameter_server import ServerLayout


#: A worker's optimizer state per model variable (:func:`hetpipe_tf.runtime.checkpoint.stage_optimizer_state`).
OptimizerStateDict = dict[str, Any]

#: A dataset as :func:`hetpipe_tf.distributed.dataset_transfer.dataset_to_bytes` sends it: (graph, element spec).
DatasetBytes = tuple[bytes, bytes]


def job_name(worker: int) -> str:
    """The TensorFlow job of the process that drives virtual worker `worker`."""
    return f"vw{worker}"


def local_device(worker: int, index: int) -> str:
    """The TensorFlow name of logical CPU `index` of the process driving `worker`."""
    return f"/job:{job_name(worker)}/replica:0/task:0/device:CPU:{index}"



# The worker's side ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """The first message of a worker's process: which virtual worker it drives."""
    worker: int


@dataclass(frozen=True)
class Ready:
    """A :class:`Job` is built: the minibatch size and the worker's description."""
    batch_size: int
    description: str


@dataclass(frozen=True)
class Probed:
    """A :class:`Probe`'s :class:`hetpipe_tf.pipeline.emulation.EmulationReport`."""
    report: EmulationReport


@dataclass(frozen=True)
class Drained:
    """Every stage took the global weights."""


@dataclass(frozen=True)
class OptimizerState:
    """The worker's optimizer state per model variable
    (:func:`hetpipe_tf.runtime.checkpoint.stage_optimizer_state`)."""
    state: OptimizerStateDict


@dataclass(frozen=True)
class OptimizerStateSet:
    """A :class:`SetOptimizerState` was applied."""


@dataclass(frozen=True)
class Stats:
    """The worker's :meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.stats`."""
    stats: list[dict[str, Any]]


@dataclass(frozen=True)
class Report:
    """The worker's emulation report (None without emulated devices)."""
    report: EmulationReport | None


@dataclass(frozen=True)
class Error:
    """An order failed: the exception's class name (``NonFiniteError`` with the minibatch's logs,
    for ``TerminateOnNaN``), its message."""
    kind: str
    message: str
    logs: dict[str, float] | None = None


@dataclass(frozen=True)
class Started:
    """Training started (the worker was built and calibrated) at `time` (``time.perf_counter()``)."""
    time: float


@dataclass(frozen=True)
class Done:
    """A minibatch's update is in: its logs (floats), when it completed, its id in the worker's
    pipeline (as the executor's on_minibatch_done gives it) and, when its :class:`Job` asked for
    them, the worker's seconds of device compute per stage in this train so far
    (:meth:`hetpipe_tf.runtime.wsp_runner.BoundWorkers.stage_compute_s`; else empty)."""
    logs: dict[str, float]
    time: float
    minibatch: int = 0
    compute: tuple[float, ...] = ()


@dataclass(frozen=True)
class Finished:
    """Training ended: the trace's origin and events, or None when not traced."""
    trace: tuple[float | None, list[Event]] | None = None


@dataclass(frozen=True)
class Failed:
    """Training failed (as :class:`Error`)."""
    kind: str
    message: str
    logs: dict[str, float] | None = None


@dataclass(frozen=True)
class Lost:
    """The chief's own message when a worker's connection ended: its process is gone."""
    kind: str
    message: str
    logs: dict[str, float] | None = None


#: What a worker's process sends while it trains (not an answer to an order).
TRAINING_MESSAGES = (Started, Done, Finished, Failed)


# The chief's orders ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """Build virtual worker `worker`: `spec` (a :class:`hetpipe_tf.runtime.run_config.WorkerSpec`,
    its devices named as its process names them) of the run configured by `config` (a
    :class:`hetpipe_tf.runtime.run_config.RunConfig`), the model (its JSON and weights), the
    servers to attach to (:meth:`hetpipe_tf.sync.parameter_server.ParameterServers.layout`), its
    shard of the data (:mod:`hetpipe_tf.distributed.dataset_transfer`) and whether each
    :class:`Done` carries the stages' compute (`stage_compute`: a run that re-plans watches it),
    for as long as the process runs."""
    worker: int
    spec: "WorkerSpec"
    config: "RunConfig"
    model_json: str
    weights: "list[np.ndarray]" = field(repr=False)
    servers: "ServerLayout"
    data: DatasetBytes = field(repr=False)
    stage_compute: bool = False
    answer = Ready


@dataclass(frozen=True)
class Rebuild:
    """Build the virtual worker again as `spec` (another plan's cuts of the same devices) under
    `config` (its Nm and placement), from `weights` (the run's global weights, drained) and
    `optimizer_state` (the worker's, per model variable), attached to `servers` (the new plan's);
    the process keeps its model, its data where it stands, and the run's dilation. With `keep`
    (the same stages, an Nm its stashes hold) the worker keeps its stages as built, their traced
    calls included, and they take the weights and the optimizer state."""
    spec: "WorkerSpec"
    config: "RunConfig"
    weights: "list[np.ndarray]" = field(repr=False)
    servers: "ServerLayout"
    optimizer_state: OptimizerStateDict | None = field(repr=False)
    keep: bool = False
    answer = Ready


@dataclass(frozen=True)
class Probe:
    """One emulation probe at `dilation`, `workers` probing at once."""
    dilation: float
    workers: int
    answer = Probed


@dataclass(frozen=True)
class Train:
    """Train `steps` minibatches of `data` (None: where the last train ended) at the run's
    `dilation`; answered by the training messages, not by an answer."""
    data: DatasetBytes | None
    steps: int
    dilation: "Dilation"
    trace: bool
    answer = None


@dataclass(frozen=True)
class Drain:
    """After a train: every stage takes the global weights."""
    answer = Drained


@dataclass(frozen=True)
class GetOptimizerState:
    answer = OptimizerState


@dataclass(frozen=True)
class SetOptimizerState:
    state: OptimizerStateDict | None
    answer = OptimizerStateSet


@dataclass(frozen=True)
class Stop:
    """Admit no more minibatches (unanswered)."""
    answer = None


@dataclass(frozen=True)
class Abort:
    """Stop every stage now (unanswered)."""
    answer = None


@dataclass(frozen=True)
class SetLearningRate:
    """Every stage's optimizer takes this learning rate (unanswered)."""
    value: float
    answer = None


@dataclass(frozen=True)
class GetStats:
    """The worker's stats over what came after `since` (``time.perf_counter()`` of this host)."""
    since: float | None = None

    answer = Stats


@dataclass(frozen=True)
class GetReport:
    answer = Report
