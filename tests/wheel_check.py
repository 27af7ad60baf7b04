"""The wheel check (`make wheel-check`, run by CI): hetpipe_tf built and installed as a user would,
run from outside the checkout.

1. ``python -m build --no-isolation``: an sdist, then a wheel built from that sdist, with the
   custom ops compiled against the TensorFlow of the Python that runs this script (without build
   isolation: that TensorFlow is the one pyproject.toml pins, already installed, so the build does
   not install a second copy of it into an isolated environment; ``--install=source`` checks the
   isolated build that ``pip install .[cpu]`` makes).
2. The sdist and the wheel hold what they must: the sources and headers of the ops, the bundled
   data, and in the wheel the library and its build record naming that TensorFlow; no tests, and
   in the sdist no library or build record of the checkout (MANIFEST.in).
3. A fresh venv (no site packages) gets the wheel with its ``cpu`` extra (or, with
   ``--install=source``, ``pip install CHECKOUT[cpu]``, not editable). ``--no-compile``: pip then
   does not byte-compile all of TensorFlow at install time; the modules a run imports are
   compiled when imported.
4. From a temporary directory outside the checkout, without PYTHONPATH: hetpipe_tf is imported from
   the venv, and ``hetpipe-train`` (the main job, a short run) ends with its summary.
5. ``--remedy``: the installed library's build record is made to name another TensorFlow; the import
   must fail naming the reinstall from source, and that command, run with the sdist, must rebuild the
   library so that the ops load again.

Exits non-zero with the step that failed; prints each step's time and the wheel's size and contents.
"""
import argparse
import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_RECORD = "hetpipe_tf/ops/_hetpipe_ops_build.json"
OPS_SOURCES = ("hetpipe_tf/ops/cc/kernels/weight_stash_kernels.cc", "hetpipe_tf/ops/cc/kernels/resource_lookup.h",
               "hetpipe_tf/ops/cc/ops/wsp_clock_ops.cc")
DATA = "hetpipe_tf/data/digits.npz"


class CheckFailed(Exception):
    """A step of the check found the package wrong."""


