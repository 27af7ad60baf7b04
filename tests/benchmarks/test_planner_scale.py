"""benchmarks/planner_scale.py without Keras: its clusters, and one cell planned in a child process."""
import importlib.util
import json
import os

from hetpipe_tf.planning.cluster import load_cluster
from tests.helpers.profiles import model_profile

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "planner_scale.py")
spec = importlib.util.spec_from_file_location("planner_scale", _PATH)
planner_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(planner_scale)


def test_the_clusters_are_the_paper_s_and_nodes_of_eight_of_four_or_eight_types():
    assert load_cluster(planner_scale.cluster_spec("16")).describe() == load_cluster("paper").describe()
    for name, gpus, types in (("64", 64, "VRGQ"), ("1024", 1024, "VRGQ"), ("e256", 256, "VRGQAXBT")):
        cluster = load_cluster(planner_scale.cluster_spec(name))
        assert len(cluster.devices()) == gpus and {n.count for n in cluster.nodes} == {8}
        assert [n.device_type for n in cluster.nodes[:len(types)]] == list(types)  # round-robin over the nodes
        assert {n.device_type for n in cluster.nodes} == set(types)


def test_a_cell_runs_in_a_child_and_reports_its_time_memory_and_plan(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(model_profile(n=6).to_json())
    row = planner_scale.run_cell(str(path), "16", "hd", timeout_s=120, memory_gib=4, optimizer_slots=1)
    assert row["allocation"] == {"QQVV": 2, "GGRR": 2} and row["chosen"] == "hd"
    assert 0 < row["plan_s"] <= row["wall_s"] and 20 < row["peak_rss_MiB"] < 1024
    assert row["predicted_images_per_s"] > 0
    stopped = planner_scale.run_cell(str(path), "16", "nope", timeout_s=120, memory_gib=4, optimizer_slots=1)
    assert stopped["stopped"].startswith("error: ") and "unknown policy 'nope'" in stopped["stopped"]
    assert json.dumps(stopped)
