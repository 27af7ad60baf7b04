"""Where a cluster's profile times the model's stages (ClusterDevices.profiling_device)."""
from hetpipe_tf.distributed.cluster_devices import ClusterDevices
from hetpipe_tf.planning.cluster import load_cluster


def test_a_profile_is_timed_on_an_unconstrained_nodes_worker_task():
    devices = ClusterDevices(load_cluster("local"), "processes")
    assert devices.profiling_device() == "/job:worker/task:0/device:CPU:0"


def test_a_quota_clusters_profile_is_timed_outside_every_quota_group():
    # A quota node's task runs at its quota: its times would be slowed by the group, then again by
    # the measured speed the planner applies to a quota type.
    devices = ClusterDevices(load_cluster("paper_quota"), "processes")
    assert devices.profiling_device() is None  # this process's CPU, outside the groups
