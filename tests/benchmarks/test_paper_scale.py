"""benchmarks/paper_scale.py without Keras: its transcription of the paper, its calibration
search and its all-reduce cells on a toy profile."""
import importlib.util
import json
import os

import pytest

from hetpipe_tf.planning.profile import Profile

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "paper_scale.py")
spec = importlib.util.spec_from_file_location("paper_scale", _PATH)
paper_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paper_scale)


def test_table_4_as_the_paper_prints_it():
    t = paper_scale.TABLE_4
    assert [t["vgg19"]["horovod"][c] for c in ("V", "VR", "VRQ", "VRQG")] == [164, 205, 265, 339]
    assert [t["resnet152"]["hetpipe"][c] for c in ("V", "VR", "VRQ", "VRQG")] == [
        (256, 5), (516, 20), (538, 24), (580, 28)]
    assert t["resnet152"]["horovod"]["VRQG"] is None  # the paper's X


def test_bisect_finds_the_value_that_meets_the_target():
    box = {}
    found = paper_scale._bisect(lambda v: box.__setitem__("v", v), lambda: 3 * box["v"], 1.5, 0.0, 2.0, rounds=30)
    assert found == pytest.approx(0.5) and box["v"] == found


def toy(activation_bytes=7 * 2 ** 29):
    n = 2
    return Profile(model="toy", batch_size=32, starts=(0, 1), weight_bytes=(2 ** 27,) * n, state_bytes=(0,) * n,
                   activation_bytes=(activation_bytes,) * n, cut_bytes=(0, 1000), forward_flops=(1e12,) * n,
                   backward_flops=(2e12,) * n, traffic_bytes=(1e8,) * n, kernels=(5,) * n)


def test_horovod_cells_leave_out_gpus_too_small():
    model = paper_scale.Model({"toy": toy()})
    h = model.horovod("toy", "VRQG")
    assert {d.type.name for d in h.left_out} == {"G", "Q"} and h.images_per_s > 0


def test_horovod_cells_use_the_intra_and_the_inter_node_allreduce_rates():
    model = paper_scale.Model({"toy": toy(2 ** 20)})
    model.allreduce_bandwidth = {"intra": 0.05e9, "inter": None}
    one_node, two_nodes = model.horovod("toy", "V"), model.horovod("toy", "VR")
    model.allreduce_bandwidth["inter"] = 0.01e9
    assert model.horovod("toy", "V").allreduce_seconds == one_node.allreduce_seconds
    slower = model.horovod("toy", "VR")
    assert slower.allreduce_seconds == pytest.approx(two_nodes.allreduce_seconds * 5, rel=0.01)
    assert slower.images_per_s < two_nodes.images_per_s


def test_each_calibrated_parameter_has_a_cell_of_its_own():
    cells = [c for c in paper_scale.CALIBRATION.values() if isinstance(c, tuple)]
    assert len(set(cells)) == len(cells) and all(c[2] != "V" or c[1] != "hetpipe" for c in cells)
    assert paper_scale.HOROVOD_CALIBRATION_CELLS == {("vgg19", "horovod", "V"), ("vgg19", "horovod", "VR")}


def test_the_transformer_rows_give_every_system_on_both_clusters_in_tokens_per_second(capsys):
    n = 4
    profile = Profile(model="toy", batch_size=2, starts=tuple(range(n)), weight_bytes=(2 ** 26,) * n,
                      state_bytes=(0,) * n, activation_bytes=(2 ** 30,) * n, cut_bytes=(0,) + (2 ** 22,) * (n - 1),
                      forward_flops=(1e12,) * n, backward_flops=(2e12,) * n, traffic_bytes=(1e9,) * n, kernels=(5,) * n,
                      layer_names=tuple(f"l{i}" for i in range(n)))
    rows = paper_scale.transformer(paper_scale.Model({}), profile, None)
    assert [(r["cluster"], r["system"]) for r in rows] == [
        (c, s) for c in ("paper", "paper, G with 12 GB") for s in ("NP", "ED", "HD", "ED-local", "Horovod")]
    ed = next(r for r in rows if r["system"] == "ED")
    assert ed["predicted_tokens_per_s"] > 0 and ed["stages_on_G"][0]["memory_GiB"] <= 6.0
    summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()][-1]
    assert summary["summary"] and set(summary["gain_with_12GB_G_cards"]) <= {"NP", "ED", "HD", "ED-local"}
