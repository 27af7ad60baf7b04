"""A fit lets go of its tf.data iterators when it ends: each ends then, in the fit's thread. Left
in reference cycles, an iterator would end whenever Python's garbage collector next ran, in
whatever thread, which waits there for the iterator's threads (stalls of seconds were seen in a
stage's first trace). A failed fit's runner lets go of them too; its exception's traceback holds
the frames that used them, as any Python exception does, until it is dropped."""
import gc

import keras
import pytest

from hetpipe_tf.runtime.fit_loop import FitOptions, fit
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from tests.helpers import models
from tests.helpers.data import mlp_dataset
from tests.helpers.models import LOSS
from tests.helpers.runners import wsp_runner


def _iterators():
    return {id(o) for o in gc.get_objects() if type(o).__name__ == "OwnedIterator"}


def _iterators_left_by(run):
    """The tf.data iterators alive after `run()` that were not before, the garbage collector off
    meanwhile (an iterator in a reference cycle stays alive)."""
    gc.collect()
    before = _iterators()
    gc.disable()
    try:
        run()
        return _iterators() - before
    finally:
        gc.enable()


class _FailAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise RuntimeError("a callback failed")


def _runner():
    model = models.mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=LOSS)
    return wsp_runner(model, ["1,1", "1,1"], nm=2, d=0, loss=LOSS)


def test_a_fit_of_several_workers_leaves_no_iterator_alive():
    runner = _runner()
    options = FitOptions(epochs=2, steps_per_epoch=4, verbose=0)
    assert _iterators_left_by(lambda: fit(runner, mlp_dataset(4).repeat(), options)) == set()


def test_a_failed_fits_runner_lets_go_of_its_iterators():
    runner = _runner()
    with pytest.raises(RuntimeError, match="a callback failed"):
        fit(runner, mlp_dataset(4).repeat(), FitOptions(epochs=2, steps_per_epoch=4, verbose=0, callbacks=[_FailAt()]))
    assert runner.fit_data() == []


def test_a_fit_of_one_worker_leaves_no_iterator_alive():
    model = models.mlp()
    vw = VirtualWorker(model, "1,0.5", num_in_flight=2, optimizer=keras.optimizers.SGD(0.1), loss=LOSS, timeout_s=60)
    assert _iterators_left_by(lambda: vw.fit(mlp_dataset(4), epochs=2, verbose=0)) == set()
