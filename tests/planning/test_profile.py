import numpy as np

from hetpipe_tf.planning.cluster import load_cluster
from hetpipe_tf.planning.profile import AnalyticAssumptions, Profile, analytic_times, coarsen, static_profile
from hetpipe_tf.runtime.stage_rewrite import describe_model
from tests.helpers import models as test_models


def test_static_profile_matches_the_model_graph():
    model = test_models.resnet_block()
    graph = describe_model(model).graph
    p = static_profile(graph, batch_size=8)
    assert p.starts == (0,) + graph.allowed_cuts()
    assert sum(p.weight_bytes) == sum(np.prod(v.shape) * 4 for v in model.trainable_weights)
    assert sum(p.state_bytes) == sum(np.prod(v.shape) * 4 for v in model.non_trainable_weights
                                     if "seed" not in v.path)
    for i, start in enumerate(p.starts[1:], start=1):  # what crosses into each segment
        assert p.cut_bytes[i] == 8 * sum(graph.tensors[t].bytes_per_example for t in graph.crossing(start))
    # One stage holding everything keeps every segment's activations: the graph's own count.
    assert sum(p.activation_bytes) == graph.stage_activation_bytes((0,), 8)[0]
    assert p.layer_names == tuple(n.layer for n in graph.nodes)


def test_coarsen_keeps_totals_and_cuts_only_between_merged_segments():
    p = static_profile(describe_model(test_models.cnn()).graph, batch_size=4)
    c = coarsen(p, 3)
    assert c.num_segments == 3 and set(c.starts) <= set(p.starts) and c.starts[0] == 0
    for field in ("weight_bytes", "activation_bytes", "forward_flops", "backward_flops", "kernels"):
        assert sum(getattr(c, field)) == sum(getattr(p, field))
    assert c.cut_bytes == tuple(p.cut_bytes[p.starts.index(s)] for s in c.starts)


def test_json_round_trip():
    p = static_profile(describe_model(test_models.mlp()).graph, batch_size=4)
    p = p.with_times("V", analytic_times(p, load_cluster("paper").device_types["V"])).with_costs(
        apply_base=1e-4, instruction_seconds=2e-4)
    assert Profile.from_json(p.to_json()) == p


def test_analytic_times_follow_the_roofline():
    p = static_profile(describe_model(test_models.cnn()).graph, batch_size=64)
    v = load_cluster("paper").device_types["V"]
    slow = analytic_times(p, v, AnalyticAssumptions(compute_efficiency=0.1))
    fast = analytic_times(p, v, AnalyticAssumptions(compute_efficiency=0.9))
    assert all(a >= b for a, b in zip(slow.forward, fast.forward)) and sum(slow.forward) > sum(fast.forward)
    assert "analytic for TITAN V" in fast.source and "x 0.9" in fast.source
