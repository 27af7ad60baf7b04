"""Data parallelism by all-reduce, the paper's Horovod baseline (HetPipe §8.3, Table 4).

Pure Python. Every device holds the whole model and trains its own minibatch; the
gradients are summed by AllReduce (§8.3: Horovod "uses AllReduce communication"), here
the bandwidth-optimal ring, in which every device sends and receives 2 (N - 1) / N times
the gradients' bytes; every device then applies the same update.

The ring visits the devices node by node, so it crosses each node's inter-node link
once (§8.1: the GPUs of a node share its PCIe 3 x16 bus, the nodes are joined by 56 Gb/s
InfiniBand), and moves at its slowest edge. An edge moves at ``min`` of the link model's
bandwidth (§7) and the rate the all-reduce implementation itself reaches on that kind of
edge (copies through the host, reductions), one inside a node and one between nodes
(:class:`AllReduceModel`); those rates are not in the paper and are calibrated.

Horovod [45] all-reduces each gradient as soon as the backward pass produces it, so the
all-reduce overlaps the backward pass: a step lasts the slowest device's forward pass,
then the longer of its backward pass and the all-reduce, then its update; the throughput
is N x batch / step.

A device that cannot hold the whole model with one minibatch is left out (§8.3: "the
whole model is too large to be loaded into a single GPU with G type, and thus, Horovod
uses only 12 GPUs"); with none left there is no prediction (Table 4's X).
"""
from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.planning.cluster import Cluster, Device
from hetpipe_tf.planning.cost_model import CostModel, LinkModel
from hetpipe_tf.planning.profile import AnalyticAssumptions, Profile


class DataParallelError(HetPipeUsageError, ValueError):
    """No device of the cluster can hold the whole model."""


@dataclass(frozen=True)
class AllReduceModel:
    """What a ring all-reduce reaches: caps on its edges' bandwidth (bytes/s; None: the
    links' own), on an edge inside a node and on one between nodes, and a fixed cost per
    ring step (seconds)."""
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    step_seconds: float = 0.0
    source: str = "assumed: the links' bandwidth"

    def __post_init__(self) -> None:
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"AllReduceModel {name} must be None (the links' own) or > 0 bytes/s, "
                                 f"got {value}")
        if self.step_seconds < 0:
            raise ValueError(f"AllReduceModel step_seconds must be >= 0, got {self.step_seconds}")

    def edge_bandwidth(self, src: Device, dst: Device, cluster: Cluster, links: LinkModel) -> float:
        """Bytes/s the ring moves from device `src` to device `dst`."""
        cap = self.intra_node_bandwidth if src.node == dst.node else self.inter_node_bandwidth
        own = links.bandwidth(src, dst, cluster)
        return min(own, cap) if cap else own


@dataclass(frozen=True)
class DataParallelPrediction:
    """Data parallelism's predicted step on a cluster (the paper's Horovod baseline, §8)."""
    devices: tuple[Device, ...]  # the devices that train
    left_out: tuple[Device, ...]  # those that cannot hold the model
    forward_seconds: float  # the slowest device's forward pass
    backward_seconds: float  # the slowest device's backward pass
    update_seconds: float  # the slowest device's update
    allreduce_seconds: float  # overlaps the backward pass
    gradient_bytes: int
    bytes_sent_per_device: float  # 2 (N - 1) / N x gradient bytes
    batch_size: int

    @property
    def compute_seconds(self) -> float:
        """A step's forward, backward and update seconds on the slowest device."""
        return self.forward_seconds + self.backward_seconds + self.update_seconds

    @property
    def step_seconds(self) -> float:
        """A step: the forward pass, then the longer of the backward pass and the all-reduce, then the update."""
        return self.forward_seconds + max(self.backward_seconds, self.allreduce_seconds) + self.update_seconds

    @property
    def images_per_s(self) -> float:
        """The predicted throughput: every device's minibatch per step."""
        return len(self.devices) * self.batch_size / self.step_seconds


def ring_allreduce_seconds(nbytes: float, devices: Sequence[Device], cluster: Cluster, links: LinkModel = LinkModel(),
                           allreduce: AllReduceModel = AllReduceModel()) -> float:
    """Seconds to all-reduce `nbytes` over `devices` (in ring order) by the ring algorithm."""
    n = len(devices)
    if n < 2 or nbytes <= 0:
        return 0.0
    edges = [(devices[i], devices[(i + 1) % n]) for i in range(n)]
    bandwidth = min(allreduce.edge_bandwidth(a, b, cluster, links) for a, b in edges)
    hop = max(links.intercept(a, b, cluster) for a, b in edges) + allreduce.step_seconds
    steps = 2 * (n - 1)
    return steps * hop + steps / n * nbytes / bandwidth


def predict_data_parallel(profile: Profile, cluster: Cluster, devices: Sequence[Device] | None = None,
                          links: LinkModel | None = None, allreduce: AllReduceModel = AllReduceModel(),
                          optimizer_slots: int = 1, analytic: AnalyticAssumptions | None = None
                          ) -> DataParallelPrediction:
    """A :class:`DataParallelPrediction` for `devices` (default: every device of `cluster`,
    node by node) training `profile`'s model, each on a minibatch of its batch size.

    Returns:
        The prediction.

    Raises:
        DataParallelError: no device holds the whole model.
    """
    link_model = links or LinkModel()
    model = CostModel(profile, cluster, links=link_model, optimizer_slots=optimizer_slots, analytic=analytic)
    chosen: tuple[Device, ...] = tuple(devices or cluster.devices())
    whole = {d: model.stage(0, profile.num_segments, [d], 0, 1) for d in chosen}
    kept = tuple(d for d in chosen if whole[d].memory_total <= whole[d].capacity)
    left_out = tuple(d for d in chosen if d not in kept)
    if not kept:
        need = min(st.memory_total for st in whole.values())
        raise DataParallelError(f"no device holds the whole of {profile.model} at batch {profile.batch_size} "
                                f"(it needs {need / 2 ** 30:.1f} GiB)")
    gradient_bytes = profile.total_weight_bytes
    n = len(kept)
    return DataParallelPrediction(
        devices=kept, left_out=left_out, forward_seconds=max(whole[d].forward for d in kept),
        backward_seconds=max(whole[d].backward for d in kept),
        update_seconds=max(whole[d].apply + whole[d].executor for d in kept),
        allreduce_seconds=ring_allreduce_seconds(gradient_bytes, kept, cluster, link_model, allreduce),
        gradient_bytes=gradient_bytes, bytes_sent_per_device=2 * (n - 1) / n * gradient_bytes if n > 1 else 0.0,
        batch_size=profile.batch_size)
