"""Every registered schedule (under WSP) and every registered synchronisation scheme (with
HetPipe's schedule) trains the bundled digits through HetPipeStrategy in one process, each
picked by one argument (issue 14 item 5)."""
import numpy as np
import pytest

import hetpipe_tf.sync.pipe_sgd  # noqa: F401 - registers the schemes the lists below name
import hetpipe_tf.sync.ssp  # noqa: F401
import hetpipe_tf.sync.wsp  # noqa: F401
from hetpipe_tf.api.strategy import HetPipeStrategy
from hetpipe_tf.pipeline.schedule import combinations, get_schedule, get_sync
from tests.helpers.strategy import compiled_digits

SCHEDULES = ("hetpipe", "gpipe", "gpipe-recompute", "pipedream", "pipedream-vsync", "naivepipe", "taylorpipe",
             "hetpipe-taylor")
SYNCS = ("wsp", "bsp", "ssp", "asp", "pipe-sgd")


def _packaged(name, lookup):
    """Whether the package registers it (other tests register toys of their own)."""
    return type(lookup(name)).__module__.startswith("hetpipe_tf.")


def test_the_lists_name_every_registration():
    pairs = combinations()
    assert {schedule for schedule, _ in pairs if _packaged(schedule, get_schedule)} == set(SCHEDULES)
    assert {sync for _, sync in pairs if sync != "none" and _packaged(sync, get_sync)} == set(SYNCS)


@pytest.mark.parametrize("schedule, sync", [(s, "wsp") for s in SCHEDULES] + [
    pytest.param("hetpipe", s, marks=pytest.mark.slow) if s == "pipe-sgd" else ("hetpipe", s) for s in SYNCS[1:]])
def test_fit_trains_the_digits_with_the_schedule_and_the_scheme_given(schedule, sync):
    strategy = HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1, num_in_flight=2,
                               schedule=schedule, sync=sync)
    train, test, model = compiled_digits(strategy)
    before_loss, _ = model.evaluate(test, verbose=0)
    before = [v.numpy() for v in model.trainable_variables]
    history = model.fit(train, epochs=1, steps_per_epoch=16, validation_data=test, verbose=0)
    assert strategy.plan.schedule.name == schedule and strategy.request.sync.name == sync
    assert {vw.pipeline_schedule.name for vw in strategy.runner.vws} == {schedule}
    assert len(strategy.runner.vws) == 2 and np.isfinite(history.history["loss"][0])
    assert max(float(np.abs(v.numpy() - b).max()) for v, b in zip(model.trainable_variables, before)) > 1e-3
    assert history.history["val_loss"][0] < before_loss  # the model ends with weights that learnt
