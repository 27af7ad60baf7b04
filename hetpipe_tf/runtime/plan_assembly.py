"""One plan assembly for ``HetPipeStrategy``, ``hetpipe-train`` and ``hetpipe plan``: the profile,
the optimizer's slots, the links, the plan, and the run's resolved configuration.

    request (what was asked: PlanRequest)
        -> assemble_plan(cluster, request, optimizer, profile, links) -> Plan (what was decided)
        -> PlanCuts.of_plan(plan), reconciled with a checkpoint's saved cuts
        -> resolved_config(request, plan, cuts, training) -> RunConfig (every field decided)

The same request, cluster, optimizer and profile give the same plan whoever assembles it: a
profile given (``profile=``, ``--profile``) is used as it is, so ``hetpipe plan`` with the flags of
a ``hetpipe-train`` run and its profile prints that run's plan. The links are the cluster
description's unless the caller measured them (:func:`calibrated_links`: the one-virtual-worker
run of ``hetpipe-train``, whose devices are its own process's). Nothing downstream replaces a
field of the resolved configuration.
"""
from collections.abc import Callable
from dataclasses import dataclass

import keras

from hetpipe_tf.planning.cluster import Cluster
from hetpipe_tf.planning.cost_model import LinkModel
from hetpipe_tf.planning.planner import Plan, plan
from hetpipe_tf.planning.profile import Profile
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime.checkpoint import PlanCuts
from hetpipe_tf.runtime.optimizers import slots_per_weight
from hetpipe_tf.runtime.profiler import Batch, measure_profile, measure_transfers, model_profile
from hetpipe_tf.runtime.run_config import LossArgument, LossWeightsArgument, MetricsArgument, RunConfig


@dataclass(frozen=True)
class Training:
    """What a run trains with beside its plan: the compiled model's optimizer, loss, metrics and loss
    weights (as given to ``compile``), and the run's own options: its timeout and what a lost worker's
    process does (see :class:`hetpipe_tf.runtime.run_config.RunConfig`)."""
    optimizer: keras.optimizers.Optimizer | str
    loss: LossArgument = None
    metrics: MetricsArgument = ()
    loss_weights: LossWeightsArgument = None
    timeout_s: float = 300.0
    on_worker_failure: str = "stop"


def loaded_profile(profile: Profile | str | None) -> Profile | None:
    """A Profile given as itself, as the path of its JSON (as ``Profile.to_json`` writes it), or None."""
    if profile is None or isinstance(profile, Profile):
        return profile
    try:
        with open(profile) as f:
            return Profile.from_json(f.read())
    except (OSError, TypeError, ValueError, KeyError) as e:
        raise ValueError(f"profile={profile!r}: give a Profile or the path of one's JSON (Profile.to_json), "
                         f"e.g. strategy.plan.profile of an earlier run; reading it failed: {e}") from None


def checked_profile(profile: Profile, model: keras.Model, batch_size: int) -> Profile:
    """`profile` if it describes `model`'s segments at `batch_size`, else a ValueError saying how it differs."""
    def shape(p: Profile) -> tuple[int, int, int, float]:  # totals, which a plan's coarsened profile keeps; Keras numbers layer names per process
        return p.batch_size, len(p.layer_names), p.total_weight_bytes, sum(p.forward_flops)

    own = model_profile(model, batch_size)  # as measured profiles count attention and lookups
    if shape(profile) != shape(own):
        raise ValueError(f"the profile given is of {profile.model} at batch {profile.batch_size} "
                         f"({len(profile.layer_names)} layer calls, {profile.total_weight_bytes} weight bytes), the "
                         f"model trained is {own.model} at batch {batch_size} ({len(own.layer_names)} layer calls, "
                         f"{own.total_weight_bytes} weight bytes): give the profile of this model and batch size, "
                         f"or profile=None to measure one")
    return profile


def workload_profile(model: keras.Model, batch_size: int, given: Profile | None, training: Training,
                     sample: Callable[[], tuple[Batch, Batch]] | None = None, stage_device: str | None = None) -> Profile:
    """What the planner knows of `model` at `batch_size`: the profile `given` (checked to be of this
    model and batch size), else one measured on this host (cached; §7) with `training`'s optimizer
    and loss, on a minibatch `sample()` gives (None: random data), its stages timed on `stage_device`
    (None: this process's CPU)."""
    if given is not None:
        return checked_profile(given, model, batch_size)
    return measure_profile(model, batch_size, loss=training.loss, optimizer=training.optimizer,
                           sample=sample() if sample else None, stage_device=stage_device)


def calibrated_links(cluster: Cluster, src: str, dst: str) -> LinkModel:
    """The cluster's links fitted to transfers measured between this process's TensorFlow devices
    `src` and `dst` (§7's synthetic transfer benchmark), for devices that all live on this host."""
    samples = measure_transfers(src, dst)
    return LinkModel().calibrated(cluster, intra_samples=samples, inter_samples=samples)


def assemble_plan(cluster: Cluster, request: PlanRequest, optimizer: keras.optimizers.Optimizer | str,
                  profile: Profile, links: LinkModel | None = None) -> Plan:
    """The plan of `request` on `cluster` for a model of `profile` trained by `optimizer` (whose slots
    per weight take memory on every stage), over `links` (None: the cluster description's)."""
    return plan(profile, cluster, request, links=links, optimizer_slots=slots_per_weight(optimizer))


def resolved_config(request: PlanRequest, planned: Plan, cuts: PlanCuts, training: Training) -> RunConfig:
    """The run's configuration, every field decided: Nm and the minibatch sizes of the run's cuts (the
    plan's, or a checkpoint's kept by :func:`hetpipe_tf.runtime.checkpoint.reconcile_cuts`), the
    placement the plan chose, and the request's staleness bound, schedule, scheme and dilation (None:
    calibrated by probe runs before training)."""
    return RunConfig(num_in_flight=cuts.num_in_flight, staleness_bound=request.staleness_bound,
                     schedule=request.schedule, sync=request.sync, placement=planned.placement,
                     optimizer=training.optimizer, loss=training.loss, metrics=training.metrics,
                     loss_weights=training.loss_weights, dilation=request.dilation, timeout_s=training.timeout_s,
                     minibatch_sizes=cuts.minibatch_sizes, on_worker_failure=training.on_worker_failure)
