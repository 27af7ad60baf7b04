"""The hetpipe-train binary, end to end in its own process (it configures TensorFlow's devices)."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.cli import CLUSTER_RUN, hetpipe_train
from tests.helpers.processes import wait_for, wait_until_gone


def test_main_job_trains_on_bundled_data_and_labels_emulation(tmp_path):
    trace, tb = tmp_path / "trace.json", tmp_path / "tb"
    run = hetpipe_train(tmp_path, "--epochs=2", "--steps_per_epoch=12", "--devices=1@64M,0.5@64M", "--num_in_flight=2",
                        "--dilation=2", f"--trace_file={trace}", f"--tensorboard_dir={tb}")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["num_in_flight"] == 2 and 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["emulation"]["emulated"] is True and summary["emulation"]["paced_tasks"] > 0
    assert "EMULATED devices" in run.stdout
    assert "EMULATED" in json.loads(trace.read_text())["otherData"]["emulation"]
    assert list(tb.glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_bad_flags_fail_with_a_clear_message(tmp_path):
    run = hetpipe_train(tmp_path, "--devices=fast,1")
    assert run.returncode != 0 and "cannot read device 'fast'" in run.stderr
    run = hetpipe_train(tmp_path, "--dataset=mnist", "--epochs=1")
    assert run.returncode != 0 and "'mnist' is not prepared" in run.stderr and "never downloads" in run.stderr
    run = hetpipe_train(tmp_path, "--num_stages=3", "--devices=1,1")
    assert run.returncode != 0 and "--num_stages=3 but --devices lists 2 devices" in run.stderr
    run = hetpipe_train(tmp_path, "--schedule=gpipe-typo")
    assert run.returncode != 0 and "unknown schedule 'gpipe-typo'; the registered ones are: " in run.stderr
    run = hetpipe_train(tmp_path, "--sync=wsp-typo")
    assert run.returncode != 0 and "--sync chooses how several virtual workers synchronise" in run.stderr
    run = hetpipe_train(tmp_path, "--cluster=local", "--sync=asp", "--staleness_bound=2")
    assert run.returncode != 0 and "ASP bounds no staleness" in run.stderr and "sync='ssp' for a bound of 2" in run.stderr


def test_plan_auto_profiles_plans_and_trains(tmp_path):
    run = hetpipe_train(tmp_path, "--plan=auto", "--epochs=1", "--steps_per_epoch=8", "--devices=1@64M,0.5@64M,0.5@64M",
                        "--model=mlp", "--dilation=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "policy GIVEN" in run.stdout and "predicted" in run.stdout and "Max_m=" in run.stdout
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["num_in_flight"] >= 1 and len(summary["devices"]) == 3


def _tensorboard_tags(directory):
    import tensorflow as tf

    tags = set()
    for path in directory.glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags.update(v.tag for v in event.summary.value)
    return tags


def _processes_with(text):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("sync, bound", [("ssp", 1), pytest.param("bsp", 0, marks=pytest.mark.slow),
                                         pytest.param("asp", 0, marks=pytest.mark.slow)])
def test_cluster_flags_train_under_per_minibatch_clocks(tmp_path, sync, bound):
    # --sync=ssp, bsp and asp push after every minibatch: each worker's clock counts its 4
    # minibatches (WSP's, waves of Nm = 2, would be 2).
    run = hetpipe_train(tmp_path, "--cluster=local", "--model=mlp", "--epochs=1", "--steps_per_epoch=8", "--dilation=2",
                        "--num_in_flight=2", "--policy=ed", f"--sync={sync}", f"--staleness_bound={bound}",
                        "--launch=in_process")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["staleness_bound"] == bound and [w["clock"] for w in summary["virtual_workers"]] == [4, 4]
    assert "overrun_fraction" in summary["emulation"]


@pytest.mark.slow
def test_cluster_flags_train_virtual_workers_on_ps_and_worker_processes(tmp_path):
    trace, tb = tmp_path / "trace.json", tmp_path / "tb"
    run = hetpipe_train(tmp_path, *CLUSTER_RUN, "--policy=ed", "--staleness_bound=1", f"--trace_file={trace}",
                        f"--tensorboard_dir={tb}")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["allocation"] == "FS FS" and summary["staleness_bound"] == 1
    assert [w["worker"] for w in summary["virtual_workers"]] == [0, 1]
    assert summary["emulation"]["emulated"] is True and "EMULATED" in run.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    for cat in ("PushUpdate", "PullWeights", "PullWait", "Forward"):
        assert {e["pid"] for e in events if e.get("cat") == cat} == {0, 1}, cat
    tags = _tensorboard_tags(tb)
    for tag in ("vw_0/clock", "vw_1/clock_distance", "vw_0/wait_s", "vw_1/idle_s", "vw_0/images_per_s",
                "val_accuracy", "emulation"):
        assert tag in tags, (tag, sorted(tags))


def test_hetpipe_launch_runs_the_chief_under_tf_config_and_stops_every_task(tmp_path):
    cmd = [sys.executable, "-m", "hetpipe_tf.cli.hetpipe", "launch", "--cluster=local", f"--task_log_dir={tmp_path / 'logs'}", "--",
           sys.executable, "-m", "hetpipe_tf.cli.train", f"--data_dir={tmp_path / 'tfds'}", "--launch=tf_config",
           "--policy=np", *CLUSTER_RUN]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "2 ps and 2 worker tasks for cluster 'local'" in out
    summary = json.loads(out.split("summary: ")[1].splitlines()[0])
    assert summary["allocation"] == "FF SS" and len(summary["virtual_workers"]) == 2
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["ps-0.log", "ps-1.log", "vw0-0.log", "vw1-0.log",
                                                      "worker-0.log", "worker-1.log"]
    # One process per virtual worker, each started by the worker task of its home node (FF on node 0, SS on 1).
    for w in (0, 1):
        assert re.search(rf"task starter: started vw{w}:0 \(pid \d+\) at 127\.0\.0\.1:\d+",
                         (logs / f"worker-{w}.log").read_text()), (logs / f"worker-{w}.log").read_text()
        assert f"vw{w}:0" not in (logs / f"worker-{1 - w}.log").read_text()
    assert wait_for(lambda: not _processes_with(f"--parent_pid={proc.pid}"), 60), "tasks outlived hetpipe launch"


@pytest.mark.slow
def test_tasks_started_by_hand_as_on_other_hosts_run_a_process_per_virtual_worker_on_its_node(tmp_path):
    """README's commands for tasks on other hosts: each ps and worker task by hand with the
    cluster's key, then the chief with TF_CONFIG."""
    from hetpipe_tf.distributed.ports import free_port
    from hetpipe_tf.distributed.starter import starter_file

    spec = {job: [f"127.0.0.1:{free_port()}" for _ in range(n)] for job, n in (("ps", 2), ("worker", 2), ("chief", 1))}
    env = dict(os.environ, HETPIPE_AUTHKEY=os.urandom(16).hex())
    logs = tmp_path / "logs"
    logs.mkdir()
    tasks = []
    for job, i in [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]:
        with open(logs / f"{job}-{i}.log", "w") as log:
            tasks.append(subprocess.Popen(
                [sys.executable, "-m", "hetpipe_tf.distributed.server", f"--cluster_spec={json.dumps(spec)}",
                 f"--job_name={job}", f"--task_index={i}", "--logical_cpus=2", f"--task_log_dir={logs}"],
                stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        chief_env = dict(env, TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}}))
        run = subprocess.run([sys.executable, "-m", "hetpipe_tf.cli.train", f"--data_dir={tmp_path / 'tfds'}",
                              "--launch=tf_config", "--policy=np", *CLUSTER_RUN], capture_output=True, text=True,
                             timeout=600, env=chief_env)
        assert run.returncode == 0, run.stderr[-3000:]
        summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
        assert summary["allocation"] == "FF SS" and len(summary["virtual_workers"]) == 2
        pids = []
        for w in (0, 1):  # each started by its home node's worker task, which outlives it
            started = re.search(rf"task starter: started vw{w}:0 \(pid (\d+)\)", (logs / f"worker-{w}.log").read_text())
            assert started, (logs / f"worker-{w}.log").read_text()
            pids.append(int(started.group(1)))
        assert all(t.poll() is None for t in tasks)
        assert not wait_until_gone(pids, 10), "a virtual worker's process outlived its chief"
    finally:
        for t in tasks:
            t.kill()
            t.wait()
        for address in spec["worker"]:
            os.remove(starter_file(address))


def test_cluster_flags_refuse_single_worker_flags(tmp_path):
    run = hetpipe_train(tmp_path, "--cluster=local", "--devices=1,1")
    assert run.returncode != 0 and "--devices is for one virtual worker" in run.stderr
    run = hetpipe_train(tmp_path, "--cluster=local", "--vw_size=3", "--model=mlp", "--launch=in_process")
    assert run.returncode != 0 and "ED: 4 devices do not make virtual workers of 3" in run.stderr
