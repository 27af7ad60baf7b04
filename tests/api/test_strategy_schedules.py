"""HetPipeStrategy(schedule=...) in one process: fit trains the virtual workers with the
schedule it is given, and the planner planned for it."""
import numpy as np

from hetpipe_tf.api.strategy import HetPipeStrategy
from tests.helpers.strategy import Counter, compiled_digits


def test_fit_trains_with_gpipe_and_the_plan_is_gpipes():
    strategy = HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1, schedule="gpipe",
                               num_in_flight=2)
    train, test, model = compiled_digits(strategy)
    counter = Counter()
    history = model.fit(train, epochs=2, steps_per_epoch=4, validation_data=test, callbacks=[counter], verbose=0)
    assert strategy.plan.schedule.name == "gpipe"
    assert {vw.pipeline_schedule.name for vw in strategy.runner.vws} == {"gpipe"}
    assert counter.batches == 8 and len(history.history["val_accuracy"]) == 2
    # Each worker trains 2 microbatches an epoch: one GPipe minibatch of Nm = 2, one update.
    stages = [rt for vw in strategy.runner.vws for rt in vw.runtimes if rt.trainable]
    assert stages and all(rt.applied == [1, 2, 3, 4] and int(rt.optimizer.iterations.numpy()) == 2 for rt in stages)
    for v in model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), strategy.runner.servers.variables[v.path].numpy())
