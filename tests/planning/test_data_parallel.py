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
    capped = AllReduceModel(bandwidth=1e9, step_seconds=0.01)
    assert ring_allreduce_seconds(1e9, v, cluster, links, capped) == pytest.approx(1.5 + 6 * 0.01)
    assert ring_allreduce_seconds(1e9, v[:1], cluster, links) == 0.0


def test_a_step_is_the_slowest_device_plus_the_allreduce_and_small_devices_are_left_out():
    cluster = load_cluster("paper")
    p = predict_data_parallel(profile(), cluster)
    assert len(p.devices) == 16 and not p.left_out
    assert p.images_per_s == pytest.approx(16 * 32 / (p.compute_seconds + p.allreduce_seconds))
    only_v = predict_data_parallel(profile(), cluster, devices=cluster.devices()[:4])
    assert only_v.compute_seconds < p.compute_seconds  # Q is the slowest of all
    big = predict_data_parallel(profile(activations=7 * GiB), cluster)  # the 6 and 8 GiB GPUs cannot hold it
    assert {d.type.name for d in big.left_out} == {"G", "Q"} and len(big.devices) == 8
    spec = json.loads(json.dumps(PRESETS["paper"]))
    spec["nodes"] = [n for n in spec["nodes"] if n["device_type"] == "G"]
    with pytest.raises(DataParallelError, match="no device holds"):
        predict_data_parallel(profile(activations=7 * GiB), load_cluster(spec))
