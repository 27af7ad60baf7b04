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
