"""HetPipeStrategy in one process (launch="in_process"); the multi-process launches are in
test_train.py's cluster runs."""
import dataclasses

import keras
import numpy as np
import pytest

from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.pipeline.instructions import Backward, Forward
from tests.helpers.strategy import Counter, compiled_digits


def test_fit_trains_virtual_workers_like_keras_fit():
    strategy = HetPipeStrategy(cluster="local", policy="ed", staleness_bound=1, launch="in_process", dilation=1)
    train, test, model = compiled_digits(strategy)
    counter = Counter()
    history = model.fit(train, epochs=2, steps_per_epoch=12, validation_data=test, callbacks=[counter], verbose=0)
    assert strategy.plan.allocation == "FS FS" and len(strategy.runner.vws) == 2  # §8.1's ED
    assert strategy.runner.servers.placement == "local"
    # What was asked stays apart from what was decided: Nm and the placement left to the planner,
    # the run resolved with the plan's (an integer Nm, ED's local placement), which every worker trains.
    assert strategy.request.num_in_flight is None and strategy.request.placement is None
    assert strategy.run_config.num_in_flight == strategy.plan.num_in_flight == strategy.runner.num_in_flight >= 1
    assert strategy.run_config.placement == strategy.plan.placement == "local"
    assert len(counter.epochs) == 2 and counter.batches == 24
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "images_per_s", "global_clock"):
        assert len(history.history[key]) == 2, key
    # The global weights improve on the fixed test set (the training loss, a mean over 12 shuffled
    # minibatches near ln 10 after 24 steps, moved by less than its noise: 2.319 -> 2.324 in one run).
    assert history.history["val_loss"][1] < history.history["val_loss"][0]
    # The Keras model holds the global weights: Keras's own evaluate and predict use them.
    for v in model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), strategy.runner.servers.variables[v.path].numpy())
    loss, accuracy = model.evaluate(test, verbose=0)
    assert loss == pytest.approx(history.history["val_loss"][1], rel=1e-4)
    assert model.predict(next(iter(test))[0], verbose=0).shape == (16, 10)
    stats = strategy.stats()
    assert [s["worker"] for s in stats] == [0, 1] and all(s["images_per_s"] > 0 for s in stats)
    assert "EMULATED" in strategy.describe()


def test_host_cpu_devices_train_as_they_are_and_fit_goes_on_where_it_ended():
    strategy = HetPipeStrategy(cluster="local_cpu", policy="np", vw_size=2, num_in_flight=2, launch="in_process")
    train, test, model = compiled_digits(strategy)
    first = model.fit(train, epochs=1, steps_per_epoch=8, verbose=0)
    assert len(strategy.runner.vws) == 2 and not strategy.runner.emulated
    assert "emulated_overrun_fraction" not in first.history and "EMULATED" not in strategy.describe()
    assert first.history["global_clock"] == [2]  # 8 minibatches, 4 per worker, waves of Nm = 2

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("callback failed")

    # A later fit goes on from the servers' clock; a failed one ends its run at once and the
    # next starts a new run from the Keras model's weights.
    second = model.fit(train, epochs=1, steps_per_epoch=8, verbose=0)
    assert second.history["global_clock"] == [4]
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(RuntimeError, match="callback failed"):
        model.fit(train, epochs=1, steps_per_epoch=40, callbacks=[Boom()], verbose=0)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
    third = model.fit(train, epochs=1, steps_per_epoch=8, validation_data=test, verbose=0)
    assert third.history["global_clock"] == [2] and third.history["val_accuracy"][0] > 0.1


def test_fit_takes_arrays_and_names_what_it_does_not_take():
    strategy = HetPipeStrategy(cluster="local", policy="np", launch="in_process", dilation=1)
    train, _, model = compiled_digits(strategy)
    x = np.concatenate([b[0].numpy() for b in train.take(4)])
    y = np.concatenate([b[1].numpy() for b in train.take(4)])
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1
    with pytest.raises(ValueError, match=r"does not take \['class_weight'\]"):
        model.fit(x, y, class_weight={0: 1.0})
    with pytest.raises(ValueError, match="give neither y nor batch_size"):
        model.fit(train, batch_size=8)


