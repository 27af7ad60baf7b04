"""benchmarks/comparison.py without training: the devices, the cluster the policies allocate,
the figures read from a trace, the reference the baselines get and the run's profile, the
bound references set, the picture."""
import argparse

import pytest

from benchmarks import comparison
from hetpipe_tf.planning.profile import Profile, SegmentTimes
from hetpipe_tf.planning.allocation import allocate, describe
from hetpipe_tf.planning.cluster import from_dict


def test_device_types_keep_table_1s_order_and_take_memory_overrides():
    assert [t[0] for t in comparison.device_types("GQV")] == ["V", "Q", "G"]
    assert [t[2] for t in comparison.device_types("VRQG", {"G": "4M"})] == ["12M", "24M", "8M", "4M"]
    for bad in ("VX", "", "VV"):
        with pytest.raises(ValueError, match="at most once"):
            comparison.device_types(bad)
    assert comparison.parse_memory("G=4M, Q=6M") == {"G": "4M", "Q": "6M"}
    with pytest.raises(ValueError, match="TYPE=SIZE"):
        comparison.parse_memory("X=4M")


def test_the_policies_make_different_workers_on_the_four_types():
    cluster = from_dict(comparison.cluster_spec(comparison.device_types("VRQG")))
    assert describe(allocate(cluster, "np")) == "V R Q G"
    assert describe(allocate(cluster, "ed")) == "VRQG"
    # HD pairs the nodes whose workers are most alike in compute and memory: V+Q (1.33, 20 MiB)
    # and R+G (1.07, 30 MiB), not V+G (1.4, 18 MiB) and R+Q (1.0, 32 MiB).
    assert describe(allocate(cluster, "hd", vw_size=2)) == "VQ RG"


def span(pid, tid, cat, ts, dur):
    return {"ph": "X", "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": cat}


def test_trace_figures_read_each_stage_s_reference_and_busy_fraction():
    events = [span(0, 0, "Forward", 0, 31000), span(0, 0, "Backward", 31000, 60000),
              span(0, 0, "Forward", 100000, 30000), span(0, 0, "Backward", 130000, 70000),
              span(0, 0, "PushWave", 200000, 5000),  # not compute
              span(1, 0, "Forward", 0, 10000), span(1, 1, "Forward", 10000, 20000),
              span(1, 1, "Backward", 30000, 20000), span(1, 0, "Backward", 50000, 10000),
              {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "w0"}}]
    out = comparison.trace_figures(events, [[0.5], [1.0, 0.25]], 3.0)
    # shortest Forward 30 ms + shortest Backward 60 ms, x 0.5 / 3
    assert out["traced_stage_reference_ms"][0] == [15.0]
    assert out["traced_stage_reference_ms"][1] == [pytest.approx(20 / 3, abs=1e-3), pytest.approx(40 / 12, abs=1e-3)]
    assert out["stage_busy_fraction"][0] == [pytest.approx(191000 / 200000, abs=1e-3)]
    assert out["stage_busy_fraction"][1] == [pytest.approx(20 / 60, abs=1e-3), pytest.approx(40 / 60, abs=1e-3)]
    with pytest.raises(ValueError, match="2 virtual workers, the plan 3"):
        comparison.trace_figures(events, [[1.0], [1.0], [1.0]], 3.0)


def test_the_baselines_reference_is_the_whole_model_by_the_run_s_profile(tmp_path):
    times = SegmentTimes(forward=(0.001, 0.002), backward=(0.003, 0.004), forward_overhead=0.0005,
                         backward_overhead=0.0007, source="test")
    profile = Profile(model="m", batch_size=32, starts=(0, 2), weight_bytes=(8, 8), state_bytes=(0, 0),
                      activation_bytes=(1, 1), cut_bytes=(0, 1), forward_flops=(1, 1), backward_flops=(2, 2),
                      traffic_bytes=(1, 1), kernels=(2, 1), times={"host": times})
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    # one forward task and one backward task: their fixed costs once, every segment's time
    assert comparison.whole_model_reference_ms(str(path)) == pytest.approx(0.5 + 0.7 + 1 + 2 + 3 + 4)


def test_the_bound_holds_every_worker_to_the_slowest_stage_of_all():
    # worker 0: stages of 2 ms at speed 1 and 1 ms at speed 0.25 (4 ms emulated); worker 1: 3 ms at 0.5 (6 ms)
    bound = comparison.bound_images_per_s([[2.0, 1.0], [3.0]], [[1.0, 0.25], [0.5]], dilation=2.0, batch_size=32)
    assert bound == pytest.approx(2 * 32 / (2.0 / 0.5 * 3.0 / 1e3))
    # a baseline's ranks: the whole model on each, held to the slowest rank
    assert comparison.bound_images_per_s([[5.0]] * 2, [[1.0], [0.5]], 1.0) == pytest.approx(2 * 32 / 0.010)


def test_run_profile_is_beside_the_results_and_starts_empty_unless_given(tmp_path):
    out = tmp_path / "fig.jsonl"
    stale = tmp_path / "fig.profile.json"
    stale.write_text("an earlier run's")
    args = argparse.Namespace(out=str(out), profile="")
    assert comparison.run_profile(args, str(tmp_path)) == str(stale) and not stale.exists()
    given = tmp_path / "given.json"
    given.write_text("{}")
    assert comparison.run_profile(argparse.Namespace(out=str(out), profile=str(given)), "") == str(stale)
    assert stale.read_text() == "{}"
    assert comparison.run_profile(argparse.Namespace(out="", profile=""), str(tmp_path)) == str(tmp_path / "profile.json")


def test_the_first_run_keeps_its_profile_and_later_runs_are_given_it(tmp_path):
    path = str(tmp_path / "run.profile.json")
    assert comparison.given_profile(path) is None
    first = argparse.Namespace(profile=argparse.Namespace(to_json=lambda: "first"))
    comparison.keep_profile(path, first)
    assert comparison.given_profile(path) == path
    comparison.keep_profile(path, argparse.Namespace(profile=argparse.Namespace(to_json=lambda: "second")))
    assert open(path).read() == "first"  # a later run's plan does not replace the run's profile


def test_ratio_is_none_when_a_side_is_missing():
    assert comparison.ratio(300.0, 200.0) == 1.5
    assert comparison.ratio(300.0, None) is None and comparison.ratio(None, 2.0) is None


def test_bar_plot_writes_a_png_that_says_emulated(tmp_path):
    rows = [{"system": "HetPipe NP", "images_per_s": 500.0, "overrun_fraction": 0.01, "emulation_faithful": True},
            {"system": "Horovod", "images_per_s": 400.0, "overrun_fraction": 0.07, "emulation_faithful": False},
            {"system": "MWMS", "skipped": "not built"}]
    path = tmp_path / "b.png"
    comparison.bar_plot(rows, str(path), "4 EMULATED devices")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"EMULATED" in data
