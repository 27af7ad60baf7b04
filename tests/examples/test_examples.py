"""Every script of examples/ runs as a user runs it, at a small size (its own flags say how)."""
import json
import os
import pathlib
import signal
import subprocess
import sys

from hetpipe_tf.distributed.ports import free_port

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _env(tmp_path, **extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TFDS_DATA_DIR=str(tmp_path / "tfds"), **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES.parent), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def _run(tmp_path, script, *flags, timeout=400):
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *flags], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} {flags} exited {done.returncode}:\n{done.stderr[-5000:]}"
    return done.stdout


def test_own_model_trains_on_two_devices_and_keras_evaluates_the_result(tmp_path):
    out = _run(tmp_path, "own_model.py", "--epochs=1", "--steps_per_epoch=4")
    assert "virtual worker: 2 stages, Nm=2" in out
    assert "Keras's evaluate: {'accuracy'" in out


def test_keras_hub_causal_lm_trains_with_adamw_clip_and_bf16(tmp_path):
    out = _run(tmp_path, "keras_hub_causal_lm.py", "--epochs=1", "--steps_per_epoch=4")
    assert "virtual worker: 2 stages" in out and "token_embedding" in out


def test_wsp_run_saved_then_resumed_continues_at_the_next_epoch(tmp_path):
    flags = [f"--checkpoint_dir={tmp_path / 'run'}", "--steps_per_epoch=4", "--launch=in_process", "--dilation=2"]
    first = _run(tmp_path, "wsp_checkpoint_resume.py", "--epochs=1", *flags)
    assert "epochs trained in this call: [1]" in first
    resumed = _run(tmp_path, "wsp_checkpoint_resume.py", "--epochs=2", "--resume", *flags)
    assert "epochs trained in this call: [2]" in resumed


def test_two_machines_on_loopback_train_across_both_hosts(tmp_path):
    """host_b.sh's tasks, then host_a.sh's tasks and chief, as on two hosts (both on loopback)."""
    bases = {}
    for host in "AB":  # three consecutive free ports per host
        while True:
            base = free_port()
            if base < 65000 and all(_port_free(base + i) for i in (1, 2)):
                bases[host] = base
                break
    env = _env(tmp_path, HOST_A="127.0.0.1", HOST_B="127.0.0.1", HETPIPE_AUTHKEY=os.urandom(16).hex(),
               BASE_PORT_A=str(bases["A"]), BASE_PORT_B=str(bases["B"]))
    host_b = subprocess.Popen(["bash", str(EXAMPLES / "two_machines" / "host_b.sh")], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        done = subprocess.run(["bash", str(EXAMPLES / "two_machines" / "host_a.sh"), "--epochs=1",
                               "--steps_per_epoch=2", "--dilation=2", "--show_schedule=false",
                               f"--data_dir={tmp_path / 'tfds'}"], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=500)
        assert done.returncode == 0, done.stderr[-5000:]
        summary = json.loads(done.stdout.split("summary: ")[1].splitlines()[0])
        assert summary["cluster"] == "two_machines" and len(summary["virtual_workers"]) == 2
        assert summary["allocation"] == "FS FS"  # ED: each worker one device of each host
    finally:
        os.killpg(host_b.pid, signal.SIGTERM)
        host_b.wait(timeout=60)


def _port_free(port):
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
