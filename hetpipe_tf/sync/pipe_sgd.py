"""Pipe-SGD (Li et al., NeurIPS 2018) behind the synchronisation seam: decentralised,
pipelined all-reduce SGD with gradient staleness k, no parameter servers.

Pure Python. Pipe-SGD's Algorithm 1, on each worker: iteration t = 1..T waits until the
aggregated gradient of iteration t - (k + 1) is ready (line 3), decompresses it (4), updates
``w[t] = w[t-1] - γ·g_sum[t-(k+1)]`` (5), then computes its own gradient at w[t] (6-8),
compresses it (9) and hands it to its communication thread (10), which all-reduces
``g_sum[t] = Σ_workers g_local[t]`` (a sum, not a mean; aggregates of iterations -k..0 are
zero). So the weights iteration t computes its gradient at hold exactly the aggregates of
iterations 1..t-(k+1): with k = 0 it is synchronous all-reduce SGD, and k* = 1 (Pipe-SGD's
optimum) lets iteration t compute while the aggregate of t - 1 is communicated.

Here an iteration is a minibatch of a virtual worker, and the all-reduce runs per stage: stage
s of every worker all-reduces with stage s of the others (a worker of one stage is Pipe-SGD's
plain data parallelism; several stages are "pipelines inside, pipelined all-reduce across",
which neither Pipe-SGD nor HetPipe describes). As a :class:`hetpipe_tf.pipeline.schedule.SyncScheme`:

* **after update p** (:class:`ContributeUpdate`): the stage takes its local update
  u_p = w_local - w (``-γ·g_local[p]`` under SGD: what the stage's optimizer made of the
  gradient) back out of its live weights and of the version stashed after it, compresses it
  and all-reduces it with the other workers' on its own communication thread (one per stage,
  in minibatch order, so every worker issues the same collectives in the same order);
* **a merge stream** (:class:`MergeAggregate`): aggregate j, once reduced, goes into the live
  weights and into the versions stashed for minibatches >= j + k + 1;
* **what a forward pass waits for**: minibatch t waits for the merge of aggregate t - (k + 1)
  (line 3), so version w_t holds exactly aggregates 1..t-(k+1), whatever Nm is (with
  Nm > k + 1 the pipeline holds only k + 1 minibatches at once; with k > Nm a merge also
  waits until the version that must not hold it is stashed).

One change to Algorithm 1: its communication thread stops at T - (k + 1), dropping the last
k + 1 gradients; here the run's end merges them too, so that every minibatch a run trains is
applied (a run split into epochs would otherwise drop k + 1 minibatches per worker per epoch),
and k = 0 equals synchronous SGD over all T minibatches.

In one process the workers' stages meet on their own devices; with one process per virtual
worker they meet on the cluster's worker tasks
(:meth:`hetpipe_tf.sync.allreduce.AllReduceGroup.member_device`).

Pipe-SGD's light compressions (:data:`COMPRESSIONS`; the TensorFlow side is
:mod:`hetpipe_tf.sync.compression`) are applied to what is communicated, and its timing
model (:func:`ring_allreduce_seconds`, :func:`iteration_seconds`) is what the simulator's
:class:`AllReduceModel` charges. The collectives themselves (TensorFlow's
``CollectiveReduceV2`` / ``CollectiveGatherV2``) are :mod:`hetpipe_tf.sync.allreduce`,
loaded when a worker is bound. Worker 0 also adds every merged aggregate to the parameter
servers' global weights, which thus mirror its replica, so that what the runner writes into
the Keras model (at every epoch's end and the run's) is the trained replica; nothing waits on them.

Limits: every worker cuts the model at the same boundaries (stage s all-reduces with stage s;
an ED allocation, or one device per worker), the minibatches are even (Algorithm 1 sums every
update unweighted), and every worker trains the same minibatches of a run: a stop (Keras's
``stop_training``, an EarlyStopping callback) that ends the workers at different minibatches
leaves the others' later all-reduces unanswered until the run's ``timeout_s``, and so does a
lost worker (``on_worker_failure="continue"`` does not apply): a TimeoutError says so, and
TensorFlow then aborts every later collective of that process.
"""
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.pipeline.instructions import PARAMETER_SERVER, Delivery, Instruction, Key, Task, TaskStream
from hetpipe_tf.pipeline.schedule import Agent, Handler, SyncScheme, Timing, register_sync
from hetpipe_tf.sync.lanes import StageLanes

