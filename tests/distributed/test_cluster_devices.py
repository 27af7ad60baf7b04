"""Where a cluster's devices run: the worker tasks and a virtual worker's own process (ClusterDevices.worker), and where a
profile times the model's stages (ClusterDevices.profiling_device)."""
from hetpipe_tf.distributed.cluster_devices import ClusterDevices
from hetpipe_tf.distributed.protocol import local_device
from hetpipe_tf.planning.cluster import load_cluster


def test_a_profile_is_timed_on_an_unconstrained_nodes_worker_task():
    devices = ClusterDevices(load_cluster("local"), "processes")
    assert devices.profiling_device() == "/job:worker/task:0/device:CPU:0"


def test_a_quota_clusters_profile_is_timed_outside_every_quota_group():
    # A quota node's task runs at its quota: its times would be slowed by the group, then again by
    # the measured speed the planner applies to a quota type.
    devices = ClusterDevices(load_cluster("paper_quota"), "processes")
    assert devices.profiling_device() is None  # this process's CPU, outside the groups


def _ed_worker(cluster):
    """A virtual worker of one device of every node (ED's), its first stage on node 0."""
    devices = [next(d for d in cluster.devices() if d.node == n.name) for n in cluster.nodes]
    return devices, tuple(range(1, len(devices)))


def test_no_quota_device_is_held_in_a_virtual_workers_process():
    # A quota device is a device's compute, run by its node's worker task in the node's group; the
    # virtual worker's process is the host's runtime, outside every group: it holds none of them,
    # its home node's included.
    cluster = load_cluster("paper_quota")
    devices, boundaries = _ed_worker(cluster)
    spec, local = ClusterDevices(cluster, "processes").worker(0, devices, boundaries)
    assert local == 0
    assert spec.tf_devices == tuple(f"/job:worker/task:{n}/device:CPU:0" for n in range(len(cluster.nodes)))


def test_a_home_nodes_host_devices_without_a_quota_stay_in_the_virtual_workers_process():
    cluster = load_cluster("local")
    devices, boundaries = _ed_worker(cluster)
    spec, local = ClusterDevices(cluster, "processes").worker(0, devices, boundaries)
    assert local == 1
    assert spec.tf_devices[0] == local_device(0, 0)
