"""HetPipeStrategy(schedule="hetpipe-taylor") in one process: fit trains the virtual workers under
WSP with TaylorPipe's compensation (seed 003) before every update, and the plan is that schedule's."""
import numpy as np

from hetpipe_tf.api.strategy import HetPipeStrategy
from tests.helpers.strategy import Counter, compiled_digits


def test_fit_trains_with_the_compensation_inside_wsp():
    strategy = HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1,
                               schedule="hetpipe-taylor", num_in_flight=2)
    train, test, model = compiled_digits(strategy)
    counter = Counter()
    history = model.fit(train, epochs=2, steps_per_epoch=4, validation_data=test, callbacks=[counter], verbose=0)
    assert strategy.plan.schedule.name == "hetpipe-taylor"
    assert {vw.pipeline_schedule.variance_control for vw in strategy.runner.vws} == {2.0}
    assert counter.batches == 8 and np.isfinite(history.history["loss"]).all()
    stages = [rt for vw in strategy.runner.vws for rt in vw.runtimes if rt.trainable]
    assert stages and all(rt.applied == [1, 2, 3, 4] for rt in stages)
    for v in model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), strategy.runner.servers.variables[v.path].numpy())
