"""benchmarks/schemes_comparison.py's own logic: which schemes run (from the registries), the
figures of a curve, TaylorPipe's table shapes, the picture, and one real scheme's run."""
import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "schemes_comparison.py")
spec = importlib.util.spec_from_file_location("schemes_comparison", _PATH)
schemes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(schemes)


def by_name(name):
    return next(s for s in schemes.schemes(4, 4) if s["scheme"].startswith(name))


def test_every_scheme_of_issue_14_is_in_the_comparison():
    names = [s["scheme"] for s in schemes.schemes(4, 4)]
    for expected in ("HetPipe (WSP", "GPipe", "PipeDream", "NaivePipe", "TaylorPipe", "TaylorPipe inside WSP", "BSP",
                     "SSP", "ASP", "Pipe-SGD", "Pipe-SGD between", "HetPipe NP uneven", "HetPipe NP even", "SGD (1 device)"):
        assert any(n.startswith(expected) for n in names), expected
    assert len(set(names)) == len(names)


def test_every_scheme_runs_in_this_checkout():
    import hetpipe_tf.pipeline  # noqa: F401
    import hetpipe_tf.sync  # noqa: F401
    from hetpipe_tf.pipeline.schedule import combinations

    pairs = set(combinations())
    for scheme in schemes.schemes(4, 4):
        assert (scheme["schedule"], scheme.get("sync", "none")) in pairs, scheme["scheme"]


def curve(*points):
    return [{"epoch": i + 1, "wall_s": w, "test_accuracy": a} for i, (w, a) in enumerate(points)]


def test_a_curve_gives_time_per_epoch_without_the_first_and_time_to_target():
    got = schemes.summarise_curve(curve((10.0, 0.5), (14.0, 0.8), (18.0, 0.92), (24.0, 0.9)), 0.9, images_per_epoch=400)
    assert got["time_per_first_epoch_s"] == 10.0 and got["time_per_epoch_s"] == 4.0
    assert got["images_per_s"] == 100.0
    assert (got["time_to_target_s"], got["epochs_to_target"]) == (18.0, 3)
    assert got["final_test_accuracy"] == 0.9 and got["best_test_accuracy"] == 0.92
    assert schemes.summarise_curve(curve((5.0, 0.1)), 0.9)["time_to_target_s"] is None


def row(scheme, kind, per_epoch, final, reached):
    return {"scheme": scheme, "kind": kind, "time_per_epoch_s": per_epoch, "final_test_accuracy": final,
            "time_to_target_s": 10.0 if reached else None, "images_per_s": 1408 / per_epoch,
            "curve": curve((per_epoch, final)), "overrun_fraction": 0.01, "emulation_faithful": True}


def test_the_shapes_of_taylorpipes_tables_are_checked_on_the_rows():
    rows = [row("SGD (1 device)", "single", 10.0, 0.95, True), row("NaivePipe", "pipeline", 4.0, 0.3, False),
            row("PipeDream", "pipeline", 5.0, 0.94, True), row("GPipe", "pipeline", 6.0, 0.9, True),
            {"scheme": "TaylorPipe", "kind": "pipeline", "failed": "it stopped"}]
    got = schemes.shapes(rows, 0.9)
    assert got["NaivePipe fastest pipeline per epoch"] and got["NaivePipe does not reach the target"]
    assert got["pipelines within 0.02 of SGD's final accuracy"] == {"PipeDream": True, "GPipe": False}
    assert got["pipelines faster per epoch than SGD"] == {"PipeDream": 2.0, "GPipe": 1.67}
    rows[1]["time_per_epoch_s"] = 5.5
    assert not schemes.shapes(rows, 0.9)["NaivePipe fastest pipeline per epoch"]


def test_plot_writes_a_png_with_failed_schemes_named(tmp_path):
    rows = [row("SGD (1 device)", "single", 10.0, 0.95, True), row("NaivePipe", "pipeline", 4.0, 0.3, False),
            {"scheme": "Pipe-SGD", "kind": "strategy", "failed": "it stopped"}]
    path = tmp_path / "c.png"
    schemes.plot(rows, 0.9, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_scheme_trains_for_real_in_a_process_of_its_own():
    config = {**by_name("SGD (1 device)"), "epochs": 1, "target": 0.5, "lr": 0.05, "momentum": 0.9, "seed": 0,
              "dilation": 1.5}
    got = schemes.run_child(config, deadline_s=240)
    assert "failed" not in got, got
    assert got["emulated"] and got["processes"] == 1 and [c["epoch"] for c in got["curve"]] == [1]
    assert got["images_per_s"] > 0 and 0.0 <= got["final_test_accuracy"] <= 1.0
    json.dumps(got)


def test_a_failing_scheme_gives_a_row_that_says_so():
    config = {**by_name("GPipe"), "schedule": "no-such-schedule", "epochs": 1, "target": 0.5, "lr": 0.05,
              "momentum": 0.9, "seed": 0, "dilation": 1.5}
    got = schemes.run_child(config, deadline_s=240)
    assert set(got) == {"scheme", "kind", "failed"} and "no-such-schedule" in got["failed"]


@pytest.mark.slow
def test_pipe_sgd_trains_as_four_processes_of_one_device_each():
    """Seed 002's Pipe-SGD is plain data parallelism: one worker process per device. The child makes
    its datasets in the strategy's scope (made before, they name a device the cluster lacks)."""
    config = {**by_name("Pipe-SGD"), "epochs": 1, "target": 0.5, "lr": 0.05, "momentum": 0.9, "seed": 0,
              "dilation": 1.5}
    got = schemes.run_child(config, deadline_s=400)
    assert "failed" not in got, got
    assert got["processes"] == 4 and got["virtual_workers"] == [["F"], ["F"], ["S"], ["S"]]
    assert got["sync"] == "pipe-sgd" and got["emulated"] and [c["epoch"] for c in got["curve"]] == [1]
