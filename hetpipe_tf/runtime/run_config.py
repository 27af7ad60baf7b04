"""The configuration of one run, validated once and passed whole.

A :class:`RunConfig` says how a run trains: Nm, the staleness bound, the schedule and the
synchronisation scheme, where the global weights live, the optimizer and the compiled loss and
metrics, the emulation's dilation, the timeouts, the minibatch sizes and what happens to a lost
worker. It is built once: a ``VirtualWorker`` from its arguments, a run of several (``HetPipeStrategy``,
``hetpipe-train --cluster``) from its plan (:func:`hetpipe_tf.runtime.plan_assembly.resolved_config`:
every field decided, Nm an integer); every check is made when it is built (each error names the
argument), and it is handed whole to the virtual workers, the runners and, pickled, to every
worker process. A :class:`WorkerSpec` says where one virtual worker runs.
"""
import dataclasses
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras

from hetpipe_tf.pipeline.schedule import PipelineSchedule, SyncScheme, check_combination, check_worker_update
from hetpipe_tf.planning.devices import DeviceSpec
from hetpipe_tf.runtime.optimizers import check_name, check_optimizer, update_rule_of
from hetpipe_tf.runtime.update_terms import UpdateRule
from hetpipe_tf.sync.wsp import PLACEMENTS

#: What a run does when a virtual worker's process is lost (:mod:`hetpipe_tf.distributed.process_runner`).
ON_WORKER_FAILURE = ("stop", "continue")
#: What ``keras.Model.compile`` takes as `loss`: a name, a function or ``keras.losses.Loss``, a
#: list or dict of them per output, or None.
LossArgument = str | Callable[..., Any] | Sequence[Any] | Mapping[str, Any] | None
#: What ``keras.Model.compile`` takes as `metrics`: names or ``keras.metrics.Metric`` objects, a
#: list, or a list or dict of them per output.
MetricsArgument = Sequence[Any] | Mapping[str, Any] | None
#: What ``keras.Model.compile`` takes as `loss_weights`: one per output, as a list or dict.
LossWeightsArgument = Sequence[float] | Mapping[str, float] | None


def _positive_int(name: str, value: Any, allow_none: bool = False) -> Any:
    if allow_none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}an integer >= 1, got {value!r}")
    return value


def checked_timeout(timeout_s: float) -> float:
    """`timeout_s` as seconds, a ValueError unless > 0."""
    if not float(timeout_s) > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    return float(timeout_s)


def checked_on_worker_failure(on_worker_failure: str) -> str:
    """`on_worker_failure`, a ValueError naming the choices unless it is one of ON_WORKER_FAILURE."""
    if on_worker_failure not in ON_WORKER_FAILURE:
        raise ValueError(f"unknown on_worker_failure {on_worker_failure!r}; allowed: "
                         f"{', '.join(map(repr, ON_WORKER_FAILURE))}")
    return on_worker_failure


