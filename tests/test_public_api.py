import subprocess
import sys

import hetpipe_tf


def test_every_exported_name_resolves():
    for name in hetpipe_tf.__all__:
        assert getattr(hetpipe_tf, name).__name__ == name


def test_pure_modules_import_without_tensorflow():
    code = ("import sys; import hetpipe_tf.schedule, hetpipe_tf.simulator, hetpipe_tf.emulation, "
            "hetpipe_tf.model_graph, hetpipe_tf.partitioner; "
            "assert 'tensorflow' not in sys.modules, sorted(m for m in sys.modules if 'tensorflow' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