AGGREGATED = "aggregated"
MERGED_AGGREGATE = "merged aggregate"
CONTRIBUTED = "contributed"


@dataclass(frozen=True)
class Compression:
    """One of Pipe-SGD's light compressions ("Compression": "floating-point truncation on 16-bit
    LSBs, and scalar 8-bit quantization"), as communicated: `wire_bytes` per float32 element,
    whether the compressed values are summed as they travel (a ring all-reduce) or `gathered`
    and summed by each worker (8-bit values with one scale per worker cannot be summed in 8 bits),
    and the error bound of one compressed element x: ``|x - D(C(x))| <= bound`` (see each)."""
    name: str
    wire_bytes: float
    bound: str
    gathered: bool = False

    def link_share(self, workers: int) -> float:
        """The bytes a worker's link carries per all-reduce, as a multiple of its float32 values'
        bytes n: a ring all-reduce 2(p-1)/p·n (Pipe-SGD, Ring-AllReduce), compressed; a ring
        all-gather of the compressed payloads (p-1)·n_c.

        Returns:
            The multiple of n.
        """
        p, ratio = int(workers), self.wire_bytes / 4.0
        return (p - 1) * ratio if self.gathered else 2 * (p - 1) / p * ratio


COMPRESSIONS = {
    "none": Compression("none", 4.0, "0 (float32 as it is)"),
    # The 16 low bits of the float32 dropped: the 7 mantissa bits of bfloat16 remain.
    "truncate16": Compression("truncate16", 2.0, "|x| * 2**-7 (the 16 low bits of the float32 dropped)"),
    # One scale per tensor, s = max|x| / 127; x -> round(x / s) in -127..127.
    "quant8": Compression("quant8", 1.0, "s / 2 with s = max|x| / 127 of the tensor (8-bit scalar quantisation)",
                          gathered=True),
}


def get_compression(name: str) -> Compression:
    """The :class:`Compression` named `name`, or a ValueError naming the ones that exist."""
    if name not in COMPRESSIONS:
        raise ValueError(f"unknown compression {name!r}; Pipe-SGD's are: {', '.join(COMPRESSIONS)} "
                         f"(Pipe-SGD: none, truncation of the 16 low bits, scalar 8-bit quantisation)")
    return COMPRESSIONS[name]


# Pipe-SGD's timing model ------------------------------------------------------------------------
def ring_allreduce_seconds(workers: int, nbytes: float, latency: float, byte_seconds: float,
                           reduce_byte_seconds: float = 0.0, sync_seconds: float = 0.0, segments: int = 1) -> float:
    """l_comm of a Ring-AllReduce of `nbytes` over p = `workers` (Pipe-SGD, "Finding the Optimal
    Level of Pipelining"): 2(p-1)·L·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ + L·S, with L gradient
    `segments` (level of pipeline 1: L = 1), α the latency, β and γ the seconds per byte
    transferred and summed, S the global synchronisation time. One worker communicates nothing.

    Returns:
        l_comm, in seconds.
    """
    p = int(workers)
    if p <= 1:
        return 0.0
    share = (p - 1) / p
    return (2 * (p - 1) * segments * latency + 2 * share * nbytes * byte_seconds
            + share * nbytes * reduce_byte_seconds + segments * sync_seconds)


def iteration_seconds(update: float, compute: float, communicate: float, staleness: int = 1) -> float:
    """Per-iteration time of Pipe-SGD under limited resources (Pipe-SGD, "Finding the Optimal
    Staleness"): l_total = T·max(l_up + l_comp, l_comm), for k >= 1; with k = 0 nothing
    overlaps: l_up + l_comp + l_comm.

    Returns:
        l_total, in seconds.

    Raises:
        ValueError: the staleness k is < 0.
    """
    if staleness < 0:
        raise ValueError(f"the staleness k must be >= 0, got {staleness}")
    if staleness == 0:
        return update + compute + communicate
    return max(update + compute, communicate)


def scaling_efficiency(update: float, compute: float, communicate: float) -> float:
    """SE = (l_up + l_comp) / max(l_up + l_comp, l_comm) (Pipe-SGD, "Finding the Optimal
    Communication Ratio"): 1 once the system is compute bound.

    Returns:
        SE.
    """
    return (update + compute) / max(update + compute, communicate)


