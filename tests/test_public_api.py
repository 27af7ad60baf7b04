import subprocess
import sys

import hetpipe_tf


def test_every_exported_name_resolves():
    for name in hetpipe_tf.__all__:
        assert getattr(hetpipe_tf, name).__name__ == name


_PURE_LAYERS_WITHOUT_TENSORFLOW = """
import importlib, pkgutil, sys

class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "keras"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Uninstalled())
import hetpipe_tf.pipeline, hetpipe_tf.planning
names = ["hetpipe_tf.sync.staleness"] + [m.name for pkg in (hetpipe_tf.pipeline, hetpipe_tf.planning)
                                         for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_the_pure_layers_import_with_tensorflow_made_unimportable():
    run = subprocess.run([sys.executable, "-c", _PURE_LAYERS_WITHOUT_TENSORFLOW], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) >= 15  # every module of pipeline/ and planning/, and the staleness rules


_WITHOUT_TENSORFLOW = """
import sys

class Uninstalled:  # as if neither tensorflow nor keras were installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "keras"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Uninstalled())
import hetpipe_tf
try:
    hetpipe_tf.VirtualWorker
except ImportError as exc:
    print("ImportError:", exc)
"""


def test_without_tensorflow_import_says_in_one_line_what_to_install():
    run = subprocess.run([sys.executable, "-c", _WITHOUT_TENSORFLOW], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip().splitlines() == [hetpipe_tf.TENSORFLOW_NEEDED]
    assert "pip install tensorflow-cpu==2.21.0" in run.stderr
    assert run.stdout.startswith("ImportError: " + hetpipe_tf.TENSORFLOW_NEEDED)
    assert "VirtualWorker needs" in run.stdout


def test_with_tensorflow_import_says_nothing():
    run = subprocess.run([sys.executable, "-c", "import hetpipe_tf"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "" and run.stdout == ""
