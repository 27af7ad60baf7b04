"""Tests of hetpipe_tf.data.datasets and the bundled hetpipe_digits builder.

Everything here must work offline: a guard (conftest.py) makes any socket
connection or DNS look-up fail the test, and the data directories are checked
to hold no downloaded files.
"""
import os
import re

import numpy as np
import pytest
import tensorflow_datasets as tfds

from hetpipe_tf.data import datasets
from hetpipe_tf.data import digits

DIGITS = "hetpipe_digits"
BATCH = 32


def _all(split, data_dir, **kwargs):
    """One batch holding the whole split, as numpy arrays."""
    size = datasets.dataset_info(DIGITS, data_dir).num_examples[split]
    (x, y), = datasets.load_image_classification(DIGITS, split, size, data_dir=data_dir, **kwargs)
    return x.numpy(), y.numpy()


def test_dataset_info(data_dir):
    info = datasets.dataset_info(DIGITS, data_dir)
    assert info == datasets.ImageDatasetInfo(
        name=DIGITS, image_shape=(8, 8, 1), num_classes=10,
        num_examples={"train": 1437, "test": 360})


@pytest.mark.parametrize("split, size", [("train", 1437), ("test", 360)])
def test_load_digits(data_dir, split, size):
    ds = datasets.load_image_classification(DIGITS, split, BATCH, data_dir=data_dir)
    batches = list(ds)
    assert len(batches) == size // BATCH
    labels = []
    for x, y in batches:
        assert x.shape == (BATCH, 8, 8, 1) and x.dtype.name == "float32"
        assert y.shape == (BATCH,) and y.dtype.name == "int32"
        assert 0.0 <= float(np.min(x)) and float(np.max(x)) <= 1.0
        labels.append(y.numpy())
    assert float(max(np.max(x) for x, _ in batches)) == 1.0  # 16 -> 255 -> 1.0
    labels = np.concatenate(labels)
    assert labels.min() >= 0 and labels.max() <= 9
    assert set(labels.tolist()) == set(range(10))


def test_split_is_the_bundled_data_disjoint(data_dir):
    with np.load(digits.NPZ_PATH) as npz:
        images, labels = npz["images"], npz["labels"]
    expected = np.minimum(images.astype(np.float32) * 16, 255) / 255

    def as_set(x, y):
        return sorted((label, image.round(4).tobytes()) for image, label in zip(x, y))

    train, test = _all("train", data_dir), _all("test", data_dir)
    assert as_set(*train) == as_set(expected[:1437, ..., None], labels[:1437])
    assert as_set(*test) == as_set(expected[1437:, ..., None], labels[1437:])
    assert not set(as_set(*train)) & set(as_set(*test))


def test_deterministic(data_dir):
    def first(**kwargs):
        ds = datasets.load_image_classification(DIGITS, "train", BATCH, data_dir=data_dir, **kwargs)
        x, y = next(iter(ds))
        return x.numpy(), y.numpy()

    for a, b in zip(first(), first()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(first(shuffle=True, seed=3), first(shuffle=True, seed=3)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first(shuffle=True, seed=3)[0], first()[0])


def test_shuffle_reshuffles_each_epoch_and_repeat(data_dir):
    ds = datasets.load_image_classification(DIGITS, "test", 360, data_dir=data_dir,
                                            shuffle=True, seed=1)
    (_, y1), = ds
    (_, y2), = ds
    assert not np.array_equal(y1, y2)
    np.testing.assert_array_equal(np.sort(y1), np.sort(y2))
    repeated = datasets.load_image_classification(DIGITS, "test", BATCH, data_dir=data_dir,
                                                  repeat=True)
    assert len(list(repeated.take(3 * (360 // BATCH)))) == 3 * (360 // BATCH)


def test_tfds_load_after_import(data_dir):
    datasets.dataset_info(DIGITS, data_dir)  # prepared
    ds = tfds.load(DIGITS, split="test", data_dir=os.fspath(data_dir))
    example = next(iter(ds))
    assert example["image"].shape == (8, 8, 1) and example["image"].dtype.name == "uint8"
    assert 0 <= int(example["label"]) <= 9
    assert ds.cardinality().numpy() == 360


def test_resize_and_channels(data_dir):
    ds = datasets.load_image_classification(DIGITS, "test", BATCH, data_dir=data_dir,
                                            image_size=32, channels=3)
    x, y = next(iter(ds))
    assert x.shape == (BATCH, 32, 32, 3) and x.dtype.name == "float32"
    assert 0.0 <= float(np.min(x)) and float(np.max(x)) <= 1.0
    x = x.numpy()
    np.testing.assert_array_equal(x[..., 0], x[..., 1])
    np.testing.assert_array_equal(x[..., 0], x[..., 2])
    ds = datasets.load_image_classification(DIGITS, "test", BATCH, data_dir=data_dir, channels=1)
    assert next(iter(ds))[0].shape == (BATCH, 8, 8, 1)


def test_dataset_not_in_data_dir(tmp_path):
    with pytest.raises(datasets.DatasetNotFoundError) as err:
        datasets.load_image_classification("mnist", "train", BATCH, data_dir=tmp_path)
    message = str(err.value)
    assert "mnist" in message and str(tmp_path) in message
    assert "never downloads" in message and "tfds build mnist" in message
    assert isinstance(err.value, FileNotFoundError)
    assert list(tmp_path.iterdir()) == []  # nothing downloaded or created


def test_unknown_dataset(tmp_path):
    with pytest.raises(datasets.DatasetNotFoundError, match="no_such_dataset_xyz.*unknown"):
        datasets.dataset_info("no_such_dataset_xyz", data_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, offending", [
    ({"batch_size": 0}, "batch_size=0"),
    ({"batch_size": 1438}, "batch_size=1438"),
    ({"channels": 2}, "channels=2"),
    ({"split": "nope"}, "split='nope'"),
    ({"image_size": -4}, "image_size=-4"),
])
def test_bad_arguments(data_dir, kwargs, offending):
    args = {"split": "train", "batch_size": BATCH, **kwargs}
    with pytest.raises(ValueError, match=re.escape(offending)):
        datasets.load_image_classification(DIGITS, data_dir=data_dir, **args)
