"""The hetpipe-train binary run in a process of its own (it configures TensorFlow's devices)."""
import subprocess
import sys

#: Two virtual workers on the local preset's emulated devices, a few minibatches of the mlp.
CLUSTER_RUN = ["--cluster=local", "--model=mlp", "--epochs=2", "--steps_per_epoch=8", "--dilation=2", "--num_in_flight=2",
               "--momentum=0", "--learning_rate=0.1"]


def hetpipe_train(tmp_path, *flags):
    """The finished `hetpipe-train` run with `flags`, its data under `tmp_path`, schedule not printed."""
    cmd = [sys.executable, "-m", "hetpipe_tf.cli.train", f"--data_dir={tmp_path / 'tfds'}", "--show_schedule=false",
           *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
