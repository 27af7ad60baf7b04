"""benchmarks/convergence.py's own logic, without training: time to target and the picture."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "convergence.py")
spec = importlib.util.spec_from_file_location("convergence", _PATH)
convergence = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convergence)


def curve(*accuracies):
    return [{"epoch": i + 1, "wall_s": 10.0 * (i + 1), "test_accuracy": a} for i, a in enumerate(accuracies)]


def test_time_to_target_is_the_first_epoch_at_or_above_it():
    assert convergence.time_to_target(curve(0.1, 0.95, 0.85, 0.99), 0.9) == (20.0, 2)
    assert convergence.time_to_target(curve(0.1, 0.9), 0.9) == (20.0, 2)
    assert convergence.time_to_target(curve(0.1, 0.5), 0.9) == (None, None)


def test_plot_writes_a_png_that_says_emulated(tmp_path):
    rows = [{"system": "Horovod", "curve": curve(0.1, 0.95), "overrun_fraction": 0.01, "emulation_faithful": True},
            {"system": "HetPipe D=4", "curve": curve(0.5, 0.97), "overrun_fraction": 0.08,
             "emulation_faithful": False}]
    path = tmp_path / "c.png"
    convergence.plot(rows, 0.9, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def row(system, accuracies, overrun=0.01):
    return {"system": system, "curve": curve(*accuracies), "overrun_fraction": overrun, "emulation_faithful": True}


def test_summary_compares_d4_with_horovods_better_learning_rate_and_with_d0():
    rows = [row("Horovod lr x1", (0.1, 0.2, 0.3)), row("Horovod lr x4", (0.5, 0.95)),
            row("HetPipe D=0", (0.5, 0.6, 0.95)), row("HetPipe D=4", (0.92,), overrun=0.03)]
    for r in rows:
        r["time_to_target_s"], r["epochs_to_target"] = convergence.time_to_target(r["curve"], 0.9)
    summary = convergence.summarise(rows, 0.9)
    assert summary["time_to_target_s"]["Horovod lr x1"] is None
    assert summary["time_to_target_s"]["Horovod best lr"] == 20.0
    assert summary["targets"]["D=4 sooner than Horovod (best lr)"] is True
    assert summary["targets"]["D=4 sooner than Horovod lr x4"] is True
    assert summary["targets"]["D=4 sooner than Horovod lr x1"] is True  # the other never reached it
    assert summary["targets"]["D=4 sooner than D=0 (ED-local)"] is True
    assert summary["targets"]["NP D=4 sooner than NP D=0"] is None  # no NP rows
    assert summary["ratios"]["HetPipe D=4 / HetPipe D=0"] == round(10.0 / 30.0, 3)
    assert summary["target_met"] and summary["overrun_fraction_max"] == 0.03
    rows[3]["curve"] = curve(0.1, 0.2, 0.3, 0.91)
    rows[3]["time_to_target_s"], _ = convergence.time_to_target(rows[3]["curve"], 0.9)
    assert not convergence.summarise(rows, 0.9)["target_met"]
    rows[1]["time_to_target_s"] = None  # neither Horovod row reached it: D = 4 (which did) is sooner
    assert convergence.summarise(rows, 0.9)["time_to_target_s"]["Horovod best lr"] is None
