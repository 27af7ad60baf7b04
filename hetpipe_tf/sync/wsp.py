"""Wave Synchronous Parallel (HetPipe §5) behind the synchronisation seam.

Pure Python. Everything WSP adds between virtual workers is here, as a
:class:`hetpipe_tf.pipeline.schedule.SyncScheme`:

* **instructions**: at the end of every wave c (after update (c+1)·Nm) each stage pushes
  the wave's aggregated update (:class:`PushUpdate`) and asks for the global weights
  (:class:`PullWeights`); a merge stream takes them in when they arrive
  (:class:`MergePulled`). A last, partial wave is pushed too (no update is lost); pulls
  that no later minibatch needs are not made.
* **what a forward pass waits for**: minibatch (c+2)·Nm, the first whose weight version
  must hold the global updates of wave c, waits for that merge. For D = 0, Nm = 4 (the HetPipe
  dissertation's example): minibatch 8 waits for every worker's wave 0 while minibatches 5..7 of wave 1 are
  already in the pipeline.
* **how the executor carries them out** (:meth:`WSP.handlers`): a push takes the wave's update
  on the stage and sends it to the parameter servers on the stage's lane (a thread of its own,
  :class:`hetpipe_tf.sync.lanes.StageLanes`; the stage goes on); a pull is answered on a pool
  thread once the stage's own push of the wave has landed and every worker has pushed wave
  c - D; a merge makes the live weights and the versions stashed since the push equal to the
  global weights plus the local updates made since. A run ends once its pushes have landed.
  What a stage keeps for this is a :class:`PushBase`.
* **how the simulator models them**: :class:`ParameterServerModel`.
* **what the planner charges**: one more copy of a stage's weights (those at the last
  push), and the push and pull transfers of each wave.

The rules above are written for a wave of any size and any gate: :mod:`hetpipe_tf.sync.ssp`
registers BSP, SSP and ASP as WSP with a wave of one minibatch (:meth:`WSP.wave_size`) and
their own bounds (:meth:`WSP.checked_bound`; None: pulls never wait).
"""
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from hetpipe_tf.pipeline.instructions import PARAMETER_SERVER, Delivery, Instruction, Key, Task, TaskStream
from hetpipe_tf.pipeline.schedule import Agent, Handler, SyncScheme, Timing, register_sync
from hetpipe_tf.sync.lanes import StageLanes

PULLED = "pulled"
MERGED = "merged"
#: Where the global weights live (§8.1): "default" puts the layers round-robin over one server
#: per node; "local" puts each layer on the server of the node whose device trains it (ED).
PLACEMENTS = ("default", "local")


