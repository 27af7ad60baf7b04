"""Transformer-aware planning (issue 28, item 3): attention blocks keep what their outputs do not
show, the sequence counts, and cuts fall between blocks."""
import pytest

from hetpipe_tf.planning.model_graph import LayerNode, ModelGraph, TensorInfo
from hetpipe_tf.planning.profile import AttentionBlock, static_profile


def test_an_attention_block_keeps_its_scores_which_grow_with_the_square_of_the_sequence():
    gpt2_medium = AttentionBlock(heads=16, head_dim=64, feedforward=4096, dropout=True)
    per_sequence = gpt2_medium.saved_bytes(1024, 1024, 4)
    # q, k, v, weighted values, two norms and the residual, 2 x the feed-forward, at 4 bytes; the softmax
    # and the dropped probabilities at 4 and their mask at 1 byte; two masks of the hidden width
    assert per_sequence == 4 * (7 * 1024 * 1024 + 2 * 1024 * 4096 + 2 * 16 * 1024 ** 2) + 16 * 1024 ** 2 + 2 * 1024 ** 2
    assert 200e6 < per_sequence < 230e6  # about 216 MB a block per sequence of 1,024 tokens
    linear = 2 * gpt2_medium.saved_bytes(512, 1024, 4)  # halving the sequence halves all but the scores
    assert per_sequence - linear == 9 * 16 * 1024 ** 2 // 2 and gpt2_medium.extra_flops(1024) == 4 * 1024 ** 3
    alone = AttentionBlock(heads=4, head_dim=8)  # keras.layers.MultiHeadAttention: no norms, no feed-forward
    assert alone.saved_bytes(10, 32, 4) == 4 * (4 * 10 * 32 + 4 * 100)  # q, k, v, weighted values; the softmax


def graph(length=None):
    """ids -> embedding -> block -> block -> dense: a transformer with an unknown sequence dimension."""
    t = [TensorInfo(0, "ids", (length,), 4, None, (0,), model_input=0),
         TensorInfo(1, "x", (length, 8), 4, 0, (1,)), TensorInfo(2, "y", (length, 8), 4, 1, (2,)),
         TensorInfo(3, "z", (length, 8), 4, 2, (3,)), TensorInfo(4, "out", (length, 50), 4, 3, (), model_output=0)]
    n = [LayerNode(0, "embedding", "Embedding", (0,), (1,), 50 * 8 * 4, 0, 2 * 400),
         LayerNode(1, "block0", "TransformerDecoder", (1,), (2,), 1000, 0, 2 * 250 + 8),
         LayerNode(2, "block1", "TransformerDecoder", (2,), (3,), 1000, 0, 2 * 250 + 8),
         LayerNode(3, "head", "Dense", (3,), (4,), 8 * 50 * 4, 0, 2 * 400 + 50)]
    return ModelGraph("tiny", tuple(n), tuple(t), (0,), (4,))


def test_a_sequence_length_sets_every_unknown_dimension_and_scales_the_flops_with_the_outputs():
    g = graph().at_sequence_length(16)
    assert [t.shape for t in g.tensors] == [(16,), (16, 8), (16, 8), (16, 8), (16, 50)]
    assert [n.flops_per_example for n in g.nodes] == [16 * 800, 16 * 508, 16 * 508, 16 * 850]
    assert g.at_sequence_length(4) == g  # nothing unknown is left
    with pytest.raises(ValueError, match="a sequence length is an integer >= 1, got 0"):
        graph().at_sequence_length(0)


def test_the_static_profile_counts_blocks_and_lookups():
    g = graph().at_sequence_length(16)
    block = AttentionBlock(heads=2, head_dim=4, feedforward=32, dropout=False)
    plain = static_profile(g, 3)
    aware = static_profile(g, 3, attention={1: block, 2: block}, lookups=(0,))
    assert plain.starts == aware.starts == (0, 1, 2, 3)  # cuts between the blocks, never inside one
    extra = 3 * block.saved_bytes(16, 8, 4)
    assert [a - p for a, p in zip(aware.activation_bytes, plain.activation_bytes)] == [0, extra, extra, 0]
    assert aware.forward_flops[0] == 3 * 16 * 8  # a lookup: its outputs' elements, not 2 x the table
    assert aware.forward_flops[1] == plain.forward_flops[1] + 3 * block.extra_flops(16)
    assert aware.backward_flops[1] == plain.backward_flops[1] + 2 * 3 * block.extra_flops(16)
    assert aware.forward_flops[3] == plain.forward_flops[3]


def test_keras_hub_blocks_are_read_from_the_model_and_plans_cut_between_them():
    keras_hub = pytest.importorskip("keras_hub")
    import keras

    from hetpipe_tf.planning.cluster import load_cluster
    from hetpipe_tf.planning.planner import plan
    from hetpipe_tf.planning.request import PlanRequest
    from hetpipe_tf.runtime.profiler import model_profile, static_facts
    from hetpipe_tf.runtime.stage_rewrite import describe_model

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=3, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=32)
    model = keras.Model(backbone.input, keras.layers.Dense(64, name="lm_head")(backbone.output))
    described = describe_model(model)
    attention, lookups = static_facts(described)
    names = described.graph.nodes
    assert {names[i].layer: b for i, b in attention.items()} == {
        f"transformer_layer_{i}": AttentionBlock(heads=2, head_dim=8, feedforward=32, dropout=True) for i in range(3)}
    assert sorted(names[i].layer for i in lookups) == ["position_embedding", "token_embedding"]
    short, long = model_profile(model, 2, sequence_length=8), model_profile(model, 2, sequence_length=32)
    blocks = [i for i, s in enumerate(long.starts) if long.layer_names[s].startswith("transformer_layer")]
    assert all(long.activation_bytes[i] > 4 * short.activation_bytes[i] for i in blocks)  # the scores: L^2
    assert len(blocks) == 3 and all(long.kernels[i] == 1 for i in blocks)  # a block is one call: never cut inside
    p = plan(long, load_cluster("paper"), PlanRequest(policy="ed"), optimizer_slots=2)
    for w in p.workers:
        for st in w.partition.stages:  # every stage holds its blocks' scores, and fits
            assert st.memory["activations"] >= sum(2 * attention[long.starts[i]].saved_bytes(32, 16, 4)
                                                   for i in range(*st.segments) if i in blocks)
            assert st.memory_total <= st.capacity