# Instructions ----------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class ContributeUpdate(Instruction):
    """After update p: the stage's local update u_p leaves the live weights (and the version
    w_{p+Nm} stashed after it) and goes, compressed, into the all-reduce of minibatch p with
    the same stage of every other worker (Algorithm 1, computation thread lines 9-10 and
    communication thread lines 3-5). With `gate`, it also tells the merge stream that the
    version that must not hold an aggregate yet is stashed (k > Nm)."""
    gate: bool = field(default=False, kw_only=True)

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        """The update, to the all-reduce; with `gate`, that it was contributed, to the stage itself."""
        keys: tuple[Delivery, ...] = ((PARAMETER_SERVER, ("allreduce", self.minibatch)),)
        return keys + (((stage, (CONTRIBUTED, self.minibatch)),) if self.gate else ())


@dataclass(frozen=True, repr=False)
class MergeAggregate(Instruction):
    """Aggregate j = `minibatch` (Σ over workers of their decompressed updates) goes into the
    live weights and into the versions stashed for minibatches >= j + k + 1 (Algorithm 1 lines
    3-5: w[t] = w[t-1] - γ·g_sum[t-(k+1)]). `after`: the minibatch whose update this stage must
    have contributed first (0: none)."""
    after: int = field(default=0, kw_only=True)

    def requires(self) -> tuple[Key, ...]:
        """Aggregate j, and the stage's contribution of `after` when there is one."""
        return ((AGGREGATED, self.minibatch),) + (((CONTRIBUTED, self.after),) if self.after else ())

    def provides(self, stage: int) -> tuple[Delivery, ...]:
        """That aggregate j is merged, to the stage itself (its later forward passes wait for it)."""
        return ((stage, (MERGED_AGGREGATE, self.minibatch)),)


# What a stage keeps ----------------------------------------------------------------------------
class ReplicaStage(Protocol):
    """What :class:`ReplicaBase` uses of a stage's synchronised weights (of the runtime layer,
    above this one: :class:`hetpipe_tf.runtime.stage.synchronised.SynchronisedWeights`); the
    values are the stage's tensors."""

    @property
    def paths(self) -> Sequence[str]:
        """The synchronised variables' paths, in the order of the values."""

    @property
    def dtypes(self) -> Sequence[str]:
        """The synchronised variables' dtypes ("float32", ...), in the order of the values."""

    def values(self) -> Any:
        """The synchronised variables' values now."""

    def change(self, since: Any) -> tuple[Any, Any]:
        """(the values now, their change since `since`)."""

    def add_to_weights(self, values: Any, first_minibatch: int, included: frozenset[tuple[int, int]]) -> None:
        """Adds `values` to the live weights and the versions stashed for minibatches >= `first_minibatch`."""

    def subtract(self, a: Any, b: Any) -> Any:
        """a - b, value by value."""

    def sum(self, a: Any, b: Any) -> Any:
        """a + b, value by value."""


class ReplicaBase:
    """A stage's weights as Algorithm 1 defines them: w[0] plus the aggregates merged so far.

    Between instructions the live weights equal it; an update adds the local u_p, which
    :meth:`take_update` takes back out; :meth:`merge` adds an aggregate to both. Works on the
    synchronised `weights` of a stage (:class:`hetpipe_tf.runtime.stage.synchronised.SynchronisedWeights`),
    each operation one call on its device."""

    def __init__(self, weights: ReplicaStage) -> None:
        self.weights = weights
        self.values = weights.values()
        self.included: frozenset[tuple[int, int]] = frozenset()  # (worker, minibatch) updates the replica holds

    @property
    def paths(self) -> Sequence[str]:
        """The synchronised variables' paths."""
        return self.weights.paths

    def take_update(self, first_minibatch: int) -> Any:
        """u = w_local - base; w_local and the versions stashed for minibatches >= `first_minibatch`
        go back to base.

        Returns:
            u.
        """
        now, update = self.weights.change(self.values)
        self.weights.add_to_weights(self.weights.subtract(self.values, now), first_minibatch, self.included)
        return update

    def merge(self, aggregate: Any, first_minibatch: int, included: Iterable[tuple[int, int]]) -> None:
        """base += aggregate, and so do w_local and the versions stashed for minibatches >= `first_minibatch`."""
        self.values = self.weights.sum(self.values, aggregate)
        self.included = self.included | frozenset(included)
        self.weights.add_to_weights(aggregate, first_minibatch, self.included)

    def snapshot(self) -> tuple[Any, frozenset[tuple[int, int]]]:
        """The base and the updates it holds, for :meth:`restore`."""
        return (self.values, self.included)

    def restore(self, snapshot: tuple[Any, frozenset[tuple[int, int]]]) -> None:
        """Sets the base back to a :meth:`snapshot`."""
        self.values, self.included = snapshot