@dataclass(frozen=True, repr=False)
class WaveInstruction(Instruction):
    """An instruction about wave c (minibatches c*g+1 .. (c+1)*g; g = Nm under WSP, §5, and 1
    under BSP, SSP and ASP). `minibatch` is the wave's last minibatch, after whose update it runs."""
    wave: int = field(default=0, kw_only=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(wave={self.wave})"


@dataclass(frozen=True, repr=False)
class PushUpdate(WaveInstruction):
    """Pushes the stage's aggregated update of wave c (the sum of its local updates) to the
    parameter servers, which apply w_global += u (§5)."""

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        """The wave's update, to the parameter servers."""
        return ((PARAMETER_SERVER, ("update", self.wave)),)


@dataclass(frozen=True, repr=False)
class PullWeights(WaveInstruction):
    """Asks the parameter servers for the global weights at the end of clock c; they answer
    once every virtual worker has pushed wave c - D (§5). The stage does not wait here."""

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        """The pull request of clock c, to the parameter servers."""
        return ((PARAMETER_SERVER, ("pull", self.wave)),)


@dataclass(frozen=True, repr=False)
class MergePulled(WaveInstruction):
    """Takes the pulled global weights into the stage: w_local becomes w_global plus the local
    updates made since the push of wave c, and so do the versions stashed since then."""

    def requires(self) -> tuple[Key, ...]:
        """The answer to the pull of clock c."""
        return ((PULLED, self.wave),)

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        """That wave c is merged, to the stage itself (its later forward passes wait for it)."""
        return ((stage, (MERGED, self.wave)),)


class SynchronisedStage(Protocol):
    """What :class:`PushBase` uses of a stage's synchronised weights (of the runtime layer, above
    this one: :class:`hetpipe_tf.runtime.stage.synchronised.SynchronisedWeights`); the values are
    the stage's tensors."""

    @property
    def paths(self) -> Sequence[str]:
        """The synchronised variables' paths, in the order of the values."""

    def values(self) -> Any:
        """The synchronised variables' values now."""

    def change(self, since: Any) -> tuple[Any, Any]:
        """(the values now, their change since `since`)."""

    def merge_pulled(self, base: Any, pulled: Any, first_minibatch: int,
                     included: frozenset[tuple[int, int]]) -> Any:
        """The values after the merge of `pulled` into the live weights and the versions stashed
        for minibatches >= `first_minibatch`."""


class PushBase:
    """A stage's weights at its last push plus the global updates merged since (§5).

    The next push sends ``w_local - base``, which is exactly the local updates made since the
    last push; a merge of pulled global weights adds ``pulled - base`` to the live weights and
    to the versions stashed since the push. Works on a stage's synchronised `weights`
    (:class:`hetpipe_tf.runtime.stage.synchronised.SynchronisedWeights`: ``values()``, ``paths``,
    ``change()``, ``merge_pulled()``; each one call on the stage's device).
    """

    def __init__(self, weights: SynchronisedStage) -> None:
        self.weights = weights
        self.values = weights.values()

    @property
    def paths(self) -> Sequence[str]:
        """The synchronised variables' paths."""
        return self.weights.paths

    def wave_update(self) -> Any:
        """The aggregated update of the wave, w_local - base; base := w_local."""
        self.values, deltas = self.weights.change(self.values)
        return deltas

    def merge(self, pulled: Any, clocks: Sequence[int], first_minibatch: int) -> None:
        """Takes global weights pulled after the workers' `clocks` in: w_local and the versions
        stashed for minibatches >= `first_minibatch` become them plus the local updates since."""
        included = frozenset((w, c) for w, clock in enumerate(clocks) for c in range(clock))
        self.values = self.weights.merge_pulled(self.values, pulled, first_minibatch, included)

    def snapshot(self) -> Any:
        """The base, for :meth:`restore`."""
        return self.values

    def restore(self, snapshot: Any) -> None:
        """Sets the base back to a :meth:`snapshot`."""
        self.values = snapshot


@dataclass(frozen=True)
class WorkerSync:
    """One virtual worker's binding to the parameter servers under WSP (or another scheme of
    its family, `scheme`): its index, the servers
    (:class:`hetpipe_tf.sync.parameter_server.ParameterServers`), the bound its pulls keep (D;
    None: they never wait) and the longest a pull may wait. `pull_waits` records (stage, wave,
    asked, answered) of every pull; `lanes` carry its stages' pushes."""
    scheme: "WSP"
    worker: int
    servers: Any  # the runtime layer's ParameterServers
    staleness_bound: int | None
    timeout_s: float = 300.0
    pull_waits: list[tuple[int, int, float, float]] = field(default_factory=list, compare=False)
    lanes: StageLanes = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lanes", StageLanes("wsp-push", self.worker))


class WSP(SyncScheme):
    """Wave Synchronous Parallel: one push per wave of Nm minibatches, pulls gated by D (§5).

    Written for a wave of g minibatches (:meth:`wave_size`): the push of wave c follows update
    (c+1)·g; the first weight version stashed after it is that of minibatch (c+1)·g + Nm (§4),
    which waits for the merge of wave c. With g = Nm: minibatch (c+2)·Nm."""

    name = "wsp"
    instructions = frozenset({PushUpdate, PullWeights, MergePulled})
    apply_like = frozenset({MergePulled})
    weight_copies = 1  # the weights at the last push

    def wave_size(self, num_in_flight: int) -> int:
        """Minibatches per push, that is per clock: a wave of Nm (§5)."""
        return num_in_flight

    def checked_bound(self, staleness_bound: int) -> int | None:
        """The bound the pulls keep for the `staleness_bound` a user gave: D itself (§5)."""
        if staleness_bound < 0:
            raise ValueError(f"the staleness bound D must be >= 0, got {staleness_bound}")
        return int(staleness_bound)

    def first_merged(self, wave: int, num_in_flight: int) -> int:
        """The first minibatch whose weight version must hold the global weights pulled at wave c."""
        return (wave + 1) * self.wave_size(num_in_flight) + num_in_flight

    # The schedule ---------------------------------------------------------------------------
    def after_update(self, minibatch: int, steps: int, num_in_flight: int) -> tuple[Instruction, ...]:
        """At a wave's last minibatch (or the run's last): the wave's push, and its pull when a later minibatch needs it."""
        p, n, g = minibatch, steps, self.wave_size(num_in_flight)
        if not (p % g == 0 or p == n):
            return ()
        wave = (p - 1) // g
        out: tuple[Instruction, ...] = (PushUpdate(p, wave=wave),)
        if self.first_merged(wave, num_in_flight) <= n:  # some later minibatch needs this wave's pull
            out += (PullWeights(p, wave=wave),)
        return out

    def forward_waits(self, minibatch: int, num_in_flight: int) -> tuple[Key, ...]:
        """The merge that minibatch p's forward pass waits for: that of the wave whose pull its version holds."""
        after, g = minibatch - num_in_flight, self.wave_size(num_in_flight)
        return ((MERGED, after // g - 1),) if after > 0 and after % g == 0 else ()

    def streams(self, stage: int, steps: int, num_in_flight: int) -> tuple[TaskStream, ...]:
        """The stage's stream of merges, those a later minibatch waits for."""
        g = self.wave_size(num_in_flight)

        def merge(c: int) -> Task:
            return Task(stage, "merge", (c + 1) * g, (MergePulled((c + 1) * g, wave=c),))

        # Only merges that a later minibatch waits for: wave c gates minibatch (c+1)*g + Nm.
        return (TaskStream("merge", max((steps - num_in_flight) // g, 0), lambda i: merge(i - 1)),)

    # The executor -----------------------------------------------------------------------------
    def stage_state(self, weights: SynchronisedStage) -> PushBase:
        """A :class:`PushBase` of the stage's synchronised weights."""
        return PushBase(weights)

    def bind(self, worker: int, servers: Any, staleness_bound: int, timeout_s: float) -> WorkerSync:
        """Virtual worker `worker`'s :class:`WorkerSync` to `servers` under `staleness_bound`."""
        return WorkerSync(self, worker, servers, self.checked_bound(staleness_bound), timeout_s)

    def handlers(self, binding: WorkerSync) -> Mapping[type[Instruction], Handler]:
        """Instruction type -> handler(executor, stage, instruction, *taken keys) for one run of a
        worker bound by `binding` (a :class:`WorkerSync`). A run's waves count from the worker's
        clock at its start, so that a later ``fit`` goes on where the last one ended; a worker
        retired by its last run's end holds the global clock back again. The pushes of a run
        that failed before its end land before this one starts.

        Returns:
            The handlers by instruction type.
        """
        binding.lanes.settle(binding.timeout_s)
        binding.servers.clock.retire(binding.worker, retired=False)
        first_wave = binding.servers.clock.clocks()[0][binding.worker]
        # (stage, wave) -> the future of its push, until the stage's pull of the wave
        pushes: dict[tuple[int, int], Future[None]] = {}

        def push(ex: Any, s: int, ins: PushUpdate) -> None:
            paths, deltas = ex.runtimes[s].synchronisation.pushed(ex.runtimes[s].sync_state.wave_update())

            def send() -> None:
                start = ex.clock()
                binding.servers.push(binding.worker, s, first_wave + ins.wave, paths, deltas)
                ex.trace_span(200 + s, f"push of wave {ins.wave}", start, ex.clock(), "Push")

            pushes[(s, ins.wave)] = binding.lanes.submit(s, f"push of wave {ins.wave}", send)

        def pull(ex: Any, s: int, ins: PullWeights) -> None:
            base, asked = ex.runtimes[s].sync_state, ex.clock()
            wave = gate(ins.wave, binding.staleness_bound)
            own = pushes.pop((s, ins.wave))

            def answer() -> tuple[Any, Any]:
                own.result()  # the global weights merged hold the stage's own push of the wave (§5)
                values, clocks = binding.servers.pull(base.paths, first_wave + wave if wave >= 0 else -1,
                                                      binding.timeout_s, to_device=ex.runtimes[s].device)
                answered = ex.clock()
                binding.pull_waits.append((s, ins.wave, asked, answered))
                ex.trace_span(100 + s, f"wait for wave {wave} (pull of clock {ins.wave})", asked, answered,
                              "PullWait")
                return (values, clocks)

            ex.in_background(s, ins, (PULLED, ins.wave), answer)

        return {PushUpdate: push, PullWeights: pull, MergePulled: self.merge}

    def run_ended(self, binding: WorkerSync) -> None:
        """A worker that ended its run pushes no more waves of it: retired at the clock, it no
        longer holds back the others, whose minibatches still in flight wait for the global
        weights of waves it will never push (after a stop, workers end at different clocks).
        It retires once its pushes have landed."""
        binding.lanes.settle(binding.timeout_s)
        binding.servers.clock.retire(binding.worker)

    def dry_handlers(self) -> Mapping[type[Instruction], Handler]:
        """A push computes the wave's update and keeps it; a pull is answered at once with the
        weights of that push, and merged as a real pull is (the same work, no change).

        Returns:
            The handlers by instruction type.
        """

        def push(ex: Any, s: int, ins: PushUpdate) -> None:
            ex.runtimes[s].sync_state.wave_update()

        def pull(ex: Any, s: int, ins: PullWeights) -> None:
            base = ex.runtimes[s].sync_state
            ex.in_background(s, ins, (PULLED, ins.wave), lambda: (base.values, ()))

        return {PushUpdate: push, PullWeights: pull, MergePulled: self.merge}

    # The simulator and the planner ------------------------------------------------------------
    def simulation_model(self, staleness_bound: int, push_time: Timing,
                         pull_time: Timing) -> "ParameterServerModel":
        """The servers in the simulator: a :class:`ParameterServerModel` under `staleness_bound`."""
        return ParameterServerModel(self.checked_bound(staleness_bound), push_time=push_time, pull_time=pull_time)

    def merge(self, ex: Any, s: int, ins: MergePulled, pulled: tuple[Any, Sequence[int]]) -> None:
        """MergePulled(c): into the versions of minibatches >= :meth:`first_merged` (c)."""
        values, clocks = pulled
        ex.runtimes[s].sync_state.merge(values, clocks,
                                        first_minibatch=self.first_merged(ins.wave, ex.schedule.num_in_flight))


def gate(wave: int, staleness_bound: int | None) -> int:
    """The wave every worker must have pushed before a pull of clock `wave` is answered: wave - D
    (§5); a negative one (and any, when the bound is None) needs no wait.

    Returns:
        That wave.
    """
    return -1 if staleness_bound is None else wave - staleness_bound


class ParameterServerModel:
    """Simulated WSP parameter servers: clocks from pushes, pulls answered under bound D.

    A push of wave c arrives after its transfer time; a pull of clock c is answered once its
    stage's own push of wave c has arrived and every stage of every worker has pushed wave
    c - D (:func:`gate`; D = None: no other), and arrives after its transfer time."""

    def __init__(self, staleness_bound: int | None, push_time: Timing = lambda agent, ins: 0.0,
                 pull_time: Timing = lambda agent, ins: 0.0) -> None:
        if staleness_bound is not None and staleness_bound < 0:
            raise ValueError(f"the staleness bound D must be >= 0, got {staleness_bound}")
        self.staleness_bound = staleness_bound
        self.push_time = push_time
        self.pull_time = pull_time
        self.pushes: dict[int, dict[Agent, float]] = {}  # wave -> {agent: arrival}
        self.pending: list[tuple[Agent, int, float, Instruction]] = []  # (agent, wave, requested, instruction)

    def receive(self, agent: Agent, key: Key, instruction: Instruction, time: float) -> None:
        """Takes a push or a pull request of `agent` at `time`.

        Raises:
            ValueError: `key` is neither.
        """
        kind, wave = key[0], key[1]
        if kind == "update":
            self.pushes.setdefault(wave, {})[agent] = time + self.push_time(agent, instruction)
        elif kind == "pull":
            self.pending.append((agent, wave, time, instruction))
        else:
            raise ValueError(f"the parameter servers got an unknown request {key!r}")

    def answers(self, agents: Sequence[Agent]) -> list[tuple[Agent, Key, float, float]]:
        """Keys that arrive now: (agent, key, requested, arrival) of every pull that can be answered."""
        ready: list[tuple[Agent, Key, float, float]] = []
        still: list[tuple[Agent, int, float, Instruction]] = []
        for agent, wave, asked, ins in self.pending:
            needed = gate(wave, self.staleness_bound)
            pushed = self.pushes.get(needed, {}) if needed >= 0 else None
            own = self.pushes.get(wave, {}).get(agent, asked)  # a pull without a push of its own: none
            if needed < 0 or (pushed is not None and len(pushed) == len(agents)):
                start = max([asked, own] + (list(pushed.values()) if pushed else []))
                ready.append((agent, (PULLED, wave), asked, start + self.pull_time(agent, ins)))
            else:
                still.append((agent, wave, asked, ins))
        self.pending = still
        return ready


WSP_SCHEME = register_sync(WSP())
