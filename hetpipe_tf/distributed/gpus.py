"""This machine's GPUs, and which of them each task of a local cluster sees (``launch="processes"``).

A cluster description's node of a real accelerator type (:mod:`hetpipe_tf.planning.cluster`) is,
on this machine, a set of its GPUs:

* the indices its ``"gpus"`` names (``"gpus": [0, 1]``, one per device of the node), or, for a
  node that names none, the next free ones in file order: the lowest indices no node names,
  `count` of them per node, node after node;
* an index is a GPU's position among those TensorFlow lists here (:func:`physical_gpus`). Where
  the environment already pins GPUs (``CUDA_VISIBLE_DEVICES`` set, as a scheduler does), that
  list is the pinned GPUs and an index is a position in it: index 0 is the first GPU the
  scheduler gave; :meth:`GPULayout.describe` says so;
* a node is one kind of GPU (HetPipe §3: a node is a homogeneous set of GPUs): its GPUs must have
  one name.

Refused, with what was given and what exists: an index this machine does not have, a GPU in two
nodes (:mod:`hetpipe_tf.planning.cluster` refuses the indices a file names twice, more indices
than the node's count, and indices on an emulated or host-CPU node), a node without enough free
GPUs, a node of two kinds of GPU.

What each task sees (:meth:`GPULayout.worker_env`, :data:`NO_GPU`):

* node n's worker task: ``CUDA_VISIBLE_DEVICES`` = its GPUs, so that inside it they are
  ``/GPU:0`` .. ``/GPU:count-1`` in the node's order: device i of the node is the task's
  ``GPU:i``, the name :class:`hetpipe_tf.distributed.cluster_devices.ClusterDevices` gives it;
* every other task sees no GPU (``CUDA_VISIBLE_DEVICES=""``): the parameter-server tasks (the
  global weights live on their CPU), the worker tasks of emulated and host-CPU nodes, and the
  virtual workers' processes (they reach the stages on GPUs through the node's worker task); the
  chief hides them too (:func:`hide_gpus_here`), so that no process but a node's worker task
  takes memory on a GPU;
* memory: each GPU of a worker task grows its memory as it needs (no process holds a whole card
  up front) up to a limit, the node's device type's ``memory``: what the planner fits each
  stage into. Where the GPU has less, its own is the limit, and :meth:`GPULayout.describe` says so.

The seam: :func:`physical_gpus` is the one place that asks the machine. It runs TensorFlow in a
child process (``python -m hetpipe_tf.distributed.gpus`` prints the listing as JSON), so that the
indices are those CUDA gives TensorFlow (nvidia-smi numbers GPUs in PCI-bus order and ignores
``CUDA_VISIBLE_DEVICES``; CUDA numbers the fastest first unless ``CUDA_DEVICE_ORDER`` says
otherwise), and so that the chief's own TensorFlow has touched no GPU before it hides them. With
``HETPIPE_FAKE_GPUS`` naming a JSON file (a list of ``{"index", "name", "memory",
"compute_capability"}``), that file is the listing instead, in this process and in every task it
starts: the tests run the code above the seam on a machine without a GPU.
"""
import functools
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetpipe_tf.pipeline.emulation import format_bytes
from hetpipe_tf.planning.cluster import Cluster, ClusterError
from hetpipe_tf.planning.devices import DeviceSpecError, parse_bytes

if TYPE_CHECKING:
    import tensorflow as tf

#: The environment variable naming a JSON file that lists the GPUs in place of the machine's.
FAKE_GPUS_ENV = "HETPIPE_FAKE_GPUS"
#: The environment of a task that sees no GPU.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@dataclass(frozen=True)
class PhysicalGPU:
    """One GPU as TensorFlow lists it here: its position in the list, its name, the memory
    TensorFlow can allocate on it (bytes) and its compute capability (major, minor)."""
    index: int
    name: str
    memory: int
    compute_capability: tuple[int, int] | None = None

    def describe(self) -> str:
        cc = "" if self.compute_capability is None else f", compute capability {self.compute_capability[0]}." \
                                                         f"{self.compute_capability[1]}"
        return f"GPU {self.index}: {self.name} ({format_bytes(self.memory)}{cc})"


def gpus_from_json(rows: object, where: str) -> tuple[PhysicalGPU, ...]:
    """PhysicalGPUs from a JSON listing (a list of objects with index, name, memory, and
    compute_capability [major, minor] or null); a ClusterError naming `where` if malformed."""
    if not isinstance(rows, list):
        raise ClusterError(f"{where}: a GPU listing is a JSON list of {{index, name, memory, compute_capability}}, "
                           f"got {type(rows).__name__}")
    gpus = []
    for i, row in enumerate(rows):
        try:
            cc = row.get("compute_capability")
            gpus.append(PhysicalGPU(index=int(row["index"]), name=str(row["name"]), memory=parse_bytes(row["memory"]),
                                    compute_capability=None if cc is None else (int(cc[0]), int(cc[1]))))
        except (AttributeError, KeyError, TypeError, ValueError, IndexError, DeviceSpecError) as e:
            raise ClusterError(f"{where}: GPU {i} of the listing is not {{index, name, memory, compute_capability}} "
                               f"({type(e).__name__}: {e}): {row!r}") from None
    if [g.index for g in gpus] != list(range(len(gpus))):
        raise ClusterError(f"{where}: the listing's indices are {[g.index for g in gpus]}; they are positions, "
                           f"0 to {len(gpus) - 1} in order")
    return tuple(gpus)