@dataclass(frozen=True)
class RunConfig:
    """How one run trains (see the module docstring). The fields are the checked values:

    num_in_flight: Nm, the minibatches in each virtual worker's pipeline (§4); None: each worker's
      number of stages.
    staleness_bound: D of WSP (§5), s of SSP (BSP and ASP take 0); the scheme's
      ``checked_bound`` says what its pulls keep.
    schedule, sync: the registered :class:`hetpipe_tf.pipeline.schedule.PipelineSchedule` and
      :class:`hetpipe_tf.pipeline.schedule.SyncScheme` (given by name or as objects).
    placement: of the global weights on the parameter servers (§8.1): "default" or "local".
    optimizer: the Keras optimizer every stage copies; loss, metrics, loss_weights: as given to
      ``keras.Model.compile`` (:mod:`hetpipe_tf.runtime.loss_head` gives them Keras's meaning).
    dilation: of the emulated devices; None: calibrated by probe runs before training.
    timeout_s: the longest a stage, a pull or a worker's process may go without progress.
    minibatch_sizes: each worker's minibatch size, uneven (None: the data's batch size).
    on_worker_failure: "stop" or "continue" (see ``HetPipeStrategy``).
    record_provenance: record which updates each weight version held (for the staleness checks).
    single_threaded_stages: each stage's kernels run one after another on its own thread.
    """
    num_in_flight: int | None = None
    staleness_bound: int = 0
    schedule: PipelineSchedule | str = "hetpipe"
    sync: SyncScheme | str = "wsp"
    placement: str = "default"
    optimizer: keras.optimizers.Optimizer | str = "sgd"
    loss: LossArgument = None
    metrics: MetricsArgument = ()
    loss_weights: LossWeightsArgument = None
    dilation: float | None = None
    timeout_s: float = 300.0
    minibatch_sizes: tuple[int, ...] | None = None
    on_worker_failure: str = "stop"
    record_provenance: bool = False
    single_threaded_stages: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("num_in_flight", _positive_int("num_in_flight (Nm)", self.num_in_flight, allow_none=True))
        schedule, sync = check_combination(self.schedule, self.sync)
        put("schedule", schedule)
        put("sync", sync)
        if isinstance(self.staleness_bound, bool) or not isinstance(self.staleness_bound, int) or \
                self.staleness_bound < 0:
            raise ValueError(f"staleness_bound (D) must be an integer >= 0, got {self.staleness_bound!r}")
        sync.checked_bound(self.staleness_bound)  # the scheme's own rule (BSP and ASP take 0 only)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}; allowed: {', '.join(PLACEMENTS)}")
        # A name stays a name until a stage makes its copy: an optimizer made here would start
        # TensorFlow's runtime before the devices of a strategy's cluster are configured.
        put("optimizer", check_name(self.optimizer) if isinstance(self.optimizer, str)
            else check_optimizer(self.optimizer))
        if self.dilation is not None:
            if not float(self.dilation) >= 1.0:
                raise ValueError(f"dilation must be None (calibrated) or a number >= 1, got {self.dilation!r}")
            put("dilation", float(self.dilation))
        put("timeout_s", checked_timeout(self.timeout_s))
        if self.minibatch_sizes is not None:
            put("minibatch_sizes", tuple(_positive_int("each of minibatch_sizes", int(b)) for b in self.minibatch_sizes))
        checked_on_worker_failure(self.on_worker_failure)
        if self.update_rule:
            check_worker_update(schedule, True, "global clipping and loss scaling")

    @property
    def update_rule(self) -> UpdateRule:
        """What every update takes from every stage of a virtual worker: the optimizer's global
        clip norm and loss scaling (:mod:`hetpipe_tf.runtime.update_terms`)."""
        return update_rule_of(self.optimizer)

    def replace(self, **changes: Any) -> "RunConfig":
        """This configuration with `changes`, checked again."""
        return dataclasses.replace(self, **changes)

    def same_run(self, other: "RunConfig") -> bool:
        """Whether `other` configures the same run but for what a plan decides.

        Returns:
            True when the two differ at most in Nm, the placement of the global weights and the
            dilation.
        """
        return other.replace(num_in_flight=self.num_in_flight, placement=self.placement,
                             dilation=self.dilation) == self

    # Pickled for a worker process: the optimizer as Keras serializes it (a name as it is); the
    # compiled loss and metrics as they are (they must be importable there, as for any pickled object).
    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not isinstance(self.optimizer, str):
            state["optimizer"] = keras.optimizers.serialize(self.optimizer)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            revived = name == "optimizer" and not isinstance(value, str)
            object.__setattr__(self, name, keras.optimizers.deserialize(value) if revived else value)

    def check_picklable(self) -> None:
        """Raises a ValueError naming what cannot reach a worker process (before any starts)."""
        for name in ("loss", "metrics", "loss_weights", "schedule", "sync"):
            try:
                pickle.dumps(getattr(self, name))
            except Exception as e:  # noqa: BLE001 - any pickling failure, said as such
                raise ValueError(f"{name}={getattr(self, name)!r} cannot be sent to a virtual worker's process "
                                 f"({type(e).__name__}: {e}): give it by name or as an importable object") from None


@dataclass(frozen=True)
class WorkerSpec:
    """One virtual worker of a run.

    Args:
        devices: its devices, DeviceSpecs or a string (:func:`hetpipe_tf.planning.devices.parse_devices`).
        tf_devices: the TensorFlow device of each stage (None: this process's).
        boundaries: its stage boundaries (None: balanced).
        stage_servers: the parameter server on each stage's node (for ``local`` placement).
        slowdown: an emulated slowdown, minibatch id -> factor >= 1 (see
            :class:`hetpipe_tf.pipeline.emulation.Pacer`), or a tuple of such (or None), one per device
            in stage order.
        references: the emulation's references, per stage the (forward, backward) seconds its
            paces scale from (None: measured before training).
    """
    devices: Sequence[DeviceSpec] | str
    tf_devices: tuple[str, ...] | None = None
    boundaries: tuple[int, ...] | None = None
    stage_servers: tuple[str, ...] | None = None
    slowdown: Callable[[int], float] | tuple[Callable[[int], float] | None, ...] | None = None
    references: Sequence[tuple[float, float]] | None = None

    def same_stages(self, other: "WorkerSpec") -> bool:
        """Whether `other` builds the same stages as this spec.

        Returns:
            True when the two have the same devices, cuts, slowdowns and emulation references (the
            servers of their nodes aside, which a plan's placement decides).
        """
        return dataclasses.replace(self, stage_servers=None) == dataclasses.replace(other, stage_servers=None)
