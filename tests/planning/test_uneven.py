"""Uneven minibatches per virtual worker (issue 14 item 4): sizes by predicted throughput, within
every stage's memory, and the weights of the servers' pushes."""
import pytest

from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.planning.cost_model import CostModel
from hetpipe_tf.planning.planner import PlanError, plan, simulate_plan
from hetpipe_tf.planning.request import PlanRequest, PlanRequestError
from hetpipe_tf.planning.profile import Profile, SegmentTimes
from hetpipe_tf.planning.uneven import (UnevenMinibatchError, at_batch_size, memory_cap, proportional_sizes,
                                        push_weights)
from hetpipe_tf.sync.wsp import WSP_SCHEME

MIB = 2 ** 20


def _profile(n=4, batch=32):
    """Four equal segments, 1 MiB of activations each at batch 32, measured on the host."""
    return Profile(model="toy", batch_size=batch, starts=tuple(range(n)), weight_bytes=(64 * 1024,) * n,
                   state_bytes=(0,) * n, activation_bytes=(MIB,) * n, cut_bytes=(0,) + (1024,) * (n - 1),
                   forward_flops=(1e6,) * n, backward_flops=(2e6,) * n, traffic_bytes=(1e6,) * n,
                   kernels=(1,) * n, layer_names=tuple(f"l{i}" for i in range(n)),
                   times={"host": SegmentTimes((2e-3,) * n, (4e-3,) * n, 1e-4, 1e-4, "made up")})


def _cluster(fast_memory="64M", slow_memory="64M"):
    """Two nodes of two emulated devices, one type twice as fast: NP gives workers FF and SS."""
    return load_cluster({
        "name": "made-up",
        "device_types": {"F": {"emulated_speed": 1.0, "memory": fast_memory},
                         "S": {"emulated_speed": 0.5, "memory": slow_memory}},
        "nodes": [{"name": "n-F", "device_type": "F", "count": 2}, {"name": "n-S", "device_type": "S", "count": 2}],
        "links": {"intra_node_GBps": 10.0, "inter_node_GBps": 10.0}})


def _stages_at(p, worker, size):
    """Worker `worker`'s stages of plan `p` at minibatch `size`, costed anew (same cut, same Nm)."""
    w = p.workers[worker]
    model = CostModel(at_batch_size(p.profile, size), p.cluster, schedule=p.schedule, sync=WSP_SCHEME)
    return model.stages(w.partition.boundaries, w.devices, p.num_in_flight)


def test_proportional_sizes_follow_the_rates_sum_to_the_batch_and_respect_caps():
    assert proportional_sizes([2.0, 1.0], 48) == (32, 16)
    assert sum(proportional_sizes([1.0, 1.0, 1.0], 10)) == 10
    assert proportional_sizes([3.0, 1.0, 1.0], 10) == (6, 2, 2)
    # A capped worker gets its cap; the rest goes to the others in proportion.
    assert proportional_sizes([4.0, 1.0, 1.0], 60, caps=[20, None, None]) == (20, 20, 20)
    assert proportional_sizes([2.0, 1.0], 48, caps=[20, 100]) == (20, 28)
    with pytest.raises(UnevenMinibatchError, match=r"memory holds at most \[20, 20\] .* 40 together, fewer than "
                                                   r"the global batch of 48"):
        proportional_sizes([2.0, 1.0], 48, caps=[20, 20])
    with pytest.raises(UnevenMinibatchError, match=r"virtual worker\(s\) \[1\] would get no sample of the global "
                                                   r"batch of 3"):
        proportional_sizes([1000.0, 1.0], 3)
    with pytest.raises(UnevenMinibatchError, match="at least one: give a batch of at least 3"):
        proportional_sizes([1.0, 1.0, 1.0], 2)


def test_push_weights_keep_even_sizes_at_one_and_sum_to_the_number_of_workers():
    assert push_weights((32, 32, 32)) == (1.0, 1.0, 1.0)
    assert push_weights((32, 16)) == pytest.approx((4 / 3, 2 / 3))
    assert sum(push_weights((7, 3, 11))) == pytest.approx(3)


