"""What the user asks the planner for: one frozen :class:`PlanRequest` per run (pure).

A value flows one way: the request (what was asked, each field None where the planner is to
choose) -> the :class:`hetpipe_tf.planning.planner.Plan` (what the planner decided: Nm an
integer, the placement a name, the workers and their cuts) -> the run's resolved configuration
(:func:`hetpipe_tf.runtime.plan_assembly.resolved_config`). ``HetPipeStrategy``,
``hetpipe-train`` and ``hetpipe plan`` build their request the same way
(:func:`hetpipe_tf.cli.plan_flags.plan_request` for the two commands), so the plan that
``hetpipe plan`` prints is the plan that ``hetpipe-train`` with the same flags trains.
"""
from dataclasses import dataclass
from typing import Any

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.pipeline.schedule import PipelineSchedule, SyncScheme, check_combination
from hetpipe_tf.planning.allocation import POLICIES
from hetpipe_tf.planning.cluster import Device
from hetpipe_tf.sync.wsp import PLACEMENTS

#: What ``policy`` takes: the paper's allocations (§8.1) and the search over all of them.
REQUEST_POLICIES = POLICIES + ("auto",)
#: What ``method`` takes: the partitioner's integer program or its dynamic program.
METHODS = ("milp", "dp")
#: ``minibatch_sizes="proportional"``: a share of the global batch by predicted throughput.
PROPORTIONAL = "proportional"


class PlanRequestError(HetPipeUsageError, ValueError):
    """A request the planner cannot take: the message names the argument, what was given, what is
    allowed and the fix."""


