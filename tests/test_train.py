"""The hetpipe-train binary, end to end in its own process (it configures TensorFlow's devices)."""
import json
import subprocess
import sys


def _train(tmp_path, *flags):
    cmd = [sys.executable, "-m", "hetpipe_tf.train", f"--data_dir={tmp_path / 'tfds'}", "--show_schedule=false",
           *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_main_job_trains_on_bundled_data_and_labels_emulation(tmp_path):
    trace, tb = tmp_path / "trace.json", tmp_path / "tb"
    run = _train(tmp_path, "--epochs=2", "--steps_per_epoch=12", "--devices=1@64M,0.5@64M", "--num_minibatches=2",
                 "--dilation=2", f"--trace_file={trace}", f"--tensorboard_dir={tb}")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["num_minibatches"] == 2 and 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["emulation"]["emulated"] is True and summary["emulation"]["paced_tasks"] > 0
    assert "EMULATED devices" in run.stdout
    assert "EMULATED" in json.loads(trace.read_text())["otherData"]["emulation"]
    assert list(tb.glob("events.out.tfevents.*"))


def test_bad_flags_fail_with_a_clear_message(tmp_path):
    run = _train(tmp_path, "--devices=fast,1")
    assert run.returncode != 0 and "cannot read device 'fast'" in run.stderr
    run = _train(tmp_path, "--dataset=mnist", "--epochs=1")
    assert run.returncode != 0 and "'mnist' is not prepared" in run.stderr and "never downloads" in run.stderr
    run = _train(tmp_path, "--num_stages=3", "--devices=1,1")
    assert run.returncode != 0 and "--num_stages=3 but --devices lists 2 devices" in run.stderr


def test_plan_auto_profiles_plans_and_trains(tmp_path):
    run = _train(tmp_path, "--plan=auto", "--epochs=1", "--steps_per_epoch=8", "--devices=1@64M,0.5@64M,0.5@64M",
                 "--model=mlp", "--dilation=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "policy GIVEN" in run.stdout and "predicted" in run.stdout and "Max_m=" in run.stdout
    summary = json.loads(run.stdout.split("summary: ")[1].splitlines()[0])
    assert summary["num_minibatches"] >= 1 and len(summary["devices"]) == 3
