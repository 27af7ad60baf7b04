"""Installs hetpipe_tf and compiles its custom ops against the installed TensorFlow.

The ops are built the way tensorflow/custom-op builds them: g++ with the compile
and link flags that ``tf.sysconfig`` reports. Beside the shared library the build
writes ``_hetpipe_ops_build.json`` with the TensorFlow version it was built
against; ``hetpipe_tf.ops.loader`` refuses to load a library built for another
version and names the command that rebuilds it.
"""
import concurrent.futures
import glob
import json
import os
import shutil
import subprocess

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

OPS_LIBRARY = "hetpipe_tf.ops._hetpipe_ops"
OPS_SOURCES = sorted(glob.glob("hetpipe_tf/ops/cc/**/*.cc", recursive=True))
OPS_HEADERS = sorted(glob.glob("hetpipe_tf/ops/cc/**/*.h", recursive=True))
BUILD_INFO = "_hetpipe_ops_build.json"


class BuildTensorFlowOps(build_ext):
    """Compiles the op library with g++ and TensorFlow's sysconfig flags, a compiler per source
    file at once (as many as there are cores), then links."""

    def build_extension(self, ext):
        import tensorflow as tf  # the TensorFlow the ops must match

        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        os.makedirs(self.build_temp, exist_ok=True)
        cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
        flags = ["-fPIC", "-O2", "-Wno-deprecated-declarations", "-Wno-interference-size",
                 *tf.sysconfig.get_compile_flags()]
        objects = [os.path.join(self.build_temp, source.replace(os.sep, "_") + ".o") for source in ext.sources]
        compiles = [[cxx, "-c", *flags, source, "-o", obj] for source, obj in zip(ext.sources, objects)]
        for cmd in compiles:
            self.announce(" ".join(cmd), level=2)
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(subprocess.check_call, compiles))  # raises the first compiler that failed
        cmd = [cxx, "-shared", *objects, "-o", out, *tf.sysconfig.get_link_flags()]
        self.announce(" ".join(cmd), level=2)
        subprocess.check_call(cmd)
        info = {"tensorflow_version": tf.__version__, "compiler": cxx,
                "library": os.path.basename(out)}
        with open(os.path.join(os.path.dirname(out), BUILD_INFO), "w") as f:
            json.dump(info, f, indent=1)

    def copy_extensions_to_source(self):
        """Editable installs copy the library into the source tree: its build record goes with it."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            package = ext.name.rpartition(".")[0]
            built = os.path.join(self.build_lib, *package.split("."), BUILD_INFO)
            shutil.copyfile(built, os.path.join(build_py.get_package_dir(package), BUILD_INFO))

setup(
    name="hetpipe_tf",
    version="0.1.0",
    description="HetPipe for TensorFlow: pipelined model parallelism over "
                "heterogeneous devices, with wave synchronous data parallelism",
    packages=find_packages(include=["hetpipe_tf", "hetpipe_tf.*"]),
    # The build record is written by build_ext beside the library it describes, not copied.
    package_data={"hetpipe_tf": ["ops/cc/**/*.cc", "ops/cc/**/*.h", "data/*.npz"]},
    ext_modules=[Extension(OPS_LIBRARY, sources=OPS_SOURCES, depends=OPS_HEADERS)],
    cmdclass={"build_ext": BuildTensorFlowOps},
    python_requires=">=3.10",
    # TensorFlow comes as an extra so that a GPU build is not replaced by the
    # CPU wheel: `pip install .[cpu]` or `pip install .[gpu]`.
    install_requires=["tensorflow-datasets", "numpy", "scipy", "absl-py", "tensorboard"],
    extras_require={"cpu": ["tensorflow-cpu==2.21.0"],
                    "gpu": ["tensorflow[and-cuda]==2.21.0"],
                    "plot": ["matplotlib>=3.7"],
                    # TensorFlow's KubernetesClusterResolver lists the pods through it.
                    "kubernetes": ["kubernetes"]},
    entry_points={"console_scripts": ["hetpipe-train=hetpipe_tf.cli.train:run", "hetpipe=hetpipe_tf.cli.hetpipe:run"]},
)
