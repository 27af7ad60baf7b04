"""examples/subclassed_model.py runs as a user runs it, at a small size, and its model learns."""
import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "subclassed_model.py"


def test_the_subclassed_model_example_trains_its_model_cut_into_two_stages(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parents[1]), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--epochs=2", "--steps_per_epoch=4", "--blocks=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "virtual worker: 2 stages, Nm=2" in done.stdout and ".. head), sends 1 tensor" in done.stdout
    losses = json.loads(done.stdout.split("loss per epoch: ")[1].splitlines()[0])
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "Keras's evaluate: {'loss'" in done.stdout
