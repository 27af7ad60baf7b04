"""The TensorFlow devices that serve a plan's virtual workers and servers, as a launch mode names them.

A cluster description's devices (:mod:`hetpipe_tf.planning.cluster`) run, by launch mode:

* ``in_process``: every device a logical device of this process (a logical CPU per emulated or
  host-CPU device, :func:`hetpipe_tf.runtime.logical_devices.configure_tensorflow_devices`), and
  the parameter server of node n the first device of that node;
* ``processes`` and ``tf_config``: node n's devices on its worker task (its logical CPUs, its
  GPUs) and its parameter server on its ps task; a virtual worker's own process (on its home node,
  the node of its first stage) holds the home node's emulated and host-CPU devices itself
  (:func:`hetpipe_tf.distributed.protocol.local_device`), but not CPU-quota ones, and reaches
  the others on their node's worker task. A node of GPUs is device i = its worker task's ``GPU:i``: under
  ``processes`` the task sees only its node's GPUs, in the node's order
  (:mod:`hetpipe_tf.distributed.gpus`), whichever indices of this machine they are.

A CPU-quota node (:mod:`hetpipe_tf.distributed.cgroups`) runs at its quota only in its worker task,
which ``processes`` (``hetpipe launch`` too, for ``tf_config``) starts in the node's group: a
quota device is the compute of a device, and a virtual worker's own process is the host's runtime
that drives it (its executor, its remote calls, its pushes and pulls), as a GPU server's Python
process runs on its host's CPU while the GPU computes. So every stage on a quota device runs on its
node's worker task, the home node's too, and the virtual worker's process runs outside every group.
``in_process``, where every device is a thread of this process, is refused for it.
"""
from hetpipe_tf.distributed.launch import ps_device, worker_device
from hetpipe_tf.distributed.protocol import local_device
from hetpipe_tf.planning.cluster import Cluster
from hetpipe_tf.planning.devices import DeviceSpec
from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices
from hetpipe_tf.runtime.run_config import WorkerSpec

#: Where a run's tasks run (see the module docstring).
LAUNCHES = ("processes", "tf_config", "in_process")


def device_spec(device) -> DeviceSpec:
    """The DeviceSpec that serves a cluster device (:mod:`hetpipe_tf.planning.devices`)."""
    t = device.type
    if t.emulated:
        return DeviceSpec("emulated", speed=t.emulated_speed, memory=t.memory)
    return DeviceSpec("cpu") if t.host_cpu else DeviceSpec("gpu", index=device.index)


class ClusterDevices:
    """The TensorFlow devices of `cluster` (a :class:`hetpipe_tf.planning.cluster.Cluster`) under
    `launch` (see the module docstring)."""

    def __init__(self, cluster: Cluster, launch: str) -> None:
        quotas = sorted(name for name, t in cluster.device_types.items() if t.cpu_quota is not None)
        if launch == "in_process" and quotas:
            raise ValueError(f"cluster '{cluster.name}' has CPU-quota device types {quotas}, which run at their quota "
                             f"only in their node's processes; launch='in_process' runs every device in this process: "
                             f"use launch='processes'")
        self.cluster = cluster
        self.launch = launch
        self._nodes = [n.name for n in cluster.nodes]
        self._local = None  # in_process: this process's logical device of every cluster device, in order
        if launch == "in_process":
            self._local = configure_tensorflow_devices([device_spec(d) for d in cluster.devices()])
            flat = [(n, i) for n, node in enumerate(cluster.nodes) for i in range(node.count)]
            self._index = {key: i for i, key in enumerate(flat)}

    @property
    def ps(self) -> list:
        """The parameter-server device of every node."""
        if self._local is not None:
            return [self._local[self._index[(n, 0)]] for n in range(len(self._nodes))]
        return [ps_device(n) for n in range(len(self._nodes))]

    def device(self, device) -> str:
        """The TensorFlow device of a cluster device, on its node."""
        node = self._nodes.index(device.node)
        if self._local is not None:
            return self._local[self._index[(node, device.index)]]
        return worker_device(node, "CPU" if device.type.on_host else "GPU", device.index)

    def home_node(self, devices) -> int:
        """The node a virtual worker of `devices` (its devices in stage order) is driven from: its first stage's."""
        return self._nodes.index(devices[0].node)

    def worker(self, w, devices, boundaries, references=None, home=None) -> tuple:
        """Virtual worker `w`'s :class:`WorkerSpec` (its `devices` in stage order, cut at `boundaries`,
        paced to `references`) and how many of its devices its own process holds: those on its home
        node (`home`, the node's index in the cluster; default its first stage's, :meth:`home_node`)
        but real GPUs and CPU-quota devices (their node's worker task holds them, see the module
        docstring); none in_process."""
        home = self.home_node(devices) if home is None else home
        specs, names, servers, local = [], [], [], 0
        ps = self.ps
        for d in devices:
            specs.append(device_spec(d))
            node = self._nodes.index(d.node)
            if self._local is None and node == home and d.type.on_host and d.type.cpu_quota is None:
                names.append(local_device(w, local))
                local += 1
            else:
                names.append(self.device(d))
            servers.append(ps[node % len(ps)])
        return WorkerSpec(tuple(specs), tuple(names), boundaries=tuple(boundaries), stage_servers=tuple(servers),
                          references=references), local

    def profiling_device(self) -> str | None:
        """Where a profile times the stages: None (this process's CPU) in process; on a cluster, the
        worker task's CPU of the first node with a host device (an emulated or CPU one) outside a
        CPU-quota group, or None. A quota node's task is not it: its times are the host's, and a
        quota type's are its measured speed applied to them
        (:func:`hetpipe_tf.distributed.node_speed.with_measured_speeds`), not its group's again."""
        if self._local is not None:
            return None
        host = next((d for d in self.cluster.devices() if d.type.on_host and d.type.cpu_quota is None), None)
        return None if host is None else self.device(host)