def run(cmd: list[str], cwd: str | None = None, env: dict[str, str] | None = None) -> str:
    """Runs `cmd`; its output, or CheckFailed with the output's end."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc.stdout


def tensorflow_version() -> str:
    """The version of the TensorFlow this Python has (tensorflow-cpu or tensorflow)."""
    for name in ("tensorflow-cpu", "tensorflow"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    raise CheckFailed(f"{sys.executable} has no TensorFlow to build against: run `make wheel-check` (it uses .venv)")


def build(out: str) -> tuple[str, str]:
    """The sdist and the wheel that ``python -m build --no-isolation`` makes of the checkout in
    `out`/dist. The ``build`` package goes to `out`/tools, not into this Python's environment."""
    tools, out = os.path.join(out, "tools"), os.path.join(out, "dist")
    if not os.path.isdir(os.path.join(tools, "build")):
        run([sys.executable, "-m", "pip", "install", "-q", "--target", tools, "build"])
    shutil.rmtree(out, ignore_errors=True)
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")]))))
    sdists, wheels = glob.glob(os.path.join(out, "*.tar.gz")), glob.glob(os.path.join(out, "*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise CheckFailed(f"python -m build made {sdists + wheels} in {out}, not one sdist and one wheel")
    return sdists[0], wheels[0]


def missing(names: list[str], wanted: tuple[str, ...]) -> list[str]:
    return [w for w in wanted if not any(n.endswith(w) for n in names)]


def check_sdist(sdist: str) -> None:
    """The sdist builds the package: setup.py, pyproject.toml, the ops' sources and headers, the data."""
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    lacking = missing(names, ("setup.py", "pyproject.toml", DATA) + OPS_SOURCES)
    if lacking:
        raise CheckFailed(f"the sdist {sdist} lacks {lacking}")
    shipped = [n for n in names if n.endswith((".so", BUILD_RECORD)) or "/tests/" in n]
    if shipped:
        raise CheckFailed(f"the sdist {sdist} ships {shipped[:5]}: a built library, its record or tests")


def check_wheel(wheel: str, built_for: str) -> list[str]:
    """The wheel's library, its build record naming `built_for`, the data and the entry points, no
    tests; returns the wheel's files other than Python modules."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        libraries = [n for n in names if n.startswith("hetpipe_tf/ops/_hetpipe_ops") and n.endswith(".so")]
        if len(libraries) != 1:
            raise CheckFailed(f"the wheel {wheel} has op libraries {libraries}, not one")
        lacking = missing(names, (BUILD_RECORD, DATA))
        if lacking:
            raise CheckFailed(f"the wheel {wheel} lacks {lacking}")
        record = json.loads(z.read(BUILD_RECORD))
        if record["tensorflow_version"] != built_for or record["library"] != os.path.basename(libraries[0]):
            raise CheckFailed(f"the wheel's build record {record} does not name TensorFlow {built_for} and the "
                              f"library {libraries[0]}")
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for script in ("hetpipe-train = hetpipe_tf.cli.train:run", "hetpipe = hetpipe_tf.cli.hetpipe:run"):
        if script not in entry_points:
            raise CheckFailed(f"the wheel's entry points lack {script!r}:\n{entry_points}")
    outside = [n for n in names if not n.startswith(("hetpipe_tf/", "hetpipe_tf-"))]
    if outside:
        raise CheckFailed(f"the wheel {wheel} installs {outside[:5]} outside the package (tests?)")
    return [n for n in names if not n.endswith(".py")]


def fresh_venv(venv: str, requirement: str) -> None:
    """A new venv at `venv` with `requirement` installed."""
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", venv])
    run_outside([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--no-compile", requirement])


def run_outside(cmd: list[str]) -> str:
    """Runs `cmd` as :func:`run` does, from a temporary directory outside the checkout and without
    PYTHONPATH: neither the checkout's package nor its egg-info is then on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="hetpipe_wheel_check_") as cwd:
        return run(cmd, cwd=cwd, env=env)


def run_main_job(venv: str, steps: int) -> dict:
    """hetpipe_tf imported from `venv` and a short main job run there from a directory outside the
    checkout; the job's summary."""
    where = run_outside([os.path.join(venv, "bin", "python"), "-c",
                         "import hetpipe_tf; print(hetpipe_tf.__file__)"]).strip().splitlines()[-1]
    if not os.path.realpath(where).startswith(os.path.realpath(venv)):
        raise CheckFailed(f"hetpipe_tf was imported from {where}, not from the venv {venv}")
    out = run_outside([os.path.join(venv, "bin", "hetpipe-train"), "--epochs=1", f"--steps_per_epoch={steps}"])
    summaries = [line for line in out.splitlines() if line.startswith("summary: ")]
    if not summaries:
        raise CheckFailed(f"hetpipe-train printed no summary:\n{out[-4000:]}")
    return json.loads(summaries[-1][len("summary: "):])


def check_remedy(venv: str, sdist: str) -> None:
    """A build record naming another TensorFlow: the import fails naming the reinstall from source,
    and that reinstall (with the sdist as SOURCE) makes the ops load again."""
    python = os.path.join(venv, "bin", "python")
    load = [python, "-c", "from hetpipe_tf.ops import loader; loader.load_ops(); print('loaded')"]
    ops_dir = run_outside([python, "-c", "from hetpipe_tf.ops import loader; import os; "
                           "print(os.path.dirname(loader.library_path()))"]).strip().splitlines()[-1]
    if not os.path.realpath(ops_dir).startswith(os.path.realpath(venv)):
        raise CheckFailed(f"the ops were found in {ops_dir}, not in the venv {venv}")
    record_path = os.path.join(ops_dir, os.path.basename(BUILD_RECORD))
    with open(record_path) as f:
        record = json.load(f)
    with open(record_path, "w") as f:
        json.dump(dict(record, tensorflow_version="0.0.0"), f)
    try:
        run_outside(load)
    except CheckFailed as e:
        message = str(e)
    else:
        raise CheckFailed("a build record naming TensorFlow 0.0.0 loaded without an error")
    remedy = message.split("rebuild them with: ", 1)[-1].split("  (SOURCE", 1)[0].split()
    if "built against TensorFlow 0.0.0" not in message or remedy[:2] != ["pip", "install"] or remedy[-1] != "SOURCE":
        raise CheckFailed(f"the mismatch's error names no reinstall from SOURCE:\n{message[-2000:]}")
    run_outside([python, "-m", *remedy[:-1], "-q", sdist])
    if "loaded" not in run_outside(load):
        raise CheckFailed("the ops did not load after the reinstall that the error named")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "wheel-check"),
                        help="where the sdist, the wheel and the fresh venv go")
    parser.add_argument("--install", choices=("wheel", "source"), default="wheel",
                        help="install the built wheel, or `pip install CHECKOUT[cpu]` (an isolated build)")
    parser.add_argument("--steps", type=int, default=20, help="minibatches of the main job's one epoch")
    parser.add_argument("--remedy", action="store_true", help="also check the mismatch's remedy (another build)")
    args = parser.parse_args()
    times = {}
    start = time.monotonic()
    try:
        sdist, wheel = build(args.out)
        times["build (sdist, then the wheel from it)"] = time.monotonic() - start
        check_sdist(sdist)
        contents = check_wheel(wheel, tensorflow_version())
        venv = os.path.join(args.out, "venv")
        start = time.monotonic()
        fresh_venv(venv, f"{wheel}[cpu]" if args.install == "wheel" else f"{ROOT}[cpu]")
        times[f"fresh venv, pip install {'the wheel' if args.install == 'wheel' else 'CHECKOUT'}[cpu]"] = (
            time.monotonic() - start)
        start = time.monotonic()
        summary = run_main_job(venv, args.steps)
        times[f"hetpipe-train --epochs=1 --steps_per_epoch={args.steps}, outside the checkout"] = (
            time.monotonic() - start)
        if args.remedy:
            start = time.monotonic()
            check_remedy(venv, sdist)
            times["a mismatched build record, its remedy run"] = time.monotonic() - start
    except CheckFailed as e:
        print(f"wheel check FAILED: {e}", file=sys.stderr)
        return 1
    print(f"wheel: {os.path.basename(wheel)}, {os.path.getsize(wheel) / 2 ** 10:.0f} KiB; "
          f"sdist {os.path.getsize(sdist) / 2 ** 10:.0f} KiB")
    print("the wheel's files besides Python modules:\n  " + "\n  ".join(contents))
    print(f"the main job from the venv: test accuracy {summary['test_accuracy']}")
    for step, seconds in times.items():
        print(f"{seconds:7.1f} s  {step}")
    print("wheel check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
