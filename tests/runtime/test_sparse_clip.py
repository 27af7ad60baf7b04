"""A clip by the global norm where an embedding's gradient is a ``tf.IndexedSlices`` whose batch
repeats ids: every stage counts it as Keras's ``clip_by_global_norm`` does, by its rows as they are."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.runtime.run_config import RunConfig, WorkerSpec
from hetpipe_tf.runtime.virtual_worker import VirtualWorker
from hetpipe_tf.runtime.wsp_runner import WSPRunner

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS, BATCH, LENGTH, VOCABULARY = 5, 8, 6, 7
CLIPNORM = 0.05


def _model(scale=1.0):
    """An embedding (its batch repeats ids: 48 lookups of 7 ids) pooled into a classifier; every
    initial weight multiplied by `scale`."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((LENGTH,), dtype="int32"),
                              keras.layers.Embedding(VOCABULARY, 8, name="embed"),
                              keras.layers.GlobalAveragePooling1D(name="pool"),
                              keras.layers.Dense(16, activation="tanh", name="hidden"),
                              keras.layers.Dense(3, name="out")], name="bag_of_ids")
    for v in model.weights:
        v.assign(v.numpy() * scale)
    return model


def _batches(seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCABULARY, size=(BATCH, LENGTH)).astype("int32"), rng.integers(0, 3, size=BATCH))
            for _ in range(STEPS)]


def _optimizer():
    return keras.optimizers.Adam(1e-3, global_clipnorm=CLIPNORM)


def _keras_fit(batches, scale=1.0):
    """The weights after Keras's own fit of `batches`, one step each, in order."""
    model = _model(scale)
    model.compile(optimizer=_optimizer(), loss=LOSS, jit_compile=False)
    x, y = (np.concatenate(part) for part in zip(*batches))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return [v.numpy() for v in model.weights]


def _max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def _keras_factors(x, y):
    """(Keras's clip factor for minibatch (x, y) at the initial weights, the factor were the
    embedding's gradient counted by its summed dense value)."""
    model = _model()
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)  # the embedding's
    sparse = float(tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g.values if isinstance(g, tf.IndexedSlices) else g))
                                      for g in grads])))
    dense = float(tf.linalg.global_norm([tf.convert_to_tensor(g) for g in grads]))
    return min(1.0, CLIPNORM / sparse), min(1.0, CLIPNORM / dense)


@pytest.fixture(scope="module")
def keras_run():
    """Keras's weights after the fit, and how far Keras itself moves when its initial weights are
    scaled by 1 + 1e-7 (the tolerance is ten times that)."""
    want = _keras_fit(_batches())
    sensitivity = _max_difference(want, _keras_fit(_batches(), scale=1 + 1e-7))
    return want, 10 * sensitivity


def test_the_data_repeat_ids_so_the_two_ways_of_counting_differ():
    x, y = _batches()[0]
    sparse, dense = _keras_factors(x, y)
    assert sparse < 1.0 and abs(sparse - dense) > 1e-3 * sparse


@pytest.mark.parametrize("k", [1, 2])
def test_global_clipnorm_with_repeated_ids_equals_keras_fit_at_nm1(k, keras_run):
    want, tolerance = keras_run
    model = _model()
    vw = VirtualWorker(model, ",".join(["cpu"] * k), num_in_flight=1, optimizer=_optimizer(), loss=LOSS,
                       timeout_s=60, references=[(1.0, 1.0)] * k, boundaries=(0, 1) if k > 1 else None)
    vw.train(iter(_batches()), STEPS)
    assert [len(rt.trainable) for rt in vw.runtimes] == [[5], [1, 4]][k - 1]  # cut: the embedding alone on stage 0
    assert _max_difference([v.numpy() for v in model.weights], want) < tolerance


def test_under_wsp_every_worker_clips_its_first_minibatch_by_keras_factor():
    """Two virtual workers of two stages each: a worker's first minibatch runs at the initial
    weights (Nm = 1), so its clip factor, the same on both stages, is Keras's for that minibatch."""
    data = [_batches(seed=w) for w in range(2)]
    config = RunConfig(num_in_flight=1, staleness_bound=0, optimizer=_optimizer(), loss=LOSS, timeout_s=60,
                       record_provenance=True)
    workers = [WorkerSpec("cpu,cpu", boundaries=(0, 1), references=((1.0, 1.0),) * 2) for _ in data]
    runner = WSPRunner(_model(), workers, config, ["/cpu:0"])
    runner.train([iter(d) for d in data], STEPS)
    for vw, batches in zip(runner.vws, data):
        want, _ = _keras_factors(*batches[0])
        for rt in vw.runtimes:
            assert sorted(rt.applied_terms) == list(range(1, STEPS + 1))
            np.testing.assert_allclose(float(rt.applied_terms[1][0]), want, rtol=1e-6)


def test_a_keras_hub_gpt2_graph_clipped_across_three_stages_equals_keras():
    """The GPT-2 backbone's token embedding (its ids repeat in a batch of 4 x 8 from 24) under an
    untied head; the tolerance is ten times Keras's own sensitivity."""
    from tests.helpers.data import gpt2_batches
    from tests.helpers.models import gpt2_backbone_as_layer

    def make(scale=1.0):
        keras.utils.set_random_seed(8)
        model = gpt2_backbone_as_layer()
        for v in model.weights:
            v.assign(v.numpy() * scale)
        return model

    data = gpt2_batches(STEPS)

    def keras_trained(scale=1.0):
        model = make(scale)
        model.compile(optimizer=_optimizer(), loss=LOSS, jit_compile=False)
        for x, y in data:
            model.train_on_batch(x, y)
        return [v.numpy() for v in model.weights]

    want = keras_trained()
    tolerance = 10 * _max_difference(want, keras_trained(1 + 1e-7))
    model = make()
    VirtualWorker(model, "cpu,cpu,cpu", num_in_flight=1, optimizer=_optimizer(), loss=LOSS, timeout_s=60,
                  references=[(1.0, 1.0)] * 3).train(iter(data), STEPS)
    assert _max_difference([v.numpy() for v in model.weights], want) < tolerance