def physical_gpus(environ: Mapping[str, str] | None = None) -> tuple[PhysicalGPU, ...]:
    """This machine's GPUs as TensorFlow lists them (within ``CUDA_VISIBLE_DEVICES`` if it is set):
    the seam (see the module docstring). The fake listing of ``HETPIPE_FAKE_GPUS`` if that is set."""
    environ = os.environ if environ is None else environ
    return _listing(environ.get(FAKE_GPUS_ENV) or None, environ.get("CUDA_VISIBLE_DEVICES"))


@functools.lru_cache(maxsize=8)
def _listing(fake: str | None, visible: str | None) -> tuple[PhysicalGPU, ...]:
    """The listing of a fake file, or of TensorFlow in a child process (under `visible`), once per
    process for each."""
    if fake is not None:
        try:
            with open(fake) as f:
                return gpus_from_json(json.load(f), f"{FAKE_GPUS_ENV}={fake}")
        except (OSError, ValueError) as e:
            raise ClusterError(f"{FAKE_GPUS_ENV}={fake}: cannot read a GPU listing ({e})") from None
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run([sys.executable, "-m", "hetpipe_tf.distributed.gpus"], check=False, capture_output=True,
                          text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise ClusterError(f"listing this machine's GPUs with TensorFlow failed (exit {done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    return gpus_from_json(json.loads(done.stdout.strip().splitlines()[-1]), "TensorFlow's GPU listing")


@dataclass(frozen=True)
class NodeGPUs:
    """The GPUs of one node: positions in the listing (the node's device order), the
    ``CUDA_VISIBLE_DEVICES`` value that shows them to its worker task, and each one's memory
    limit in bytes (its task's ``GPU:i``, in order)."""
    node: str
    indices: tuple[int, ...]
    visible: str
    memory_limits: tuple[int, ...]


@dataclass(frozen=True)
class GPULayout:
    """Which GPUs each node's worker task sees (see the module docstring): per node of the
    cluster, its :class:`NodeGPUs`, or None for a node this host's CPU serves."""
    nodes: tuple[NodeGPUs | None, ...]
    gpus: tuple[PhysicalGPU, ...] = ()
    pinned: str | None = None  # CUDA_VISIBLE_DEVICES of the environment, where it was set
    notes: tuple[str, ...] = ()

    @property
    def has_gpus(self) -> bool:
        return any(n is not None for n in self.nodes)

    def worker_env(self, node: int) -> dict[str, str]:
        """The environment of node `node`'s worker task: its GPUs only (none for a node without)."""
        gpus = self.nodes[node]
        return {"CUDA_VISIBLE_DEVICES": gpus.visible} if gpus is not None else dict(NO_GPU)

    def worker_args(self, node: int) -> list[str]:
        """The server flags of node `node`'s worker task: each visible GPU's memory limit, in MiB."""
        gpus = self.nodes[node]
        if gpus is None:
            return []
        return ["--gpu_memory_mb=" + ",".join(str(m // 1024 ** 2) for m in gpus.memory_limits)]

    def describe(self) -> str:
        """Which node has which GPUs, as lines (the pinned environment and the limits noted)."""
        lines = [(f"hetpipe: CUDA_VISIBLE_DEVICES={self.pinned} was set (a scheduler pinned these GPUs): the "
                  f"cluster's GPU indices are positions in it")] if self.pinned is not None else []
        for gpus in self.nodes:
            if gpus is not None:
                names = ", ".join(f"{i} -> GPU:{j} ({self.gpus[i].name}, at most "
                                  f"{format_bytes(gpus.memory_limits[j])})" for j, i in enumerate(gpus.indices))
                lines.append(f"hetpipe: node '{gpus.node}': CUDA_VISIBLE_DEVICES={gpus.visible}: {names}")
        return "\n".join(lines + [f"hetpipe: {n}" for n in self.notes])


def _known(gpus: Sequence[PhysicalGPU], pinned: str | None) -> str:
    here = "; ".join(g.describe() for g in gpus) if gpus else "none"
    within = f" within CUDA_VISIBLE_DEVICES={pinned!r} (indices are positions in it)" if pinned is not None else ""
    hint = "" if gpus else " (is tensorflow-cpu installed rather than the gpu extra, or are the drivers missing?)"
    return f"TensorFlow lists {len(gpus)} GPU(s) here{within}: {here}{hint}"


def gpu_layout(cluster: Cluster, gpus: Sequence[PhysicalGPU] | None = None,
               environ: Mapping[str, str] | None = None) -> GPULayout:
    """The GPUs of every node of `cluster` on this machine (see the module docstring), checked
    against `gpus` (None: :func:`physical_gpus`, asked only when the cluster has a node of a real
    accelerator type); ClusterError for what cannot be served."""
    environ = os.environ if environ is None else environ
    if all(cluster.device_types[n.device_type].on_host for n in cluster.nodes):
        return GPULayout(nodes=(None,) * len(cluster.nodes))
    listing = tuple(physical_gpus(environ) if gpus is None else gpus)
    pinned = environ.get("CUDA_VISIBLE_DEVICES")
    pinned_ids = [p.strip() for p in pinned.split(",")] if pinned else []
    named = {g for n in cluster.nodes for g in n.gpus or ()}
    free = [g.index for g in listing if g.index not in named]
    nodes: list[NodeGPUs | None] = []
    notes = []
    for node in cluster.nodes:
        device_type = cluster.device_types[node.device_type]
        if device_type.on_host:
            nodes.append(None)
            continue
        if node.gpus is not None:
            missing = [g for g in node.gpus if g >= len(listing)]
            if missing:
                raise ClusterError(f"cluster '{cluster.name}': node '{node.name}' names GPU {missing[0]}, which this "
                                   f"machine does not have; {_known(listing, pinned)}")
            indices = node.gpus
        else:
            if len(free) < node.count:
                raise ClusterError(f"cluster '{cluster.name}': node '{node.name}' ({node.count} devices of type "
                                   f"'{device_type.name}') names no gpus and takes the next free ones, but "
                                   f"{len(free)} are left ({free}); {_known(listing, pinned)}")
            indices, free = tuple(free[:node.count]), free[node.count:]
        kinds = sorted({listing[i].name for i in indices})
        if len(kinds) > 1:
            raise ClusterError(f"cluster '{cluster.name}': node '{node.name}' has GPUs {list(indices)} of "
                               f"{len(kinds)} kinds {kinds}; a node is one kind of GPU (one device type): "
                               f"make a node for each")
        limits = []
        for i in indices:
            limit = min(device_type.memory, listing[i].memory)
            if limit < device_type.memory:
                notes.append(f"node '{node.name}': device type '{device_type.name}' gives "
                             f"{format_bytes(device_type.memory)}, GPU {i} ({listing[i].name}) has "
                             f"{format_bytes(listing[i].memory)} for TensorFlow: its limit is the GPU's (plan "
                             f"with the smaller memory to keep the planned stages within it)")
            limits.append(limit)
        ids = [pinned_ids[i] if pinned_ids and i < len(pinned_ids) else str(i) for i in indices]
        nodes.append(NodeGPUs(node.name, tuple(indices), ",".join(ids), tuple(limits)))
    return GPULayout(nodes=tuple(nodes), gpus=listing, pinned=pinned, notes=tuple(notes))


def hide_gpus_here() -> bool:
    """Hides every GPU from this process's TensorFlow (a chief or a virtual worker's process: the
    GPUs are the nodes' worker tasks'); False when TensorFlow had already started and keeps them."""
    import tensorflow as tf  # late: defers TensorFlow

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        return False
    return True


def _list_with_tensorflow() -> list[dict[str, object]]:
    """The GPUs of this process's TensorFlow, as :func:`gpus_from_json` reads them (run in a child
    process by :func:`physical_gpus`: listing their memory starts TensorFlow on every GPU)."""
    import tensorflow as tf  # late: only the child process that lists the GPUs starts TensorFlow

    from hetpipe_tf.compat import device_lib  # late: as above; the memory TensorFlow can allocate on each GPU

    physical = tf.config.list_physical_devices("GPU")
    for gpu in physical:
        tf.config.experimental.set_memory_growth(gpu, True)
    memory = [d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU"]
    rows = []
    for i, gpu in enumerate(physical):
        details = tf.config.experimental.get_device_details(gpu)
        cc = details.get("compute_capability")
        rows.append({"index": i, "name": details.get("device_name", gpu.name), "memory": int(memory[i]),
                     "compute_capability": list(cc) if cc else None})
    return rows


def server_config(logical_cpus: int, intra_op_threads: int, gpu_memory_mb: list[int]) -> "tf.compat.v1.ConfigProto":
    """The config a task's server (:mod:`hetpipe_tf.distributed.server`) builds its devices from (not from tf.config's logical
    devices): `logical_cpus` CPU devices, and, per GPU it sees, memory that grows as needed up to
    `gpu_memory_mb[i]` MiB (none given: TensorFlow's defaults)."""
    import tensorflow as tf  # late: defers TensorFlow

    config = tf.compat.v1.ConfigProto(device_count={"CPU": logical_cpus}, intra_op_parallelism_threads=intra_op_threads,
                                      inter_op_parallelism_threads=max(2, logical_cpus + 1))
    if gpu_memory_mb:
        config.gpu_options.allow_growth = True
        for limit in gpu_memory_mb:
            config.gpu_options.experimental.virtual_devices.add(memory_limit_mb=[float(limit)])
    return config

if __name__ == "__main__":
    print(json.dumps(_list_with_tensorflow()))
