"""The baselines' data, model need and pacing (benchmarks/baselines/training.py), in one process."""
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.baselines import ranks, training
from hetpipe_tf.data import datasets, digits


def test_digits_are_read_as_hetpipe_tf_reads_them(tmp_path):
    x_train, y_train, x_test, y_test = training.load_digits()
    assert training.NUM_TRAIN == digits.NUM_TRAIN and (len(x_train), len(x_test)) == (1437, 360)
    (x, y), = datasets.load_image_classification("hetpipe_digits", "test", 360, data_dir=tmp_path)

    def rows(images, labels):  # TFDS reads the examples in another order: compare them sorted
        table = np.concatenate([labels[:, None], images.reshape(len(images), -1)], axis=1)
        return table[np.lexsort(table.T[::-1])]

    np.testing.assert_allclose(rows(x.numpy(), y.numpy()), rows(x_test, y_test), rtol=1e-6)


def test_the_cnn_needs_its_weights_twice_its_state_and_one_minibatch_of_activations():
    model = training.build_model()
    need = training.model_need(model, batch_size=32)
    weights = sum(int(np.prod(w.shape)) for w in model.trainable_weights) * 4
    assert need["weights"] == need["gradients"] == weights and need["optimizer slots"] == 0
    # six blocks of conv, BN and ReLU outputs of 8x8x32 floats dominate the activations
    assert 6 * 3 * 8 * 8 * 32 * 32 * 4 < need["activations"] < 1.1 * 6 * 3 * 8 * 8 * 32 * 32 * 4
    total = sum(need.values())
    assert ranks.admit((total, total - 1), need)[0] == [0]


def test_steps_per_epoch_fit_the_smallest_shard():
    import argparse
    a = ranks.check(ranks.add_arguments(argparse.ArgumentParser()).parse_args(["--steps_per_epoch=12"]))
    assert training.steps_per_epoch(a, 3) == 12  # 479 examples a rank: 14 minibatches of 32
    with pytest.raises(ranks.BaselineOptionError, match=r"--steps_per_epoch=12 exceeds the 11 full minibatches"):
        training.steps_per_epoch(a, 4)


def test_a_paced_step_of_speed_half_takes_twice_its_reference():
    keras.utils.set_random_seed(0)
    model = training.build_model()
    optimizer = keras.optimizers.SGD(0.1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y, _, _ = training.load_digits()
    batch = (tf.constant(x[:32]), tf.constant(y[:32]))

    @tf.function
    def compute(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return tape.gradient(value, model.trainable_variables)

    applied_at = []

    def apply(gradients):  # the real update; when it starts is the end of the paced compute
        applied_at.append(time.perf_counter())
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    reference = training.solo_reference(compute, batch)
    pacer = ranks.emulation.Pacer(speed=0.5, dilation=1.0)
    ratios = []
    for _ in range(10):
        started = time.perf_counter()
        training.paced_step(compute, apply, batch, pacer, reference)
        ratios.append((applied_at[-1] - started) / reference)
    assert 2.0 <= min(ratios), ratios  # padded, never cut short
    # An overrun (the compute itself took longer than its target) only ever lengthens a step.
    assert pacer.tasks == 10 and pacer.overran <= sum(r > 2.0 for r in ratios), (pacer.overran, ratios)


def test_the_gpt_baseline_trains_hetpipes_gpt_on_the_generated_sums_with_their_loss_and_metric():
    from hetpipe_tf.cli.models import build_model
    from hetpipe_tf.data import addition

    x, y, x_test, y_test = training.load_data("gpt")
    want, targets = addition.examples(0, addition.NUM_TRAIN)
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, targets)
    assert len(x_test) == addition.NUM_TEST and training.tokens_per_example("gpt") == addition.SEQUENCE_LENGTH
    model = training.build_model("gpt")
    assert model.count_params() == build_model("gpt", (addition.SEQUENCE_LENGTH,), len(addition.VOCABULARY)).count_params()
    # Only the answer's tokens are scored: logits that favour every ignored target change nothing.
    logits = np.zeros((2, addition.SEQUENCE_LENGTH, len(addition.VOCABULARY)), "float32")
    scored = float(training.loss("gpt")(y_test[:2], logits))
    logits[:, :addition.PROMPT_LENGTH - 1, 3] = 50.0
    assert abs(float(training.loss("gpt")(y_test[:2], logits)) - scored) < 1e-6
