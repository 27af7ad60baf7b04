import pytest

from hetpipe_tf.planning.model_graph import LayerNode, ModelGraph, PartitionError, TensorInfo


def _graph():
    """x(0) -> a(1) -> b(2) -> add(3)=b+a -> out(4); y(5) consumed by the last node."""
    t = [TensorInfo(0, "x", (4,), 4, None, (0,), model_input=0),
         TensorInfo(1, "a", (8,), 4, 0, (1, 2)),
         TensorInfo(2, "b", (8,), 4, 1, (2,)),
         TensorInfo(3, "add", (8,), 4, 2, (3,)),
         TensorInfo(4, "out", (2,), 4, 3, (), model_output=0),
         TensorInfo(5, "y", (3,), 4, None, (3,), model_input=1)]
    n = [LayerNode(0, "a", "Dense", (0,), (1,), 160, 0, 80),
         LayerNode(1, "b", "Dense", (1,), (2,), 288, 0, 150),
         LayerNode(2, "add", "Add", (2, 1), (3,), 0, 0, 8),
         LayerNode(3, "out", "Dense", (3, 5), (4,), 100, 16, 30)]
    return ModelGraph("g", tuple(n), tuple(t), inputs=(0, 5), outputs=(4,))


def test_skip_tensor_crosses_every_cut_it_spans():
    g = _graph()
    assert g.crossing(1) == (1,)
    assert g.crossing(2) == (1, 2)  # 'a' skips over node 1
    assert g.crossing(3) == (3,)


def test_stage_io_forwards_skips_and_loads_inputs_where_first_used():
    g = _graph()
    s0, s1, s2 = g.stage_io((0, 1, 3))
    assert (s0.loaded, s0.sent) == ((0,), (1,))
    assert (s1.received, s1.consumed, s1.produced, s1.sent) == ((1,), (1,), (3,), (3,))
    assert (s2.received, s2.loaded, s2.consumed, s2.sent) == ((3,), (5,), (3, 5), (4,))
    a, b = g.stage_io((0, 2))
    assert a.sent == (1, 2) and a.produced == (1, 2) and b.consumed == (1, 2, 5)


def test_boundaries_are_checked():
    g = _graph()
    for bad in [(), (1,), (0, 0), (0, 4), (0, 3, 2)]:
        with pytest.raises(PartitionError):
            g.check_boundaries(bad)


def _shared():
    """_graph() with 'a' called again at node 2 (tied weights)."""
    g = _graph()
    nodes = list(g.nodes)
    nodes[2] = LayerNode(2, "a", "Dense", (2, 1), (3,), 160, 0, 8)
    return ModelGraph("s", tuple(nodes), g.tensors, g.inputs, g.outputs)


def test_cuts_without_replicas_keep_a_shared_layer_in_one_stage():
    assert _shared().allowed_cuts() == (3,)
    assert _shared().shared_across((0, 3)) == {}


def test_a_shared_layer_cut_apart_is_replicated_into_each_stage_that_calls_it():
    shared = _shared()
    assert shared.shared_across((0, 1)) == {"a": (0, 1)}
    assert shared.shared_across((0, 1, 2)) == {"a": (0, 2)}  # not in the stage between
    # Each stage holding a replica counts its weights.
    assert shared.stage_weight_bytes((0, 1, 2)) == ((160, 0), (288, 0), (260, 16))
    assert shared.stage_weight_bytes((0, 3)) == ((448, 0), (100, 16))


def test_memory_per_stage():
    g = _graph()
    assert g.stage_weight_bytes((0, 2)) == ((448, 0), (100, 16))
    # Stage 0 keeps x, a, b; stage 1 keeps a, b (received), add, out and the input y.
    assert g.stage_activation_bytes((0, 2), batch_size=10) == (10 * (16 + 32 + 32), 10 * (32 + 32 + 32 + 8 + 12))
