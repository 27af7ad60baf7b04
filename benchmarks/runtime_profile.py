"""Where a virtual worker's time goes, from a py-spy recording (the table of ``docs/performance.md``).

Records ``VirtualWorker(devices="cpu,cpu", num_in_flight=2)`` fitting the MLP of
``runtime_overhead.py`` (Dense 32-32-32-10, batch 32; host CPU, nothing emulated) with
py-spy's sampling profiler, and sorts every sample of the timed epoch's threads into what the
runtime does per minibatch: the compiled calls' kernels, their Python dispatch, the executor's
thread hand-offs, eager ops, stash copies, host readbacks, the input pipeline, metrics and
callbacks. py-spy (``pip install py-spy``) is not a dependency of the package.

    python benchmarks/runtime_profile.py [--steps=600] [--rate=400] [--out=profile.txt]
    python benchmarks/runtime_profile.py --categorise=profile.txt   # an earlier recording

Prints one JSON line: ms per minibatch (wall and CPU, measured without the profiler), the
samples, each category's share of them and its thread-ms per minibatch, and the samples of
threads waiting on a lock or condition apart.
"""
import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

#: Categories that any frame of a sample decides (first match), then the leaf frame's.
BY_ANY_FRAME = (
    ("metrics, callbacks, learning-rate order", ("callback_list.py", "callbacks.py", "progbar", "on_minibatch_done",
                                                "LearningRateFollower", "sync_optimizer", "Events.get")),
    ("stash copies (custom ops)", ("weight_stash.py",)),
    ("finite check, host readback", ("_numpy (", "check_finite", "__float__")),
    ("input pipeline (tf.data)", ("tensorflow/python/data",)),
)

#: Samples of threads blocked on a lock or condition (py-spy does not always tell them idle): not CPU
#: time, reported apart from the shares.
WAITING = "waiting on a lock or condition (a stage for its next ready task, the fit for the pipeline)"

CHILD = """
import os, sys, time
import numpy as np, keras, tensorflow as tf
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
steps = int(sys.argv[1])
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(32, activation="relu") for _ in range(3)]
                         + [keras.layers.Dense(10)])
rng = np.random.default_rng(0)
ds = tf.data.Dataset.from_tensor_slices((rng.normal(size=(steps * 32, 32)).astype("float32"),
                                         rng.integers(0, 10, steps * 32))).batch(32, drop_remainder=True)
vw = VirtualWorker(model, devices="cpu,cpu", num_in_flight=2, optimizer=keras.optimizers.SGD(0.01),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
vw.fit(ds.take(5), epochs=1, verbose=0)  # traces and starts; not timed
print("ready", flush=True)
sys.stdin.readline()  # the profiler, if any, is attached
t, c = time.perf_counter(), time.process_time()
vw.fit(ds, epochs=1, verbose=0)
print(1000 * (time.perf_counter() - t) / steps, 1000 * (time.process_time() - c) / steps, flush=True)
"""


def category(frames):
    stack = ";".join(frames)
    if not stack.strip():
        return "TensorFlow's own threads (no Python frames: kernels, its executor)"
    leaf = frames[-1]
    if any(m in leaf for m in ("threading.py", "queue.py")):
        return WAITING  # whatever the thread waits in (the fit for the pipeline's next event, say)
    for name, marks in BY_ANY_FRAME:
        if any(m in stack for m in marks):
            return name
    compiled = "CompiledCall" in stack or "polymorphic_function" in stack
    if "execute.py" in leaf:
        return ("TensorFlow runtime in compiled calls (kernels, graph executor)" if compiled
                else "eager ops (one TensorFlow op per Python call)")
    if compiled:
        return "tf.function dispatch (Python: binding, flattening, packing)"
    if "hetpipe_tf" in leaf:
        return "executor and stage runtime: Python"
    if "eager/" in stack or "framework/ops.py" in stack:
        return "eager ops (one TensorFlow op per Python call)"
    return "other Python"


def categorise(path):
    """(samples, waiting samples, {category: share of the samples not waiting}) of a recording
    attached for the timed epoch only."""
    shares, total, waiting = collections.Counter(), 0, 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if "readline" in stack:  # waiting for the profiler to attach
                continue
            name = category(stack.split(";"))
            if name == WAITING:
                waiting += int(n)
            else:
                total += int(n)
                shares[name] += int(n)
    return total, waiting, {name: round(n / total, 3) for name, n in shares.most_common()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rate", type=int, default=400)
    parser.add_argument("--out", default=None)
    parser.add_argument("--categorise", default=None)
    args = parser.parse_args()
    row = {"model": "mlp", "k": 2, "num_in_flight": 2, "devices": "host CPU (real compute, not emulated)"}
    path = args.categorise
    if path is None:
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(CHILD)
        path = args.out or os.path.join(tempfile.mkdtemp(), "profile.txt")
        for profiled in (False, True):  # timed without the profiler, then recorded
            child = subprocess.Popen([sys.executable, f.name, str(args.steps)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert child.stdout.readline().strip() == "ready"
            spy = subprocess.Popen([shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-r", str(args.rate), "-f", "raw", "-o", path, "--pid",
                                    str(child.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) \
                if profiled else None
            time.sleep(2 if profiled else 0)
            child.stdin.write("go\n")
            child.stdin.flush()
            wall, cpu = (float(v) for v in child.stdout.readline().split())
            child.wait()
            if spy:
                spy.wait()
            else:
                row["ms_per_minibatch"], row["cpu_ms_per_minibatch"] = round(wall, 3), round(cpu, 3)
    row["samples"], row["waiting_samples"], row["shares"] = categorise(path)
    # A sample is 1 / rate s of one thread: thread-ms per minibatch (a thread inside a TensorFlow call
    # counts while it waits for the call's kernels, which TensorFlow's own threads may run).
    per_minibatch = 1000 / args.rate / args.steps
    row["thread_ms_per_minibatch"] = {name: round(share * row["samples"] * per_minibatch, 2)
                                      for name, share in row["shares"].items()}
    row["waiting_thread_ms_per_minibatch"] = round(row["waiting_samples"] * per_minibatch, 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
