"""Deciding whether a run switches to another plan once devices slowed for good (pure: planner
and simulator, no TensorFlow).

**Plan again.** The planner plans the run's request again (:func:`hetpipe_tf.planning.planner.plan`)
with every slowed device at its measured speed (a copy of its device type at that speed), for the
run's virtual workers as they are: the same devices in each worker (so each keeps its process,
its tasks and its shard of the data), new cuts and Nm, at the run's dilation. The allocation
stays: a run that changes its workers' devices would re-divide its data and its optimizer state
among other workers (:func:`hetpipe_tf.runtime.checkpoint.for_workers`), which this does not do.

**Predict.** Both plans, the current one (its cuts and Nm, its devices at their measured speeds)
and the new one, are predicted by the same simulation (:func:`hetpipe_tf.planning.planner.predict`,
the simulator's run of their schedules under the run's synchronisation): images per second at
the run's dilation.

**Pay back.** Over the images still to train, the new plan saves
``remaining / current - remaining / new`` seconds; the switch costs `switch_cost_s` (a drain to a
wave boundary and the rebuild of the workers, as the run measured its own build). The run
switches when the new plan is at least `min_gain` faster (10 %) *and* saves at least `payback`
times (2x) what the switch costs. Both margins are hysteresis: a plan about as good, or a gain
that the switch's cost would eat if the prediction erred by half, leaves the run as it is. A
decision either way updates what the watch expects of the slowed devices
(:meth:`hetpipe_tf.runtime.replan.watch.StageWatch.known`), so the same slowdown is not
decided twice, and a switched run's new plan already counts them at their measured speed:
no flapping between two plans.
"""
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe_tf.planning.cluster import Device
from hetpipe_tf.planning.cost_model import CostModel, LinkModel, link_flows
from hetpipe_tf.planning.partitioner import partition_of
from hetpipe_tf.planning.planner import Plan, PlanError, plan, predict
from hetpipe_tf.planning.request import PlanRequest
from hetpipe_tf.runtime.replan.watch import Slowed


def with_speeds(devices: Sequence[Device], speeds: Mapping[str, float]) -> tuple[Device, ...]:
    """`devices` with each one named in `speeds` (device name -> speed relative to the host) at
    that speed: a copy of its emulated device type, named after it and the device."""
    out = []
    for d in devices:
        if d.name not in speeds:
            out.append(d)
            continue
        if not d.type.emulated:
            raise PlanError(f"device {d.name} is of type {d.type.name!r}, not emulated: re-planning re-plans with "
                              f"the measured speeds of emulated devices only")
        speed = float(speeds[d.name])
        kind = dataclasses.replace(d.type, name=f"{d.type.name}@{d.name}", emulated_speed=speed,
                                   label=f"{d.type.label} measured at speed {speed:.3g}")
        out.append(dataclasses.replace(d, type=kind))
    return tuple(out)


def nominal_devices(p: Plan, worker: int) -> tuple[Device, ...]:
    """Worker `worker`'s devices of plan `p` in stage order as its cluster describes them (a re-plan's
    devices carry their measured speeds: what serves them is the cluster's device, at its own)."""
    own = {d.name: d for d in p.cluster.devices()}
    return tuple(own[d.name] for d in p.workers[worker].devices)


def predicted_images_per_s(p: Plan, speeds: Mapping[str, float], dilation: float, optimizer_slots: int = 1,
                           links: LinkModel | None = None) -> float:
    """Images/s of plan `p` (its workers' devices, cuts and Nm) with the devices in `speeds` at those
    speeds, at `dilation`, by the simulation of its schedules (:func:`predict`)."""
    workers = [with_speeds(w.devices, speeds) for w in p.workers]
    model = CostModel(p.profile, p.cluster, links=links or LinkModel(), dilation=dilation,
                      optimizer_slots=optimizer_slots, schedule=p.schedule,
                      sync=p.sync, analytic=p.analytic,
                      link_flows=link_flows(workers))
    parts = [partition_of(model, devices, w.partition.boundaries, p.num_in_flight)
             for devices, w in zip(workers, p.workers)]
    _, per = predict(model, parts, p.num_in_flight, p.staleness_bound, p.placement)
    return float(sum(rate * size for rate, size in zip(per, p.sizes)))


