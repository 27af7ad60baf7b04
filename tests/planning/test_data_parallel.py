import json

import pytest

from hetpipe_tf.planning.cluster import PRESETS, load_cluster
from hetpipe_tf.planning.cost_model import LinkModel
from hetpipe_tf.planning.data_parallel import (AllReduceModel, DataParallelError, predict_data_parallel,
                                               ring_allreduce_seconds)
from hetpipe_tf.planning.profile import Profile

GiB = 2 ** 30


def profile(weights=GiB // 4, activations=GiB):
    return Profile(model="toy", batch_size=32, starts=(0, 1), weight_bytes=(weights // 2, weights // 2),
                   state_bytes=(0, 0), activation_bytes=(activations // 2, activations // 2), cut_bytes=(0, 1000),
                   forward_flops=(1e12, 1e12), backward_flops=(2e12, 2e12), traffic_bytes=(1e8, 1e8), kernels=(5, 5))


def test_ring_moves_two_n_minus_one_over_n_of_the_bytes_at_its_slowest_edge():
    cluster = load_cluster("paper")
    v = cluster.devices()[:4]
    r = cluster.devices()[4:8]
    links = LinkModel(intra_scale=1.0, inter_scale=1.0, inter_intercept=0.0)
    assert ring_allreduce_seconds(15.75e9, v, cluster, links) == pytest.approx(2 * 3 / 4)
    assert ring_allreduce_seconds(7e9, v + r, cluster, links) == pytest.approx(2 * 7 / 8)  # InfiniBand is slower
    capped = AllReduceModel(intra_node_bandwidth=1e9, step_seconds=0.01)
    assert ring_allreduce_seconds(1e9, v, cluster, links, capped) == pytest.approx(1.5 + 6 * 0.01)
    assert ring_allreduce_seconds(1e9, v[:1], cluster, links) == 0.0


def test_a_ring_that_crosses_nodes_moves_at_the_inter_node_rate_and_one_inside_a_node_does_not():
    cluster = load_cluster("paper")
    v, r = cluster.devices()[:4], cluster.devices()[4:8]
    links = LinkModel(intra_scale=1.0, inter_scale=1.0, inter_intercept=0.0)
    rates = AllReduceModel(intra_node_bandwidth=2e9, inter_node_bandwidth=0.5e9)
    assert ring_allreduce_seconds(1e9, v, cluster, links, rates) == pytest.approx(2 * 3 / 4 / 2)
    assert ring_allreduce_seconds(1e9, v + r, cluster, links, rates) == pytest.approx(2 * 7 / 8 / 0.5)
    faster_link = AllReduceModel(intra_node_bandwidth=2e9, inter_node_bandwidth=50e9)  # the link's 7 GB/s rules
    assert ring_allreduce_seconds(1e9, v + r, cluster, links, faster_link) == pytest.approx(2 * 7 / 8 / 2)


@pytest.mark.parametrize("field", ["intra_node_bandwidth", "inter_node_bandwidth"])
def test_an_allreduce_rate_must_be_positive(field):
    with pytest.raises(ValueError, match=f"{field} must be None .* or > 0 bytes/s, got 0"):
        AllReduceModel(**{field: 0})
    with pytest.raises(ValueError, match="step_seconds must be >= 0, got -1"):
        AllReduceModel(step_seconds=-1)


def test_the_allreduce_overlaps_the_backward_pass():
    cluster = load_cluster("paper")
    v = cluster.devices()[:4]
    hidden = predict_data_parallel(profile(), cluster, devices=v)  # 0.8 of PCIe: shorter than the backward pass
    assert 0 < hidden.allreduce_seconds < hidden.backward_seconds
    assert hidden.step_seconds == pytest.approx(hidden.compute_seconds)
    slow = predict_data_parallel(profile(), cluster, devices=v, allreduce=AllReduceModel(intra_node_bandwidth=1e8))
    assert slow.allreduce_seconds > slow.backward_seconds
    assert slow.step_seconds == pytest.approx(slow.forward_seconds + slow.allreduce_seconds + slow.update_seconds)


def test_a_step_is_the_slowest_device_overlapped_with_the_allreduce_and_small_devices_are_left_out():
    cluster = load_cluster("paper")
    p = predict_data_parallel(profile(), cluster)
    assert len(p.devices) == 16 and not p.left_out
    assert p.images_per_s == pytest.approx(16 * 32 / (p.forward_seconds + max(p.backward_seconds, p.allreduce_seconds)
                                                      + p.update_seconds))
    only_v = predict_data_parallel(profile(), cluster, devices=cluster.devices()[:4])
    assert only_v.compute_seconds < p.compute_seconds  # Q is the slowest of all
    big = predict_data_parallel(profile(activations=7 * GiB), cluster)  # the 6 and 8 GiB GPUs cannot hold it
    assert {d.type.name for d in big.left_out} == {"G", "Q"} and len(big.devices) == 8
    spec = json.loads(json.dumps(PRESETS["paper"]))
    spec["nodes"] = [n for n in spec["nodes"] if n["device_type"] == "G"]
    with pytest.raises(DataParallelError, match="no device holds"):
        predict_data_parallel(profile(activations=7 * GiB), load_cluster(spec))
