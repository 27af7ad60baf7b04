"""Watching a run's stages against its plan: when a device counts as slowed for good (pure).

Every stage of every virtual worker reports, per wave (Nm minibatches, §5), the seconds its
device computed per minibatch in that wave (its passes' times on the device: for an emulated
device the paced time, :mod:`hetpipe_tf.pipeline.emulation`). The plan predicted that stage's
forward and backward time at dilation 1; the watch expects it times the run's dilation.

**Host factor.** A plan is made from a profile measured before training, which this host need
not reproduce exactly (other work, the profile's own error). The watch therefore compares each
stage's ratio measured / expected with the host's: the median over every stage of that ratio in
the first `baseline_waves` waves it watched. A stage's *deviation* is its ratio over the host's.

**Persistence rule.** A device counts as slowed for good when its stage's deviation is at least
`threshold` (1.5: half as slow again) in each of `window_waves` consecutive waves of its worker
(12). A wave under the threshold starts the count again. The device's measured speed is then
its planned speed over the median deviation of those waves.

**Why transient stragglers never meet it.** A straggler that slows a worker for a wave now and
then (``benchmarks/wsp_straggler.py``'s transient scenario: each worker 2x slower in a wave with
probability 0.3, independently) would have to hit the same worker in 12 waves in a row: 0.3^12
(about 5e-7) per wave, a few in ten thousand over that benchmark's four workers of 100 waves;
its seeded pattern's longest such run is 5 waves (tested). WSP with D > 0 is the remedy for
those (§5); a re-plan is for a slowdown that WSP cannot absorb, one that lasts.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import median

#: A stage of the run: (virtual worker, stage index).
StageKey = tuple[int, int]


@dataclass(frozen=True)
class WatchRule:
    """How much slower (`threshold`, measured over expected, relative to the host) for how many
    consecutive waves (`window_waves`) a stage must be to count as slowed for good, and over
    how many first waves the host's factor is taken (`baseline_waves`)."""
    threshold: float = 1.5
    window_waves: int = 12
    baseline_waves: int = 2

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"a watch's threshold must be > 1 (a factor of slowdown), got {self.threshold!r}")
        for name in ("window_waves", "baseline_waves"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a watch's {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Slowed:
    """A device found slowed for good: its stage, its name, its planned and measured speed, the
    median deviation that gave it and the waves it lasted."""
    stage: StageKey
    device: str
    planned_speed: float
    measured_speed: float
    deviation: float
    waves: int


@dataclass
class _Run:
    deviations: list[float] = field(default_factory=list)


class StageWatch:
    """The watch of one plan's stages (see the module docstring).

    Args:
      expected: per stage, the seconds per minibatch its device computes by the plan, already
        scaled to the run's dilation.
      devices: per stage, its device's name and planned speed.
      rule: the :class:`WatchRule`.
      host_factor: the host's factor (None: taken from the first waves watched); a watch of a new
        plan keeps its predecessor's.
    """

    def __init__(self, expected: Mapping[StageKey, float], devices: Mapping[StageKey, tuple[str, float]],
                 rule: WatchRule = WatchRule(), host_factor: float | None = None) -> None:
        if set(expected) != set(devices):
            raise ValueError(f"a watch needs the device of every stage it expects: stages {sorted(expected)}, "
                             f"devices of {sorted(devices)}")
        bad = {k: v for k, v in expected.items() if not v > 0}
        if bad:
            raise ValueError(f"expected seconds per minibatch must be > 0, got {bad}")
        self.expected = dict(expected)
        self.devices = dict(devices)
        self.rule = rule
        self.host_factor = host_factor
        self._early: dict[StageKey, list[float]] = {k: [] for k in self.expected}
        self._runs: dict[StageKey, _Run] = {k: _Run() for k in self.expected}
        self.waves_watched = 0

    def observe(self, stage: StageKey, seconds_per_minibatch: float) -> None:
        """One wave of `stage`: its device's seconds per minibatch in that wave."""
        if stage not in self.expected:
            raise ValueError(f"stage {stage} is not watched (the watch has {sorted(self.expected)})")
        ratio = seconds_per_minibatch / self.expected[stage]
        if self.host_factor is None:
            early = self._early[stage]
            early.append(ratio)
            if all(len(e) >= self.rule.baseline_waves for e in self._early.values()):
                self.host_factor = median(r for e in self._early.values() for r in e[:self.rule.baseline_waves])
            return
        self.waves_watched += 1
        run = self._runs[stage]
        deviation = ratio / self.host_factor if self.host_factor > 0 else 1.0
        if deviation >= self.rule.threshold:
            run.deviations.append(deviation)
        else:
            run.deviations.clear()

    def slowed(self) -> list[Slowed]:
        """The devices slowed for good now (the rule met), each once (a device in several stages: the
        worst)."""
        found: dict[str, Slowed] = {}
        for stage, run in self._runs.items():
            if len(run.deviations) < self.rule.window_waves:
                continue
            name, speed = self.devices[stage]
            deviation = median(run.deviations[-self.rule.window_waves:])
            s = Slowed(stage, name, speed, speed / deviation, deviation, len(run.deviations))
            if name not in found or s.deviation > found[name].deviation:
                found[name] = s
        return sorted(found.values(), key=lambda s: s.stage)

    def known(self, slowed: list[Slowed]) -> None:
        """After a decision not to switch: the watch now expects the `slowed` devices at their
        measured speeds (their stages' expected times scaled by their deviation), so that the same
        slowdown does not trigger again, and every count starts again. A further slowdown of
        the same device triggers anew."""
        for s in slowed:
            for stage, (name, speed) in self.devices.items():
                if name == s.device:
                    self.expected[stage] *= speed / s.measured_speed
                    self.devices[stage] = (name, s.measured_speed)
        for run in self._runs.values():
            run.deviations.clear()