def replanned(p: Plan, request: PlanRequest, speeds: Mapping[str, float], dilation: float,
              optimizer_slots: int = 1, links: LinkModel | None = None) -> Plan:
    """The plan of `request` for `p`'s virtual workers (the same devices each) with the devices of
    `speeds` at those speeds, at `dilation` (see the module docstring)."""
    if p.minibatch_sizes:
        raise PlanError(f"the run trains uneven minibatches {list(p.minibatch_sizes)}: re-planning keeps every "
                          f"worker's shard of the data and re-plans even minibatches only; give "
                          f"uneven_minibatches=False or replan='off'")
    workers = tuple(with_speeds(w.devices, speeds) for w in p.workers)
    asked = dataclasses.replace(request, workers=workers, time_budget_s=None, dilation=dilation,
                                placement=p.placement, minibatch_sizes=None)
    try:
        return plan(p.profile, p.cluster, asked, links=links, optimizer_slots=optimizer_slots)
    except PlanError:
        if p.placement == "default":
            raise
        # local placement needs equal workers, which a slowed device makes unequal
        return plan(p.profile, p.cluster, dataclasses.replace(asked, placement="default"), links=links,
                    optimizer_slots=optimizer_slots)


@dataclass(frozen=True)
class Decision:
    """What a trigger decided, and its figures: the slowed devices, the current and the new plan's
    predicted images/s (at measured speeds, the run's dilation), the images still to train, the
    seconds the new plan would save over them and the switch's predicted cost. `plan`: the new
    plan (None when planning failed)."""
    switch: bool
    reason: str
    slowed: tuple[Slowed, ...]
    current_images_per_s: float
    new_images_per_s: float
    remaining_images: float
    gain_s: float
    cost_s: float
    plan: Plan | None = None

    def as_dict(self) -> dict[str, Any]:
        """The decision's figures as JSON (not the plan: its cuts and Nm when it switches)."""
        out: dict[str, Any] = {
            "switch": self.switch, "reason": self.reason,
            "slowed": [{"device": s.device, "worker": s.stage[0], "stage": s.stage[1],
                        "planned_speed": s.planned_speed, "measured_speed": round(s.measured_speed, 4),
                        "deviation": round(s.deviation, 3), "waves": s.waves} for s in self.slowed],
            "current_images_per_s": round(self.current_images_per_s, 3),
            "new_images_per_s": round(self.new_images_per_s, 3), "remaining_images": self.remaining_images,
            "gain_s": round(self.gain_s, 3), "cost_s": round(self.cost_s, 3)}
        if self.plan is not None and self.switch:
            out["num_in_flight"] = self.plan.num_in_flight
            out["boundaries"] = [list(self.plan.node_boundaries(w)) for w in range(len(self.plan.workers))]
        return out


@dataclass(frozen=True)
class SwitchRule:
    """The margins of :func:`decide`: the least relative gain of the new plan, and how many times
    its saving must cover the switch's cost."""
    min_gain: float = 0.1
    payback: float = 2.0


def decide(current: Plan, request: PlanRequest, slowed: Sequence[Slowed], known: Mapping[str, float],
           remaining_images: float, switch_cost_s: float, dilation: float, optimizer_slots: int = 1,
           rule: SwitchRule = SwitchRule(), links: LinkModel | None = None) -> Decision:
    """Whether the run of `current` switches to a new plan now that `slowed` devices run at their
    measured speeds (`known`: speeds measured before, which stay), with `remaining_images` still to
    train and a switch that costs `switch_cost_s` (see the module docstring)."""
    speeds = dict(known)
    speeds.update({s.device: s.measured_speed for s in slowed})
    now = predicted_images_per_s(current, speeds, dilation, optimizer_slots, links)
    try:
        new_plan = replanned(current, request, speeds, dilation, optimizer_slots, links)
    except PlanError as e:
        return Decision(False, f"no plan for the measured speeds: {str(e).splitlines()[-1].strip()}", tuple(slowed),
                        now, 0.0, remaining_images, 0.0, switch_cost_s)
    new = predicted_images_per_s(new_plan, speeds, dilation, optimizer_slots, links)
    gain = remaining_images / now - remaining_images / new if now > 0 and new > 0 else 0.0
    same = all(new_plan.node_boundaries(w) == current.node_boundaries(w) for w in range(len(current.workers))) \
        and new_plan.num_in_flight == current.num_in_flight and new_plan.placement == current.placement
    if same:
        why, switch = "the measured speeds give the same cuts, Nm and placement", False
    elif new < (1 + rule.min_gain) * now:
        why, switch = f"the new plan gains less than {rule.min_gain:.0%} ({new:.1f} vs {now:.1f} images/s)", False
    elif gain < rule.payback * switch_cost_s:
        why, switch = (f"the new plan would save {gain:.1f} s over the {remaining_images:g} images left, less than "
                       f"{rule.payback:g}x the switch's {switch_cost_s:.1f} s"), False
    else:
        why, switch = (f"the new plan gains {new / now - 1:.0%} and saves {gain:.1f} s over the "
                       f"{remaining_images:g} images left, for a switch of {switch_cost_s:.1f} s"), True
    return Decision(switch, why, tuple(slowed), now, new, remaining_images, gain, switch_cost_s, new_plan)
