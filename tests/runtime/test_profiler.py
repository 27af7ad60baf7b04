import os

import keras

from hetpipe_tf.planning.profile import Profile
from hetpipe_tf.runtime.profiler import measure_profile
from tests.helpers import models


def _any_load_is_idle(monkeypatch):
    """The caching tests hold on a host however busy: other processes' share never counts as busy."""
    from hetpipe_tf.runtime import host_load
    monkeypatch.setattr(host_load, "BUSY_SHARE", 1.0)


def test_measured_profile_has_times_and_executor_costs_and_is_cached(tmp_path, monkeypatch):
    _any_load_is_idle(monkeypatch)
    model = models.mlp()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    before = [v.numpy() for v in model.weights]
    p = measure_profile(model, 8, loss=loss, optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                        cache_dir=str(tmp_path), repeats=3)
    host = p.times["host"]
    assert len(host.forward) == len(host.backward) == p.num_segments == 4
    assert all(t >= 0 for t in host.forward + host.backward) and sum(host.forward) > 0
    assert host.forward_overhead > 0 and host.backward_overhead > 0 and "measured on" in host.source
    # An apply takes time; how it grows with bytes is the host's (on a model this small, noise can
    # make the larger apply no slower: per byte 0).
    assert (p.apply_base > 0 or p.apply_per_byte > 0) and p.apply_per_byte >= 0 and p.apply_shared_per_byte >= 0
    assert p.instruction_seconds > 0
    assert p.pacing_overshoot_seconds >= 0
    assert all((a == b).all() for a, b in zip(before, [v.numpy() for v in model.weights]))  # probe undone
    cached = list(tmp_path.glob("*.json"))
    assert len(cached) == 1 and Profile.from_json(cached[0].read_text()) == p
    again = measure_profile(model, 8, loss=loss, optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                            cache_dir=str(tmp_path))
    assert again == p


def test_synthetic_transfer_benchmark_times_each_size_in_bytes():
    from hetpipe_tf.runtime.profiler import measure_transfers
    samples = measure_transfers("/device:CPU:0", "/device:CPU:1", sizes=(2 ** 12, 2 ** 22), repeats=3)
    # How the times grow with the size is the host's (a loaded one can invert two of them).
    assert [b for b, _ in samples] == [2 ** 14, 2 ** 24] and all(t > 0 for _, t in samples)


def test_a_profile_timed_on_another_device_is_cached_apart_and_names_it(tmp_path, monkeypatch):
    """stage_device: the segments' passes timed where the stages will run (a cluster task's CPU
    for launch="processes"), not where the profile is taken; the cache keeps both."""
    _any_load_is_idle(monkeypatch)
    model = models.mlp()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    here = measure_profile(model, 8, loss=loss, cache_dir=str(tmp_path), repeats=3)
    there = measure_profile(model, 8, loss=loss, cache_dir=str(tmp_path), repeats=3, stage_device="/device:CPU:1")
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert "(/device:CPU:0)" in here.times["host"].source and "(/device:CPU:1)" in there.times["host"].source
    assert sum(there.times["host"].forward) > 0 and (there.apply_base > 0 or there.apply_per_byte > 0)


def test_a_profile_measured_while_other_processes_take_the_cores_is_used_but_not_cached(tmp_path):
    """A process per core spinning beside the profiling takes far more than a quarter
    of the host's CPU: the profile comes back, with a warning naming their share, and no file is
    kept, so that a later plan on the idle host measures again."""
    import subprocess
    import sys
    import warnings

    model = models.mlp()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Started through a shell that exits, so that they are no children of this process (whose own
    # tree, a cluster's tasks, does not count as other processes).
    spinners = [int(subprocess.run(["sh", "-c", f"nohup {sys.executable} -c 'while True: pass' >/dev/null 2>&1 & "
                                               f"echo $!"], capture_output=True, text=True, check=True).stdout)
                for _ in range(os.cpu_count() or 1)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = measure_profile(model, 8, loss=loss, cache_dir=str(tmp_path), repeats=3)
    finally:
        for spinner in spinners:
            os.kill(spinner, 9)
    assert sum(p.times["host"].forward) > 0
    assert list(tmp_path.glob("*.json")) == []
    busy = [str(w.message) for w in caught if "busy host" in str(w.message)]
    assert len(busy) == 1 and "other processes used" in busy[0] and "not cached" in busy[0]


def test_this_process_trees_own_cpu_is_not_counted_as_other_processes():
    """A process this one started (a cluster's task) is this tree's: its CPU is not another
    process's; one started through a shell that exits (no child of this process) is another's."""
    import subprocess
    import sys

    from hetpipe_tf.runtime.host_load import process_table, process_tree

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    orphan = int(subprocess.run(["sh", "-c", f"nohup {sys.executable} -c 'import time; time.sleep(60)' "
                                             f">/dev/null 2>&1 & echo $!"],
                                capture_output=True, text=True, check=True).stdout.strip())
    try:
        parents, _ = process_table()
        tree = process_tree(os.getpid(), parents)
    finally:
        child.kill()
        child.wait()
        os.kill(orphan, 9)
    assert os.getpid() in tree and child.pid in tree and orphan not in tree
