"""Tests of the generated hetpipe_addition data set, its metric and its greedy decoding (offline,
as conftest.py makes sure)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from hetpipe_tf.data import addition, datasets

NAME = "hetpipe_addition"  # as TFDS registers the builder: addition.NAME


def _operands(tokens):
    """(a, b) of each sum's prompt (numpy or TensorFlow tokens)."""
    def value(first):
        return sum(tokens[:, first + i] * 10 ** (addition.DIGITS - 1 - i) for i in range(addition.DIGITS))
    return value(0), value(addition.DIGITS + 1)


def test_examples_are_sums_written_as_tokens_and_deterministic():
    tokens, targets = addition.examples(0, 200)
    again, _ = addition.examples(0, 200)
    np.testing.assert_array_equal(tokens, again)
    assert tokens.shape == targets.shape == (200, addition.SEQUENCE_LENGTH)
    a, b = _operands(tokens)
    for x, y, first, second in zip(tokens, targets, a, b):
        sum_text = addition.text(np.append(x, y[-1]))
        assert sum_text == f"{first:03d}+{second:03d}={first + second:04d}"
        assert list(y[:addition.PROMPT_LENGTH - 1]) == [addition.IGNORED] * (addition.PROMPT_LENGTH - 1)
        np.testing.assert_array_equal(y[:-1][addition.PROMPT_LENGTH - 1:], x[addition.PROMPT_LENGTH:])


def test_the_held_out_sums_are_not_trained_on():
    train, _ = addition.examples(0, addition.NUM_TRAIN)
    test, _ = addition.examples(addition.NUM_TRAIN, addition.NUM_TEST)
    def prompts(t):
        return {bytes(row) for row in t[:, :addition.PROMPT_LENGTH]}
    assert len(prompts(train)) == addition.NUM_TRAIN and len(prompts(test)) == addition.NUM_TEST
    assert not prompts(train) & prompts(test)


def test_tfds_prepares_it_offline_and_loads_batches(data_dir):
    assert addition.NAME == NAME  # the name TFDS gave the builder
    info = datasets.token_sequences_info(NAME, data_dir)
    assert info == datasets.TokenSequencesInfo(name=NAME, sequence_length=addition.SEQUENCE_LENGTH,
                                               vocabulary=addition.VOCABULARY,
                                               num_examples={"train": addition.NUM_TRAIN, "test": addition.NUM_TEST})
    assert datasets.holds_token_sequences(NAME, data_dir) and not datasets.holds_token_sequences("hetpipe_digits",
                                                                                                data_dir)
    (x, y), = datasets.load_token_sequences(NAME, "test", addition.NUM_TEST, data_dir=data_dir)
    assert x.dtype == y.dtype == tf.int32 and x.shape == (addition.NUM_TEST, addition.SEQUENCE_LENGTH)
    want, _ = addition.examples(addition.NUM_TRAIN, addition.NUM_TEST)
    assert sorted(map(bytes, x.numpy())) == sorted(map(bytes, want))
    with pytest.raises(datasets.DatasetOptionError, match="not an image-classification data set"):
        datasets.dataset_info(NAME, data_dir)
    with pytest.raises(datasets.DatasetOptionError, match="not a data set of token sequences"):
        datasets.token_sequences_info("hetpipe_digits", data_dir)
    with pytest.raises(datasets.DatasetOptionError, match="batch_size=0"):
        datasets.load_token_sequences(NAME, "train", 0, data_dir=data_dir)


def _oracle(tokens, training=False):
    """Logits that read the sum off the prompt, one too high where the first operand is 5xx: a
    causal model (every position sees only the tokens up to it) that is right on most sums."""
    del training
    t = tf.cast(tokens, tf.int32)
    a, b = _operands(t)
    wrong = tf.cast(tf.equal(t[:, 0], 5), tf.int32)
    c = a + b + wrong
    digits = tf.stack([(c // 10 ** (addition.ANSWER_LENGTH - 1 - i)) % 10 for i in range(addition.ANSWER_LENGTH)], 1)
    prompt = tf.zeros((tf.shape(t)[0], addition.PROMPT_LENGTH - 1, len(addition.VOCABULARY)))
    return tf.concat([prompt, tf.one_hot(digits, len(addition.VOCABULARY))], axis=1)


def test_exact_match_is_greedy_decodings_and_the_answers_say_which_are_right():
    tokens, targets = addition.examples(addition.NUM_TRAIN, 300)
    per_sum = addition.exact_match(tf.constant(targets), _oracle(tf.constant(tokens))).numpy()
    expected = np.asarray(targets)[:, addition.PROMPT_LENGTH - 1:]
    greedy = np.all(addition.greedy_answers(_oracle, tokens) == expected, axis=1)
    np.testing.assert_array_equal(per_sum, greedy.astype(np.float32))
    np.testing.assert_array_equal(greedy, tokens[:, 0] != 5)
    assert 0 < per_sum.mean() < 1
    lines = addition.answer_lines(_oracle, tokens[:40], targets[:40])
    for line, x in zip(lines, tokens[:40]):
        a, b = _operands(x[None])
        if x[0] == 5:
            assert line == f"{a[0]:03d}+{b[0]:03d}={a[0] + b[0] + 1:04d} (wrong, {a[0] + b[0]:04d} expected)"
        else:
            assert line == f"{a[0]:03d}+{b[0]:03d}={a[0] + b[0]:04d} (right)"


def test_the_metric_is_found_by_name_where_a_compile_config_is_rebuilt():
    # A worker process rebuilds the chief's compile config: the metric must come back by name.
    # (The baselines load this module's file again under another name, which registers its own copy.)
    found = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(addition.exact_match))
    assert found.__name__ == "exact_match"
    tokens, targets = addition.examples(addition.NUM_TRAIN, 4)
    predicted = np.where(targets == addition.IGNORED, 0, targets)
    predicted[0, -1] = (predicted[0, -1] + 1) % 10  # the first sum's last answer digit wrong
    np.testing.assert_array_equal(found(targets, tf.one_hot(predicted, len(addition.VOCABULARY))), [0, 1, 1, 1])