def _count(name: str, value: int | None, least: int, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PlanRequestError(f"{name} must be {'None or ' if allow_none else ''}an integer >= {least}, "
                               f"got {value!r}")
    return value


def _sizes(value: str | tuple[int, ...] | None) -> str | tuple[int, ...] | None:
    if value is None or value == PROPORTIONAL:
        return value
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise PlanRequestError(f"unknown minibatch_sizes {value!r}; allowed: None (every worker the batch size), "
                               f"{PROPORTIONAL!r}, or one size per worker (a list of integers >= 1)")
    return tuple(value)  # each checked against its worker's memory by the planner


@dataclass(frozen=True)
class PlanRequest:
    """What one run asks the planner for; None where the planner chooses (checked when built).

    Args:
        policy: how devices are grouped into virtual workers: "np", "ed", "hd" (§8.1) or "auto".
        vw_size: devices per virtual worker (None: the policy's default, the smallest node's count).
        num_in_flight: Nm (§4), checked against every worker's Max_m; None: the planner's choice.
        staleness_bound: D of WSP (§5), s of SSP.
        placement: of the global weights on the servers (§8.1): "default" (layers round-robin) or
            "local" (each stage's layers on its node's server; equal workers only); None: local
            for ED, else default.
        schedule: the registered pipelining schedule (its name or the object).
        sync: the registered synchronisation scheme (its name or the object).
        minibatch_sizes: None (every worker the profile's batch size), "proportional" (a global
            batch of the batch size times the workers, split by predicted throughput within
            memory) or one size per worker.
        dilation: of the emulated devices; None: calibrated by probe runs before training, and
            planned at 1 (a dilation slows every emulated device alike, so the plan's choices
            stand).
        method: the partitioner, "milp" or "dp".
        max_num_in_flight: the largest Nm tried.
        workers: explicit virtual workers (tuples of the cluster's devices) instead of a policy.
        time_budget_s: policy "auto" only: stop trying allocations after this many seconds.

    Raises:
        PlanRequestError: an argument is not valid; the message names it and what is allowed.
    """
    policy: str = "ed"
    vw_size: int | None = None
    num_in_flight: int | None = None
    staleness_bound: int = 0
    placement: str | None = None
    schedule: str | PipelineSchedule = "hetpipe"
    sync: str | SyncScheme = "wsp"
    minibatch_sizes: str | tuple[int, ...] | None = None
    dilation: float | None = None
    method: str = "milp"
    max_num_in_flight: int = 16
    workers: tuple[tuple[Device, ...], ...] | None = None
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        policy = str(self.policy).lower()
        if policy not in REQUEST_POLICIES:
            raise PlanRequestError(f"unknown policy {self.policy!r}; allowed: {', '.join(REQUEST_POLICIES)}")
        put("policy", policy)
        _count("vw_size", self.vw_size, 1)
        _count("num_in_flight (Nm)", self.num_in_flight, 1)
        _count("staleness_bound (D)", self.staleness_bound, 0, allow_none=False)
        _count("max_num_in_flight", self.max_num_in_flight, 1, allow_none=False)
        if self.placement not in (None,) + PLACEMENTS:
            raise PlanRequestError(f"unknown placement {self.placement!r}; allowed: None (local for ED, else "
                                   f"default), {', '.join(map(repr, PLACEMENTS))}")
        schedule, sync = check_combination(self.schedule, self.sync)
        sync.checked_bound(self.staleness_bound)
        put("schedule", schedule)
        put("sync", sync)
        put("minibatch_sizes", _sizes(self.minibatch_sizes))
        if self.dilation is not None:
            if isinstance(self.dilation, bool) or not isinstance(self.dilation, (int, float)) or self.dilation < 1:
                raise PlanRequestError(f"dilation must be None (calibrated) or a number >= 1, got {self.dilation!r}")
            put("dilation", float(self.dilation))
        if self.method not in METHODS:
            raise PlanRequestError(f"unknown method {self.method!r}; allowed: {', '.join(METHODS)}")
        if self.workers is not None:
            put("workers", tuple(tuple(w) for w in self.workers))
        self._check_budget()

    def _check_budget(self) -> None:
        budget = self.time_budget_s
        if budget is not None and (not budget > 0 or self.policy != "auto" or self.workers is not None):
            raise PlanRequestError(f"time_budget_s bounds the search of policy 'auto' and is a number of seconds "
                                   f"> 0; got {budget!r} with policy {self.policy!r}"
                                   + (" and given workers" if self.workers else "")
                                   + ": give policy='auto' and a budget > 0, or time_budget_s=None")

    @classmethod
    def asked(cls, uneven_minibatches: bool | list[int] | tuple[int, ...] = False, **fields: Any) -> "PlanRequest":
        """The request of ``HetPipeStrategy``'s arguments (and of the commands' flags, which name them
        alike): `uneven_minibatches` as the strategy takes it (:func:`requested_sizes`), the other
        fields by their names.

        Args:
            uneven_minibatches: True, False or one minibatch size per virtual worker.
            **fields: the other fields of the request, by name.

        Returns:
            The request, checked.
        """
        return cls(minibatch_sizes=requested_sizes(uneven_minibatches), **fields)

    @property
    def placement_of_policy(self) -> str:
        """The placement planned for: the one asked, else local for ED (its workers are equal, so
        each stage's layers can stay on its node's server, §8.1) and default for the others and for
        given workers."""
        return self.placement or ("local" if self.policy == "ed" and self.workers is None else "default")

    @property
    def planned_dilation(self) -> float:
        """The dilation the cost model plans with: the one asked, else 1."""
        return self.dilation or 1.0


def requested_sizes(uneven_minibatches: bool | list[int] | tuple[int, ...]) -> str | tuple[int, ...] | None:
    """The ``minibatch_sizes`` of a request from an ``uneven_minibatches`` argument.

    Args:
        uneven_minibatches: True, False or a list of minibatch sizes (one per virtual worker).

    Returns:
        "proportional" for True, the sizes for a list, None (every worker the batch size) for
        False.

    Raises:
        PlanRequestError: `uneven_minibatches` is none of those.
    """
    if isinstance(uneven_minibatches, bool):
        return PROPORTIONAL if uneven_minibatches else None
    if isinstance(uneven_minibatches, (list, tuple)):
        return tuple(uneven_minibatches)
    raise PlanRequestError(f"uneven_minibatches must be True, False or a list of minibatch sizes (one per virtual "
                           f"worker), got {uneven_minibatches!r}")