def test_a_profile_at_another_batch_scales_activations_and_compute_but_not_overheads():
    p = _profile()
    q = at_batch_size(p, 64)
    assert q.batch_size == 64 and q.activation_bytes == (2 * MIB,) * 4 and q.cut_bytes == (0,) + (2048,) * 3
    assert q.weight_bytes == p.weight_bytes
    assert q.times["host"].forward == (4e-3,) * 4 and q.times["host"].forward_overhead == 1e-4
    with pytest.raises(UnevenMinibatchError, match="integer >= 1, got 0"):
        at_batch_size(p, 0)


def test_np_workers_of_speed_1_and_0_5_get_sizes_about_2_to_1_within_their_memory():
    even = plan(_profile(), _cluster(), PlanRequest(policy="np", num_in_flight=2))
    p = plan(_profile(), _cluster(), PlanRequest(policy="np", num_in_flight=2, minibatch_sizes="proportional"))
    assert p.allocation == even.allocation == "FF SS"
    fast, slow = p.sizes
    assert fast + slow == 64 and abs(fast - 2 * slow) <= 2, p.sizes
    d = p.to_dict()
    assert d["uneven_minibatches"] and [w["minibatch_size"] for w in d["virtual_workers"]] == [fast, slow]
    assert f"minibatch {fast}  predicted" in p.format() and f"minibatches {fast}+{slow} (uneven)" in p.format()
    for w, size in zip(p.workers, p.sizes):
        for st, st_even in zip(w.partition.stages, even.workers[p.workers.index(w)].partition.stages):
            assert st.memory_total <= st.capacity
            assert st.memory["activations"] == pytest.approx(st_even.memory["activations"] * size / 32)
    # The slow worker no longer holds the fast one back: the predicted throughput grows.
    assert even.sizes == (32, 32) and not even.to_dict()["uneven_minibatches"]
    assert p.images_per_s > 1.2 * even.images_per_s
    assert simulate_plan(p, steps=60)["images_per_s"] > 1.2 * simulate_plan(even, steps=60)["images_per_s"]


def test_a_worker_whose_memory_cannot_take_its_share_gets_what_fits_and_the_rest_goes_to_the_other():
    p = plan(_profile(), _cluster(fast_memory="5M"),
             PlanRequest(policy="np", num_in_flight=2, minibatch_sizes="proportional"))
    fast, slow = p.sizes
    assert fast + slow == 64 and fast < 2 * slow - 2  # not 2:1: the fast worker is full
    assert all(st.memory_total <= st.capacity for st in _stages_at(p, 0, fast))
    assert any(st.memory_total > st.capacity for st in _stages_at(p, 0, fast + 1))
    assert memory_cap(plan(_profile(), _cluster(fast_memory="5M"), PlanRequest(policy="np", num_in_flight=2)).workers[0]
                      .partition, 32) == fast


def test_sizes_that_do_not_fit_or_are_zero_get_a_clear_error():
    with pytest.raises(PlanError, match=r"virtual worker 0 \(FF\) was given minibatch size 600, but its stages' "
                                        r"memory holds at most \d+ samples .* give it at most \d+"):
        plan(_profile(), _cluster(), PlanRequest(policy="np", num_in_flight=2, minibatch_sizes=(600, 16)))
    with pytest.raises(PlanError, match=r"virtual worker 1 \(SS\) was given minibatch size 0: every worker needs "
                                        r"an integer >= 1"):
        plan(_profile(), _cluster(), PlanRequest(policy="np", num_in_flight=2, minibatch_sizes=(48, 0)))
    with pytest.raises(PlanError, match=r"3 minibatch sizes \[1, 2, 3\] for 2 virtual workers"):
        plan(_profile(), _cluster(), PlanRequest(policy="np", num_in_flight=2, minibatch_sizes=(1, 2, 3)))
    with pytest.raises(PlanRequestError, match="unknown minibatch_sizes 'fast'; allowed"):
        PlanRequest(policy="np", num_in_flight=2, minibatch_sizes="fast")
    given = plan(_profile(), _cluster(), PlanRequest(policy="np", num_in_flight=2, minibatch_sizes=(40, 20)))
    assert given.sizes == (40, 20)
