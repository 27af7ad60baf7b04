"""Inputs the pure layers used to fail on with a TypeError or AttributeError deep inside now get an
error of the tree that names what was given and the fix."""
import pytest

from hetpipe_tf.errors import HetPipeUsageError
from hetpipe_tf.planning.allocation import AllocationError, hybrid_distribution
from hetpipe_tf.planning.cluster import Cluster, DeviceType, Node
from hetpipe_tf.planning.cost_model import CostModel
from hetpipe_tf.planning.model_graph import LayerNode, ModelGraph, TensorInfo
from hetpipe_tf.planning.profile import AttentionBlock, analytic_times, static_profile
from hetpipe_tf.sync import pipe_sgd  # noqa: F401 - registers "pipe-sgd"
from hetpipe_tf.sync.staleness import check
from tests.helpers.profiles import toy_profile

UNSPECIFIED = DeviceType("x1", "an accelerator without specs", 2 ** 30)


def _cluster(device_type):
    nodes = (Node("a", device_type.name, 2), Node("b", device_type.name, 2))
    return Cluster("c", {device_type.name: device_type}, nodes, intra_node_bandwidth=1e10, inter_node_bandwidth=1e9)


def test_analytic_times_of_a_device_type_without_specs_say_what_to_give():
    with pytest.raises(ValueError, match="'x1' \\(an accelerator without specs\\) has no times: analytic times need its "
                                         "peak_tflops and memory_bandwidth_GBps: give them in the cluster"):
        analytic_times(toy_profile(), UNSPECIFIED)


def test_an_update_on_a_device_type_without_memory_bandwidth_says_what_to_give():
    model = CostModel(toy_profile(), _cluster(UNSPECIFIED))
    with pytest.raises(ValueError, match="neither measured nor given a memory_bandwidth"):
        model.apply_seconds(UNSPECIFIED, 1000)


def test_hd_on_a_device_type_without_peak_tflops_is_an_allocation_error():
    with pytest.raises(AllocationError, match="gives no peak_tflops.*use the NP or ED policy") as caught:
        hybrid_distribution(_cluster(UNSPECIFIED), vw_size=2)
    assert isinstance(caught.value, HetPipeUsageError)


def test_an_attention_output_of_unknown_width_is_named():
    tensors = (TensorInfo(0, "tokens", (8,), 4, None, (0,), model_input=0),
               TensorInfo(1, "attention/out", (8, None), 4, 0, (), model_output=0))
    graph = ModelGraph("m", (LayerNode(0, "attention", "MultiHeadAttention", (0,), (1,), 64, 0, 10),),
                       tensors, (0,), (1,))
    with pytest.raises(ValueError, match="'attention/out' has an unknown width"):
        static_profile(graph, 2, attention={0: AttentionBlock(heads=2, head_dim=4)})


def test_the_staleness_rules_refuse_a_scheme_without_clocks_and_waves():
    with pytest.raises(ValueError, match="schemes with clocks and waves .* got sync='pipe-sgd'"):
        check({}, 1, 0, 2, sync="pipe-sgd")