@pytest.mark.parametrize("kwargs,message", [
    ({"policy": "zz"}, "unknown policy 'zz'; allowed: np, ed, hd, auto"),
    ({"launch": "ssh"}, "unknown launch 'ssh'; allowed: processes, tf_config, in_process"),
    ({"staleness_bound": -1}, r"staleness_bound \(D\) must be an integer >= 0, got -1"),
    ({"num_in_flight": 0}, r"num_in_flight \(Nm\) must be None or an integer >= 1, got 0"),
    ({"placement": "near"}, "unknown placement 'near'"),
    ({"cluster": "paper"}, "has accelerator types .*launch='tf_config'"),
    ({"cluster": "nowhere.json"}, "no cluster preset or file named 'nowhere.json'"),
    ({"emulate_links": True}, "emulated links join the tasks that launch='processes' starts"),
    ({"schedule": "gpipe-typo"}, "unknown schedule 'gpipe-typo'; the registered ones are: .*hetpipe"),
    ({"sync": "bsp-typo"}, "unknown sync 'bsp-typo'; the registered ones are: .*wsp"),
    ({"on_worker_failure": "retry"}, "unknown on_worker_failure 'retry'; allowed: 'stop', 'continue'"),
    ({"on_worker_failure": "continue"}, "launch='in_process' runs every worker in this process: use "
                                        "launch='processes' or 'tf_config', or on_worker_failure='stop'"),
    ({"emulation_references": "solo"}, "unknown emulation_references 'solo'; allowed: measured, profile"),
    ({"emulation_references": "profile", "uneven_minibatches": True},
     "with uneven_minibatches the workers train others: use emulation_references='measured'"),
    ({"profile": "nowhere.json"}, "profile='nowhere.json': give a Profile or the path of one's JSON"),
    ({"replan": "always"}, "unknown replan 'always'; allowed: 'off', 'auto'"),
    ({"replan": "auto", "launch": "processes", "on_worker_failure": "continue"},
     "replan='auto' switches plans with every virtual worker's process in the run"),
    ({"replan": "auto", "uneven_minibatches": True}, "replan='auto' keeps every worker's shard of the data"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HetPipeStrategy(**dict({"launch": "in_process"}, **kwargs))


def test_devices_emulated_from_a_given_profile_pace_to_its_times_and_no_stage_is_timed_again(tmp_path):
    first = HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1,
                            emulation_references="profile")
    train, _, model = compiled_digits(first)
    model.fit(train, epochs=1, steps_per_epoch=4, verbose=0)
    for w, vw in enumerate(first.runner.vws):  # each stage paced to its segments' times by the plan's profile
        expected = first.plan.host_pass_seconds(w)
        assert [(r[Forward], r[Backward]) for r in vw.references] == [pytest.approx(p) for p in expected]
    path = tmp_path / "profile.json"
    path.write_text(first.plan.profile.to_json())
    # Another run given that profile plans with it and emulates the same devices, even where its
    # stages would time differently now: the profile's times are made 3x longer here.
    times = first.plan.profile.times["host"]
    slower = dataclasses.replace(times, forward=tuple(3 * t for t in times.forward),
                                 backward=tuple(3 * t for t in times.backward))
    path.write_text(first.plan.profile.with_times("host", slower).to_json())
    second = HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1, profile=str(path),
                             emulation_references="profile")
    train, _, model = compiled_digits(second)
    model.fit(train, epochs=1, steps_per_epoch=4, verbose=0)
    assert second.plan.profile.times["host"] == slower
    for w, vw in enumerate(second.runner.vws):
        assert [(r[Forward], r[Backward]) for r in vw.references] == [
            pytest.approx(p) for p in second.plan.host_pass_seconds(w)]
    # A profile of another model, or of another batch size, is refused before anything runs.
    third = HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1, profile=str(path))
    train, _, model = compiled_digits(third, name="cnn")
    with pytest.raises(ValueError, match="give the profile of this model and batch size, or profile=None"):
        model.fit(train, epochs=1, steps_per_epoch=4, verbose=0)


def test_a_transformers_profile_is_taken_for_the_same_model_built_again():
    # A profile counts attention scores and embedding lookups (not in the graph's own FLOPs): the
    # check that a given profile is the model's must count them alike.
    from hetpipe_tf.runtime.plan_assembly import checked_profile
    from hetpipe_tf.cli.models import gpt
    from hetpipe_tf.runtime.profiler import model_profile

    profile = model_profile(gpt(11, 12), 32)
    assert checked_profile(profile, gpt(11, 12), 32) is profile
    with pytest.raises(ValueError, match="give the profile of this model and batch size"):
        checked_profile(profile, gpt(11, 12, blocks=1), 32)


@pytest.mark.slow
def test_replan_auto_trains_as_one_run_and_reports_its_decisions():
    """replan='auto' without a slowed device (slow: it trains the digits in chunks on the local
    cluster; the switch itself is covered by tests/runtime/test_replan_switch.py): the run trains
    every step of every epoch in chunks, decides nothing, and stats() carry its (empty) decisions."""
    strategy = HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1, replan="auto")
    train, test, model = compiled_digits(strategy)
    counter = Counter()
    history = model.fit(train, epochs=2, steps_per_epoch=12, callbacks=[counter], verbose=0)
    assert len(counter.epochs) == 2 and counter.batches == 24 and history.history["plan_switches"] == [0, 0]
    assert strategy.runner.positions == [12, 12] and strategy.runner.plan is strategy.plan
    stats = strategy.stats()
    assert [s["worker"] for s in stats] == [0, 1] and all(s["replan_decisions"] == [] for s in stats)
