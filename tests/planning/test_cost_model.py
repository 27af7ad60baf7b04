import dataclasses

import pytest

from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.pipeline.hetpipe import HETPIPE
from hetpipe_tf.planning.cost_model import CostModel, LinkModel, fit_line, link_flows, non_compute_instructions
from hetpipe_tf.planning.profile import Profile
from tests.helpers.profiles import toy_profile


def test_in_flight_depends_on_stage_position():
    assert [HETPIPE.activations_held(q, 4, 4) for q in range(4)] == [4, 3, 2, 1]
    assert [HETPIPE.activations_held(q, 4, 2) for q in range(4)] == [2, 2, 2, 1]


def test_stage_time_and_memory():
    cluster = load_cluster("local")
    f0, f1, s0, s1 = cluster.devices()
    model = CostModel(toy_profile(), cluster, links=LinkModel(intra_scale=1.0), dilation=2.0, optimizer_slots=1)
    first, last = model.stages((0, 2), [f0, s0], num_in_flight=3)
    # first: F at speed 1, dilation 2; the gradient (500 B) comes from the other node.
    assert first.forward == pytest.approx(2 * (0.5 + 2))
    assert first.backward == pytest.approx(2 * (0.25 + 4))
    assert first.recv_gradient == pytest.approx(50e-6 + 500 / (10e9 * 0.9)) and first.recv_activation == 0
    assert model.stages((0, 2), [f0, f1], 3)[0].recv_gradient == pytest.approx(500 / 10e9)  # same node
    assert first.apply == pytest.approx(0.1 + 0.2)
    assert last.forward == pytest.approx(4 * (0.5 + 2))  # speed 0.5
    assert first.memory["activations"] == 2 * 2000  # min(Nm=3, k - 0 = 2)
    assert last.memory["activations"] == 1 * (500 + 2000)  # the last holds one, with what it received
    assert first.memory["weights and versions"] == 200 * (1 + 3)
    assert first.memory["optimizer slots"] == 200 and first.memory["framework reserve"] == 0


def test_links_follow_section_7():
    cluster = load_cluster("paper")
    v0, v1 = cluster.devices()[:2]
    r0 = cluster.devices()[4]
    links = LinkModel(intra_scale=0.5, inter_intercept=1e-3, inter_scale=1.0)
    assert links.seconds(15.75e9, v0, v1, cluster) == pytest.approx(2.0)
    assert links.seconds(7e9, v0, r0, cluster) == pytest.approx(1.001)
    assert links.seconds(0, v0, r0, cluster) == 0
    slow = dataclasses.replace(cluster, inter_node_latency=0.5e-3)  # links.inter_node_latency_ms: 0.5
    assert links.seconds(7e9, v0, r0, slow) == pytest.approx(1.0015)
    assert links.seconds(15.75e9, v0, v1, slow) == pytest.approx(2.0)


def test_host_cpu_devices_take_host_times_without_dilation():
    cluster = load_cluster("local_cpu")
    d = cluster.devices()[0]
    stage = CostModel(toy_profile(), cluster, dilation=3.0).stage(0, 4, [d], 0, 1)
    assert stage.forward == pytest.approx(0.5 + 4.0)  # the host's overhead and segments, unscaled
    assert stage.memory["framework reserve"] == 0


def test_real_devices_use_analytic_times_and_reserve():
    cluster = load_cluster("paper")
    v = cluster.devices()[0]
    stage = CostModel(toy_profile(), cluster).stage(0, 4, [v], 0, 1)
    assert stage.memory["framework reserve"] > 0 and stage.forward > 0


def test_executor_cost_counts_the_schedules_non_compute_instructions():
    # first: LoadMinibatch, SendActivation, RecvGradient, ReleaseWeights, StashWeights
    # middle: + RecvActivation, SendGradient instead of LoadMinibatch; last: RecvActivation,
    # RecvLabels, SendGradient, ReleaseWeights, StashWeights; alone: Load, RecvLabels, Release, Stash
    assert [non_compute_instructions(q, 3) for q in range(3)] == [5, 6, 5]
    assert non_compute_instructions(0, 1) == 4
    cluster = load_cluster("local")
    profile = toy_profile()
    model = CostModel(Profile(**{**profile._fields(), "instruction_seconds": 0.01}), cluster)
    assert model.stage(0, 2, cluster.devices()[:3], 1, 2).executor == pytest.approx(0.06)


def test_apply_writes_a_fresh_buffer_when_versions_are_stashed():
    cluster = load_cluster("local")
    profile = Profile(**{**toy_profile()._fields(), "apply_shared_per_byte": 0.002})
    model = CostModel(profile, cluster)
    f = cluster.devices()[0]
    assert model.stage(0, 4, [f], 0, 1).apply == pytest.approx(0.1 + 400 * 0.001)
    assert model.stage(0, 4, [f], 0, 2).apply == pytest.approx(0.1 + 400 * 0.002)


def test_links_are_calibrated_from_transfer_samples():
    cluster = load_cluster("paper")
    v0, v1, r0 = cluster.devices()[0], cluster.devices()[1], cluster.devices()[4]
    intra = [(b, 20e-6 + b / 12e9) for b in (1e5, 1e6, 1e7)]  # 12 GB/s of PCIe's nominal 15.75
    inter = [(b, 80e-6 + b / 5e9) for b in (1e5, 1e6, 1e7, 1e8)]
    links = LinkModel().calibrated(cluster, intra_samples=intra, inter_samples=inter)
    assert links.intra_scale == pytest.approx(12 / 15.75) and links.intra_intercept == pytest.approx(20e-6)
    assert links.seconds(1e8, v0, r0, cluster) == pytest.approx(80e-6 + 1e8 / 5e9)
    assert links.seconds(1e8, v0, v1, cluster) == pytest.approx(20e-6 + 1e8 / 12e9)
    assert links.source.startswith("calibrated: intra-node 20 us + bytes / 12.00 GB/s")
    assert fit_line([(0, 1.0), (2, 3.0)]) == pytest.approx((1.0, 1.0))
    with pytest.raises(ValueError, match="two sizes"):
        fit_line([(5, 1.0)])


def test_workers_crossing_the_same_nodes_share_the_inter_node_link():
    cluster = load_cluster("paper")
    v0, v1, v2, v3, r0, r1, r2, r3 = cluster.devices()[:8]
    links = LinkModel(inter_intercept=0.0, inter_scale=1.0)
    assert links.seconds(7e9, v0, r0, cluster, flows=4) == pytest.approx(4.0)
    assert links.seconds(15.75e9, v0, v1, cluster, flows=4) == pytest.approx(1 / 0.8)  # a PCIe link each
    workers = [(v0, r0), (v1, r1), (v2, r2), (v3,)]
    assert link_flows(workers) == ((("node-R", "node-V"), 3),)
    model = CostModel(toy_profile(), cluster, links=links, link_flows=link_flows(workers))
    assert model.link_seconds(7e9, r0, v0) == pytest.approx(3.0)
    assert model.link_seconds(7e9, v0, v1) == pytest.approx(7e9 / (15.75e9 * 0.8))
    assert CostModel(toy_profile(), cluster, links=links).link_seconds(7e9, r0, v0) == pytest.approx(1.0)
