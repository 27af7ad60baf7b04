"""WSP across processes: parameter-server and worker tasks on TensorFlow's distributed
runtime over gRPC on loopback (each scenario of cluster_scenarios.py in its own process)."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.processes import wait_until_gone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_scenario(name, timeout=240):
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.cluster_scenarios", name], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"scenario {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    left = wait_until_gone(result.get("task_pids", []), 10)
    assert not left, f"tasks {left} outlived the chief of scenario {name}"
    return result


@pytest.mark.slow
def test_wsp_on_parameter_server_and_worker_tasks_is_exact_and_keeps_the_bounds():
    r = run_scenario("wsp_exact")
    assert r["max_error"] < 1e-5
    assert r["checked"] == [20, 20]
    assert r["clocks"] == [4, 4]  # three full waves and the partial last one
    assert r["ps_devices"] == ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    assert r["stage_devices"] == [f"/job:worker/replica:0/task:{w}/device:CPU:{j}" for w in (0, 1) for j in (0, 1)]


@pytest.mark.slow
def test_seed_001_example_across_processes():
    r = run_scenario("seed_001")
    assert r["checked"] == 32
    assert r["mb11"] == [list(range(1, 8)), [[0, 0], [1, 0]]]
    assert [[1, 0], [1, 1]] == [g for g in r["mb12_globals"] if g[0] == 1]


@pytest.mark.slow
def test_a_killed_worker_task_fails_training_with_a_clear_error_and_leaves_no_process():
    r = run_scenario("killed_worker")
    assert r["killed"]
    assert r["error"] == "PipelineError", r
    # The error names the killed task: the kill ended training (how soon after it is the host's).
    assert "virtual worker" in r["message"] and "/job:worker/replica:0/task:1" in r["message"], r["message"]
    print(f"training failed {r['seconds_after_kill']:.1f} s after the kill")


def test_a_virtual_workers_process_takes_its_share_of_its_machines_cores():
    from hetpipe_tf.distributed.worker_process import intra_op_threads

    assert [intra_op_threads(2, n) for n in (1, 2, 3)] == [2, 1, 1]
    assert intra_op_threads(16, 3) == 5