# The binding -----------------------------------------------------------------------------------
@dataclass
class AllReduceBinding:
    """One virtual worker's binding to the others under Pipe-SGD: its index, the group that
    all-reduces each stage with the same stage of every worker
    (:class:`hetpipe_tf.sync.allreduce.AllReduceGroup`), the parameter servers that mirror
    worker 0's replica, and the longest a collective may wait. `pull_waits` records (stage,
    minibatch, contributed, aggregated) of every all-reduce, as WSP records its pulls."""
    scheme: "PipeSGD"
    worker: int
    servers: Any  # the runtime layer's ParameterServers
    group: Any  # the runtime layer's AllReduceGroup
    timeout_s: float = 300.0
    pull_waits: list[tuple[int, int, float, float]] = field(default_factory=list)
    lanes: StageLanes = field(init=False)  # the stages' communication threads
    instances: dict[int, int] = field(default_factory=dict)  # stage -> collectives issued so far

    def __post_init__(self) -> None:
        self.lanes = StageLanes("pipe-sgd", self.worker)


class CompressionDtypeError(HetPipeUsageError, TypeError):
    """Pipe-SGD's ``truncate16`` or ``quant8`` compression given weights that are not float32."""


class PipeSGD(SyncScheme):
    """Pipe-SGD with staleness `staleness` (k >= 0; Pipe-SGD's optimum and default 1) and a
    `compression` of :data:`COMPRESSIONS` (default none). Registered as "pipe-sgd" with the
    defaults; ``PipeSGD(staleness=k, compression=c)`` is a scheme too (``HetPipeStrategy(sync=...)``)."""

    instructions: frozenset[type[Instruction]] = frozenset((ContributeUpdate, MergeAggregate))
    apply_like = instructions
    weight_copies = 1  # the replica's weights (ReplicaBase)
    #: Algorithm 1's indexing needs HetPipe's versions (w_{p+Nm} stashed right after update p) and
    #: forward passes in their own stream (one 1F1B stream would wait for an update it runs later).
    schedules = frozenset({"hetpipe"})

    def __init__(self, staleness: int = 1, compression: str = "none") -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"Pipe-SGD's staleness k must be an integer >= 0, got {staleness!r}; Pipe-SGD's "
                             f"optimum is k = 1 (0: synchronous all-reduce SGD)")
        self.staleness = staleness
        self.compression = get_compression(compression)
        self.name = "pipe-sgd" if (staleness, compression) == (1, "none") else (
            f"pipe-sgd(k={staleness}, compression={compression})")

    def __repr__(self) -> str:
        return f"PipeSGD(staleness={self.staleness}, compression={self.compression.name!r})"

    # The schedule ---------------------------------------------------------------------------
    def after_update(self, minibatch: int, steps: int, num_in_flight: int) -> tuple[Instruction, ...]:
        """The contribution of every minibatch's update to the all-reduce."""
        lag = self.staleness - num_in_flight  # merge j waits for the contribution of j + lag
        return (ContributeUpdate(minibatch, gate=lag > 0 and minibatch - lag >= 1),)

    def forward_waits(self, minibatch: int, num_in_flight: int) -> tuple[Key, ...]:
        """The merge of aggregate p - (k + 1) that minibatch p's forward pass waits for."""
        j = minibatch - (self.staleness + 1)
        return ((MERGED_AGGREGATE, j),) if j >= 1 else ()

    def streams(self, stage: int, steps: int, num_in_flight: int) -> tuple[TaskStream, ...]:
        """The stage's stream of merges, one per minibatch."""
        lag = self.staleness - num_in_flight

        def merge(j: int) -> Task:
            after = j + lag if lag > 0 and j + lag <= steps else 0
            return Task(stage, "merge", j, (MergeAggregate(j, after=after),))

        return (TaskStream("merge", steps, merge),)

    def checked_bound(self, staleness_bound: int) -> int | None:
        """None: Pipe-SGD's staleness is its own k, not a bound of the parameter servers, so
        `staleness_bound` must stay 0 (its default).

        Returns:
            None.

        Raises:
            ValueError: `staleness_bound` is not 0.
        """
        if staleness_bound != 0:
            raise ValueError(f"Pipe-SGD has no parameter-server staleness bound: staleness_bound must be 0, got "
                             f"{staleness_bound}; its gradient staleness is k, PipeSGD(staleness=k) "
                             f"(hetpipe-train --pipe_sgd_staleness=k), now {self.staleness}")
        return None

    # The executor -----------------------------------------------------------------------------
    def stage_state(self, weights: ReplicaStage) -> ReplicaBase:
        """A :class:`ReplicaBase` of the stage's synchronised weights.

        Returns:
            The stage's state.

        Raises:
            CompressionDtypeError: the compression is ``truncate16`` or ``quant8`` and a weight
                is not float32.
        """
        if self.compression.name != "none":
            other = {path: dtype for path, dtype in zip(weights.paths, weights.dtypes) if dtype != "float32"}
            if other:
                raise CompressionDtypeError(
                    f"Pipe-SGD's {self.compression.name} compression compresses float32 weights only; this stage "
                    f"holds {sorted(set(other.values()))} ({len(other)} weights, first {next(iter(other))}). Use "
                    f"compression='none' (which sums any floating-point type) or build the model with float32 "
                    f"weights")
        return ReplicaBase(weights)

    def bind(self, worker: int, servers: Any, staleness_bound: int, timeout_s: float) -> AllReduceBinding:
        """The binding of `worker` to the all-reduce group of the run `servers` belong to, which
        the servers give (:meth:`hetpipe_tf.sync.parameter_server.ParameterServers.all_reduce_group`:
        TensorFlow's collectives, :mod:`hetpipe_tf.sync.allreduce`).

        Returns:
            The binding.

        Raises:
            ValueError: `staleness_bound` is not 0, or the run weights the workers' pushes (uneven
                minibatches).
        """
        self.checked_bound(staleness_bound)
        if any(a != 1.0 for a in servers.push_weights):
            raise ValueError(f"Pipe-SGD sums every worker's update as it is (Algorithm 1: g_sum = Σ g_local), but "
                             f"this run weights the workers' pushes by their minibatch sizes "
                             f"({list(servers.push_weights)}): uneven minibatches are for the parameter-server "
                             f"schemes (wsp, bsp, ssp, asp); give one of those, or even minibatches")
        group = servers.all_reduce_group(self.compression.name, timeout_s)
        return AllReduceBinding(self, worker, servers, group, timeout_s)

    def handlers(self, binding: AllReduceBinding) -> Mapping[type[Instruction], Handler]:
        """Instruction type -> handler for one run of a worker bound by `binding`. Each stage's
        collectives run on a thread of their own, in minibatch order (:meth:`run_ended` ends it).

        Returns:
            The handlers by instruction type.
        """
        first_wave = binding.servers.clock.clocks()[0][binding.worker] if binding.worker == 0 else 0

        def contribute(ex: Any, s: int, ins: ContributeUpdate) -> None:
            rt, asked = ex.runtimes[s], ex.clock()
            update = rt.sync_state.take_update(first_minibatch=ins.minibatch + ex.schedule.num_in_flight)
            instance = binding.instances.get(s, 0) + 1
            binding.instances[s] = instance
            done = binding.lanes.submit(s, f"all-reduce of minibatch {ins.minibatch}", binding.group.all_reduce,
                                        binding.worker, s, rt.device, instance, update, rt.sync_state.paths)

            def aggregate() -> Any:
                total = done.result()
                binding.pull_waits.append((s, ins.minibatch, asked, ex.clock()))
                return total

            ex.in_background(s, ins, (AGGREGATED, ins.minibatch), aggregate)

        def merge(ex: Any, s: int, ins: MergeAggregate, aggregate: Any, *_: Any) -> None:
            rt, j = ex.runtimes[s], ins.minibatch
            rt.sync_state.merge(aggregate, first_minibatch=j + self.staleness + 1,
                                included=((w, j) for w in range(binding.group.num_workers)))
            if binding.worker == 0:  # the servers mirror worker 0's replica
                binding.servers.push(0, s, first_wave + j - 1, *rt.synchronisation.pushed(aggregate))

        return {ContributeUpdate: contribute, MergeAggregate: merge}

    def run_ended(self, binding: AllReduceBinding) -> None:
        """Ends the stages' communication threads of the run once their collectives have ended."""
        binding.lanes.settle(binding.timeout_s)

    def dry_handlers(self) -> Mapping[type[Instruction], Handler]:
        """The stage's side alone: the update is taken out and, as if no other worker had
        contributed, merged back as the aggregate (the same work, no change, no collective).

        Returns:
            The handlers by instruction type.
        """

        def contribute(ex: Any, s: int, ins: ContributeUpdate) -> None:
            update = ex.runtimes[s].sync_state.take_update(ins.minibatch + ex.schedule.num_in_flight)
            ex.in_background(s, ins, (AGGREGATED, ins.minibatch), lambda: update)

        def merge(ex: Any, s: int, ins: MergeAggregate, aggregate: Any, *_: Any) -> None:
            ex.runtimes[s].sync_state.merge(aggregate, ins.minibatch + self.staleness + 1, ())

        return {ContributeUpdate: contribute, MergeAggregate: merge}

    # The simulator and the planner ------------------------------------------------------------
    def simulation_model(self, staleness_bound: int, push_time: Timing, pull_time: Timing) -> "AllReduceModel":
        """The all-reduces in simulated time. `push_time(agent, instruction)` is the seconds for the
        stage's weights to cross its link once (n·β + α); an all-reduce moves
        :meth:`Compression.link_share` of them (a ring all-reduce 2(p-1)/p, as
        :func:`ring_allreduce_seconds` at level of pipeline 1; γ and S not modelled here).

        Returns:
            The model of the all-reduces.
        """
        self.checked_bound(staleness_bound)
        share = self.compression.link_share
        return AllReduceModel(lambda agent, ins, p: share(p) * push_time(agent, ins))


