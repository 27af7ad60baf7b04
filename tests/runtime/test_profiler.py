import keras

from hetpipe_tf.planning.profile import Profile
from hetpipe_tf.runtime.profiler import measure_profile
from tests.helpers import models


def test_measured_profile_has_times_and_executor_costs_and_is_cached(tmp_path):
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


def test_a_profile_timed_on_another_device_is_cached_apart_and_names_it(tmp_path):
    """stage_device: the segments' passes timed where the stages will run (a cluster task's CPU
    for launch="processes"), not where the profile is taken; the cache keeps both."""
    model = models.mlp()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    here = measure_profile(model, 8, loss=loss, cache_dir=str(tmp_path), repeats=3)
    there = measure_profile(model, 8, loss=loss, cache_dir=str(tmp_path), repeats=3, stage_device="/device:CPU:1")
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert "(/device:CPU:0)" in here.times["host"].source and "(/device:CPU:1)" in there.times["host"].source
    assert sum(there.times["host"].forward) > 0 and (there.apply_base > 0 or there.apply_per_byte > 0)
