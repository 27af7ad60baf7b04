"""Soak: three virtual workers, one process each, for minutes, with random transient slowdowns.

Three EMULATED nodes of two devices (the NP policy makes a virtual worker of each node:
two stages, Nm = 2) train an MLP on the bundled digits under WSP with staleness bound D,
``launch="processes"``: a chief, a ps and a worker task per node and a process per
virtual worker. Every few seconds one virtual worker's process may be paused for a
moment (SIGSTOP, then SIGCONT: a transient slowdown of the whole process, shorter than
the heartbeat timeout). Measured:

* every process's resident memory (RSS) every 2 s; after the warm-up (the first quarter
  of the run) its slope in MB per minute by least squares: a leak shows as a steady slope;
* every virtual worker's clock and its distance to the slowest worker's at every epoch's
  end (``strategy.stats()``): every clock must advance, and the distance stay within
  §5's bound. A clock counts pushed waves; a worker pushes wave c + 1 only after its
  minibatch (c + 2)·Nm took in the global weights of wave c, which waits until every
  worker pushed wave c - D: so pushed-wave clocks differ by at most D + 1;
* the emulation's overrun fraction (the pauses make tasks overrun by design; they are
  counted, not hidden).

One JSON summary line; not a test (it runs for ``--minutes``; CI does not run it).

    python benchmarks/soak.py [--minutes=10] [--staleness_bound=2] [--pause_probability=0.3]
"""
import argparse
import json
import os
import random
import signal
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLE_S = 2.0
CLUSTER = {"name": "soak", "device_types": {"E": {"label": "emulated", "emulated_speed": 1.0, "memory": "256M"}},
           "nodes": [{"name": f"node{i}", "device_type": "E", "count": 2} for i in range(3)],
           "links": {"intra_node_GBps": 15.75, "inter_node_GBps": 7.0}}


def descendants(root):
    """{pid: command line} of every process below `root`."""
    parents, commands = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                commands[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = commands.get(pid, "")
                frontier.append(pid)
    return found


def role(command):
    """A process's role from its command line: "ps:0", "worker:1", "vw2" or "other"."""
    flags = dict(a[2:].split("=", 1) for a in command.split() if a.startswith("--") and "=" in a)
    if "hetpipe_tf.distributed.server" in command:
        return f"{flags.get('job_name')}:{flags.get('task_index')}"
    if "hetpipe_tf.distributed.worker_process" in command:
        return f"vw{flags.get('worker')}"
    return "other"


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_per_minute(samples):
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    import numpy as np

    if len(samples) < 3:
        return None
    t, mb = np.array(samples).T
    return float(np.polyfit(t / 60.0, mb, 1)[0])


class Monitor:
    """Samples every process's RSS and pauses a random virtual worker's process now and then."""

    def __init__(self, pause_probability, seed):
        self.pause_probability = pause_probability
        self.random = random.Random(seed)
        self.rss = {}  # role -> [(seconds, MB)]
        self.pauses = []  # (role, seconds)
        self.start = time.monotonic()
        self._stop = threading.Event()

    def run(self):
        while not self._stop.wait(SAMPLE_S):
            now = time.monotonic() - self.start
            processes = {role(c): pid for pid, c in descendants(os.getpid()).items() if role(c) != "other"}
            for name, pid in processes.items():
                mb = rss_mb(pid)
                if mb is not None:
                    self.rss.setdefault(name, []).append((now, mb))
            workers = sorted(name for name in processes if name.startswith("vw"))
            if workers and self.random.random() < self.pause_probability:
                name, pause = self.random.choice(workers), self.random.uniform(0.3, 2.0)
                os.kill(processes[name], signal.SIGSTOP)
                time.sleep(pause)
                os.kill(processes[name], signal.SIGCONT)
                self.pauses.append((name, pause))

    def stop(self):
        self._stop.set()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--staleness_bound", type=int, default=2)
    parser.add_argument("--pause_probability", type=float, default=0.3, help="per 2 s, of pausing a worker")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import keras

    from hetpipe_tf import HetPipeStrategy
    from hetpipe_tf.cli import models
    from hetpipe_tf.data import datasets

    strategy = HetPipeStrategy(cluster=CLUSTER, policy="np", num_in_flight=2, staleness_bound=args.staleness_bound,
                               launch="processes", timeout_s=60)
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=32, shuffle=True, seed=0)
        model = models.build_model("mlp", tuple(train.element_spec[0].shape[1:]),
                                   datasets.dataset_info("hetpipe_digits").num_classes)
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    monitor = Monitor(args.pause_probability, args.seed)
    clocks = []  # per epoch end: (seconds, [clock per worker], [distance per worker])
    deadline = time.monotonic() + 60 * args.minutes

    class Watch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            stats = strategy.stats()
            clocks.append((time.monotonic() - monitor.start, [s["clock"] for s in stats],
                           [s["clock_distance"] for s in stats]))
            if time.monotonic() > deadline:
                self.model.stop_training = True

    thread = threading.Thread(target=monitor.run, name="soak-monitor", daemon=True)
    thread.start()
    history = model.fit(train, epochs=1_000_000, steps_per_epoch=24, verbose=0, callbacks=[Watch()])
    monitor.stop()
    thread.join()
    elapsed = time.monotonic() - monitor.start
    warm = elapsed / 4
    memory = {name: {"rss_mb_first": round(samples[0][1], 1), "rss_mb_last": round(samples[-1][1], 1),
                     "slope_mb_per_min_after_warmup": slope_per_minute([s for s in samples if s[0] >= warm])}
              for name, samples in sorted(monitor.rss.items())}
    first, last = clocks[0][1], clocks[-1][1]
    report = strategy.runner.emulation_report()
    max_distance = max(d for _, _, distances in clocks for d in distances)
    print(json.dumps({
        "benchmark": "soak", "minutes": round(elapsed / 60, 2), "virtual_workers": len(first),
        "allocation": strategy.plan.allocation, "staleness_bound": args.staleness_bound,
        "epochs": len(history.history["loss"]), "final_loss": history.history["loss"][-1],
        "pauses": len(monitor.pauses), "paused_s": round(sum(p for _, p in monitor.pauses), 1),
        "clocks_first_epoch": first, "clocks_last_epoch": last,
        "every_clock_advanced": all(b > a for a, b in zip(first, last)),
        "max_clock_distance": max_distance, "clock_distance_bound": args.staleness_bound + 1,
        "clock_distance_within_bound": max_distance <= args.staleness_bound + 1,
        "memory": memory,
        "max_abs_rss_slope_mb_per_min": max(abs(m["slope_mb_per_min_after_warmup"] or 0.0)
                                            for m in memory.values()),
        "emulated": True, "emulation": report.as_dict() if report else None,
        "note": "EMULATED devices; the pauses make tasks overrun by design, so the overrun fraction is not "
                "a fidelity figure here"}), flush=True)


if __name__ == "__main__":
    main()