class AllReduceModel:
    """Simulated Pipe-SGD all-reduces: the all-reduce of minibatch j on stage s starts once stage
    s of every worker has contributed j and the stage's previous all-reduce is done (one
    communication thread per stage, Algorithm 1), and takes ``seconds(agent, instruction, p)``
    (p workers); every contributor gets the aggregate when it ends."""

    def __init__(self, seconds: Callable[[Agent, Instruction, int], float]) -> None:
        self.seconds = seconds
        # (stage, minibatch) -> {worker: (time, agent, instruction)}
        self.contributed: dict[tuple[int, int], dict[int, tuple[float, Agent, Instruction]]] = {}
        self.next: dict[int, int] = {}  # stage -> the minibatch of its next all-reduce
        self.link_free: dict[int, float] = {}  # stage -> when its previous all-reduce ended

    def receive(self, agent: Agent, key: Key, instruction: Instruction, time: float) -> None:
        """Takes `agent`'s contribution to an all-reduce at `time`.

        Raises:
            ValueError: `key` is not an all-reduce's.
        """
        kind, minibatch = key[0], key[1]
        if kind != "allreduce":
            raise ValueError(f"Pipe-SGD's all-reduce got an unknown request {key!r}")
        self.contributed.setdefault((agent[1], minibatch), {})[agent[0]] = (time, agent, instruction)

    def answers(self, agents: Sequence[Agent]) -> list[tuple[Agent, Key, float, float]]:
        """(agent, key, contributed, arrival) of every all-reduce that completes now, in order."""
        out: list[tuple[Agent, Key, float, float]] = []
        for stage in {s for _, s in agents}:
            members = {w for w, s in agents if s == stage}
            while True:
                j = self.next.get(stage, 1)
                by_worker = self.contributed.get((stage, j), {})
                if set(by_worker) != members:
                    break
                del self.contributed[(stage, j)]
                start = max([t for t, _, _ in by_worker.values()] + [self.link_free.get(stage, 0.0)])
                _, agent, ins = by_worker[min(by_worker)]
                end = start + self.seconds(agent, ins, len(members))
                self.link_free[stage], self.next[stage] = end, j + 1
                out += [(a, (AGGREGATED, j), t, end) for t, a, _ in by_worker.values()]
        return out


PIPE_SGD_SCHEME = register_sync(PipeSGD())
