"""benchmarks/gpu_check.py, the GPU acceptance script, on this machine without a GPU: it says so and
exits 0, and its --cpu_dry_run runs every check's code on the host CPU (the listing through the
seam of hetpipe_tf.distributed.gpus: a fake listing)."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check
from hetpipe_tf.distributed.gpus import FAKE_GPUS_ENV, gpu_layout, gpus_from_json
from hetpipe_tf.planning.cluster import load_cluster
from tests.helpers.gpus import LISTING


@pytest.fixture
def no_gpu(tmp_path, monkeypatch):
    (tmp_path / "none.json").write_text("[]")
    monkeypatch.setenv(FAKE_GPUS_ENV, str(tmp_path / "none.json"))


def _rows(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_without_a_gpu_it_says_so_and_exits_0(no_gpu, capsys):
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "devices: 0 GPU(s)" in out and "every check: skipped (no GPU found" in out
    assert [r["check"] for r in _rows(out)] == ["listing", "skipped"]


def test_the_dry_run_times_the_device_and_finds_the_virtual_worker_equal_to_keras(no_gpu, capsys, tmp_path):
    out_file = tmp_path / "rows.jsonl"
    assert gpu_check.main(["--cpu_dry_run", "--checks=devices,equality", "--steps=3", f"--out={out_file}"]) == 0
    out = capsys.readouterr().out
    rows = {r["check"]: r for r in _rows(out)}
    assert rows["device"]["step_ms"] > 0 and rows["device"]["effective_tflops"] > 0
    assert rows["equality"]["devices"] == "cpu,cpu" and rows["equality"]["equal"]
    assert rows["equality"]["max_abs_weight_difference"] <= 1e-5 and rows["equality"]["images_per_s"] > 0
    assert "CPU DRY RUN" in out and ": EQUAL;" in out
    assert [json.loads(line)["check"] for line in out_file.read_text().splitlines()] == ["listing", "device",
                                                                                         "equality"]


def test_the_wsp_checks_cluster_of_the_gpus_found_loads_and_fits_them(tmp_path, monkeypatch):
    (tmp_path / "gpus.json").write_text(json.dumps(LISTING))
    monkeypatch.setenv(FAKE_GPUS_ENV, str(tmp_path / "gpus.json"))
    gpus = gpus_from_json(LISTING, "test")
    rows = [{"device": f"/GPU:{g.index}", "effective_tflops": 5.0 if "2060" in g.name else 9.0} for g in gpus]
    cluster = load_cluster(gpu_check.cluster_of(gpus, rows, dry=False))
    assert [(n.count, n.gpus) for n in cluster.nodes] == [(2, (0, 1)), (2, (2, 3))]
    assert [t.peak_tflops for t in cluster.device_types.values()] == [5.0, 9.0]
    assert [n.visible for n in gpu_layout(cluster).nodes] == ["0,1", "2,3"]


@pytest.mark.slow
def test_the_dry_runs_two_virtual_workers_under_wsp_in_processes(tmp_path):
    (tmp_path / "none.json").write_text("[]")
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu_dry_run", "--checks=wsp", "--steps=2"],
                         check=False, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, PYTHONPATH=os.getcwd(), **{FAKE_GPUS_ENV: str(tmp_path / "none.json")}))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (wsp,) = [r for r in _rows(run.stdout) if r["check"] == "wsp"]
    assert wsp["virtual_workers"] == 2 and wsp["images_per_s"] > 0 and wsp["launch"] == "processes"
