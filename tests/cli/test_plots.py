"""Pictures of traces and plans (hetpipe_tf.cli.plots) and the commands that draw them."""
import json
import subprocess
import sys

import pytest

from hetpipe_tf.cli import plots
from hetpipe_tf.pipeline.trace import TraceRecorder


def _png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 600
    return pixels


def _trace(path, emulated=True):
    """Two virtual workers of two stages, the way VirtualWorker and the executor name and record them."""
    meta = {"hetpipe_tf": "2 virtual workers, WSP D=0"}
    if emulated:
        meta["emulation"] = "EMULATED devices: task times padded"
    rec = TraceRecorder(metadata=meta)
    rec.set_origin(0.0)
    for pid in (0, 1):
        rec.name_process(pid, f"virtual worker {pid}, Nm=2")
        for s in (0, 1):
            rec.name_thread(pid, s, f"stage {s}: emulated device (speed {1 / (s + 1):g}) [/device:CPU:{2 * pid + s}]")
            rec.name_thread(pid, 100 + s, f"stage {s}: waits for pulled weights")
        t = 0.0
        for mb in range(3):
            for s, (kind, dur) in enumerate([("Forward", 0.02), ("Backward", 0.04)]):
                rec.span(pid, s, f"{kind}({mb})", t, t + dur, category=kind)
                t += dur
        rec.span(pid, 0, "PushUpdate(1)", t, t + 0.01, category="PushUpdate")
        rec.span(pid, 1, "PullWeights(1)", t, t + 0.005, category="PullWeights")
        rec.span(pid, 101, "wait for wave 0", t, t + 0.05, category="PullWait")
        rec.span(pid, 1, "Shuffle(0)", t + 0.05, t + 0.06, category="Shuffle")  # a kind plots.KINDS lacks
    rec.write(path)
    return path


def test_trace_becomes_a_gantt_chart_with_a_row_per_thread_and_a_colour_per_kind(tmp_path):
    drawn = plots.plot_trace(_trace(tmp_path / "trace.json"), tmp_path / "timeline.png")
    _png(tmp_path / "timeline.png")
    assert len(drawn["rows"]) == 8 and drawn["rows"][:4] == ["stage 0: emulated device (speed 1) [/device:CPU:0]",
                                 "stage 1: emulated device (speed 0.5) [/device:CPU:1]",
                                 "stage 0: waits for pulled weights", "stage 1: waits for pulled weights"]
    assert drawn["kinds"] == {"Forward": 6, "Backward": 6, "PushUpdate": 2, "PullWeights": 2, "PullWait": 2,
                              "Shuffle": 2}
    assert drawn["spans"] == 20 and drawn["emulated"] is True
    assert drawn["duration_s"] == pytest.approx(0.24)


def test_trace_of_real_devices_is_not_called_emulated(tmp_path):
    drawn = plots.plot_trace(_trace(tmp_path / "trace.json", emulated=False), tmp_path / "timeline.png")
    assert drawn["emulated"] is False


def test_a_file_that_is_not_a_trace_says_what_it_is(tmp_path):
    with pytest.raises(plots.TraceFileError, match="cannot read trace .*missing.json"):
        plots.plot_trace(tmp_path / "missing.json", tmp_path / "x.png")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(plots.TraceFileError, match="is not JSON"):
        plots.plot_trace(tmp_path / "bad.json", tmp_path / "x.png")
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(plots.TraceFileError, match="holds no spans"):
        plots.plot_trace(tmp_path / "empty.json", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_the_error_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # importing it now fails
    with pytest.raises(plots.PlottingUnavailableError, match=r"matplotlib.*pip install 'hetpipe_tf\[plot\]'"):
        plots.plot_trace(_trace(tmp_path / "trace.json"), tmp_path / "timeline.png")


@pytest.fixture(scope="module")
def paper_profile():
    from hetpipe_tf.cli import models
    from hetpipe_tf.planning.profile import static_profile
    from hetpipe_tf.runtime.stage_rewrite import describe_model

    return static_profile(describe_model(models.build_model("cnn", (32, 32, 3), 10)).graph, 32)


@pytest.fixture(scope="module")
def paper_plan(paper_profile):
    from hetpipe_tf.planning.cluster import load_cluster
    from hetpipe_tf.planning.planner import plan
    from hetpipe_tf.planning.request import PlanRequest

    return plan(paper_profile, load_cluster("paper"), PlanRequest(policy="hd"))


def test_plan_picture_has_a_row_of_panels_per_virtual_worker(tmp_path, paper_plan):
    drawn = plots.plot_plan(paper_plan, tmp_path / "plan.png")
    pixels = _png(tmp_path / "plan.png")
    assert {k: drawn[k] for k in ("workers", "stages", "over_capacity")} == {
        "workers": 4, "stages": [4, 4, 4, 4], "over_capacity": []}
    assert pixels.shape[0] > pixels.shape[1] / 2  # four rows of panels: taller than a one-row figure
    rate = paper_plan.per_worker[0] * 32
    assert drawn["titles"][0].endswith(f"predicted {rate:.1f} images/s") and "minibatch 32" not in drawn["titles"][0]


def test_plan_picture_gives_each_worker_its_own_minibatch_size_when_uneven(tmp_path, paper_profile):
    from hetpipe_tf.planning.cluster import load_cluster
    from hetpipe_tf.planning.planner import plan
    from hetpipe_tf.planning.request import PlanRequest

    uneven = plan(paper_profile, load_cluster("paper"), PlanRequest(policy="np", minibatch_sizes="proportional"))
    sizes = uneven.sizes
    assert len(set(sizes)) > 1  # NP's workers are unequal: so are their minibatches
    drawn = plots.plot_plan(uneven, tmp_path / "plan.png")
    _png(tmp_path / "plan.png")
    for w, (title, size) in enumerate(zip(drawn["titles"], sizes)):
        assert f", minibatch {size}, " in title
        assert title.endswith(f"predicted {uneven.per_worker[w] * size:.1f} images/s")


def _hetpipe(*args):
    return subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.hetpipe", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_hetpipe_trace_plot_writes_the_png(tmp_path):
    trace = _trace(tmp_path / "trace.json")
    run = _hetpipe("trace", "plot", trace, "-o", tmp_path / "out" / "timeline.png")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "20 spans on 8 rows" in run.stdout and "EMULATED" in run.stdout
    _png(tmp_path / "out" / "timeline.png")


def test_hetpipe_plan_png_writes_the_png(tmp_path):
    run = _hetpipe("plan", "--cluster=paper", "--model=cnn", "--policy=hd", "--png", tmp_path / "plan.png")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "virtual worker 3" in run.stdout and f"plan drawn to {tmp_path / 'plan.png'}" in run.stdout
    _png(tmp_path / "plan.png")
