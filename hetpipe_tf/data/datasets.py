"""The one place hetpipe_tf loads data: batched tf.data pipelines from TFDS.

Image-classification data sets and data sets of token sequences are read with
TensorFlow Datasets from a local ``data_dir``; hetpipe_tf never downloads anything
at run time. The data sets that come with the package are prepared into
``data_dir`` the first time they are used: ``hetpipe_digits`` (see
``hetpipe_tf.data.digits``) from the file shipped in the package,
``hetpipe_addition`` (see ``hetpipe_tf.data.addition``) generated. Any other data
set must already be prepared there.
"""
import dataclasses
import numbers
import os
from collections.abc import Callable
from typing import Any

import tensorflow as tf
import tensorflow_datasets as tfds

from hetpipe_tf.data import DEFAULT_DATA_DIR
from hetpipe_tf.data.addition_builder import HetpipeAddition  # registers "hetpipe_addition" with TFDS
from hetpipe_tf.data.digits import HetpipeDigits  # registers "hetpipe_digits" with TFDS
from hetpipe_tf.errors import HetPipeUsageError

SHUFFLE_BUFFER = 10_000  # most examples held (still encoded) for shuffling
PACKAGED = (HetpipeDigits.name, HetpipeAddition.name)  # prepared offline from the package


class DatasetNotFoundError(HetPipeUsageError, FileNotFoundError):
    """The data set is unknown, or not prepared in the data directory."""


class DatasetOptionError(HetPipeUsageError, ValueError):
    """A data set that cannot give what was asked: it is not of the kind asked for (image
    classification, token sequences), or has no such split, or the batch size, image size or
    channels do not suit it."""


@dataclasses.dataclass(frozen=True)
class ImageDatasetInfo:
    """What a pipeline needs to know about an image-classification data set.

    ``image_shape`` is (H, W, C) as stored; H and W are None for data sets whose
    images vary in size. ``num_examples`` maps each split name to its size.
    """
    name: str
    image_shape: tuple[int | None, ...]
    num_classes: int
    num_examples: dict[str, int]


def _not_found(name: str, data_dir: str, unknown: bool) -> DatasetNotFoundError:
    what = ("is unknown: it is not registered in TensorFlow Datasets "
            f"{tfds.__version__} and no prepared copy was found" if unknown
            else "is not prepared")
    return DatasetNotFoundError(
        f"Dataset {name!r} {what} in data_dir {data_dir!r}. hetpipe_tf never "
        "downloads data at run time. Prepare it on a machine with network access, "
        f"e.g. `tfds build {name} --data_dir {data_dir}` (then copy the "
        f"{name.split('/')[0]}/ folder over), or copy an existing "
        "tensorflow_datasets directory that holds it, and pass that directory as "
        "data_dir (or set TFDS_DATA_DIR).")


def _prepared_builder(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
    """Returns the TFDS builder of ``name``, prepared in ``data_dir``, without downloading."""
    data_dir = os.fspath(data_dir or DEFAULT_DATA_DIR)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:
        raise _not_found(name, data_dir, unknown=True) from None
    # Check the folder first: TFDS warns about a missing one.
    if builder.data_path.exists() and builder.is_prepared():
        return builder
    if builder.name not in PACKAGED:
        raise _not_found(name, data_dir, unknown=False)
    # Offline: the builder reads the file bundled with hetpipe_tf, or generates its examples.
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder


def _image_label_keys(builder: tfds.core.DatasetBuilder) -> tuple[str, str]:
    """The (image, label) feature names, checked to be an image and a class label."""
    info = builder.info
    keys = info.supervised_keys
    if (isinstance(keys, (tuple, list)) and len(keys) == 2
            and all(isinstance(k, str) for k in keys)
            and len(info.features[keys[0]].shape) == 3
            and isinstance(info.features[keys[1]], tfds.features.ClassLabel)):
        return keys
    raise DatasetOptionError(f"Dataset {builder.name!r} is not an image-classification data set: "
                             f"its supervised keys {keys!r} are not (image of shape (H, W, C), "
                             "ClassLabel)")


def _info(builder: tfds.core.DatasetBuilder) -> ImageDatasetInfo:
    image_key, label_key = _image_label_keys(builder)
    features, splits = builder.info.features, builder.info.splits
    return ImageDatasetInfo(
        name=builder.name,
        image_shape=tuple(features[image_key].shape),
        num_classes=features[label_key].num_classes,
        num_examples={split: splits[split].num_examples for split in splits})


def dataset_info(name: str, data_dir: str | None = None) -> ImageDatasetInfo:
    """Describes the image-classification data set ``name`` found in ``data_dir``.

    ``hetpipe_digits`` is prepared into ``data_dir`` on first use; any other data
    set must already be prepared there. Raises DatasetNotFoundError otherwise
    (nothing is downloaded), and DatasetOptionError if the data set is not an
    (image, class label) one.

    Returns:
        Its ImageDatasetInfo.

    Raises:
        DatasetNotFoundError: it is unknown or not prepared there.
        DatasetOptionError: it is not an (image, class label) data set.
    """
    return _info(_prepared_builder(name, data_dir))


@dataclasses.dataclass(frozen=True)
class TokenSequencesInfo:
    """What a pipeline needs to know about a data set of token sequences (language modelling):
    every example is ``sequence_length`` token ids below ``len(vocabulary)`` (``vocabulary``:
    what each id stands for) and as many targets, the next token of each position or -1 where
    it is not scored. ``num_examples`` maps each split name to its size."""
    name: str
    sequence_length: int
    vocabulary: tuple[str, ...]
    num_examples: dict[str, int]


def _token_keys(builder: tfds.core.DatasetBuilder) -> tuple[str, str]:
    """The (tokens, targets) feature names, checked to be token sequences of one length."""
    info = builder.info
    keys = info.supervised_keys
    if isinstance(keys, (tuple, list)) and len(keys) == 2 and all(isinstance(k, str) for k in keys):
        tokens, targets = info.features[keys[0]], info.features[keys[1]]
        if (isinstance(tokens, tfds.features.Sequence) and isinstance(tokens.feature, tfds.features.ClassLabel)
                and tokens.shape[0] is not None and tuple(targets.shape) == tuple(tokens.shape)):
            return keys
    raise DatasetOptionError(f"Dataset {builder.name!r} is not a data set of token sequences: its supervised "
                             f"keys {keys!r} are not (a fixed-length Sequence of ClassLabel tokens, targets of "
                             "the same shape)")


def holds_token_sequences(name: str, data_dir: str | None = None) -> bool:
    """Whether the data set ``name`` (found as ``dataset_info`` finds it) holds token sequences
    rather than images.

    Returns:
        True for token sequences, False for images.
    """
    try:
        _token_keys(_prepared_builder(name, data_dir))
    except DatasetOptionError:
        return False
    return True


def token_sequences_info(name: str, data_dir: str | None = None) -> "TokenSequencesInfo":
    """Describes the data set of token sequences ``name``, found as ``dataset_info`` finds it;
    DatasetOptionError if it does not hold token sequences.

    Returns:
        Its TokenSequencesInfo.

    Raises:
        DatasetOptionError: it does not hold token sequences.
    """
    builder = _prepared_builder(name, data_dir)
    tokens, _ = _token_keys(builder)
    feature, splits = builder.info.features[tokens], builder.info.splits
    return TokenSequencesInfo(name=builder.name, sequence_length=feature.shape[0],
                              vocabulary=tuple(feature.feature.names),
                              num_examples={split: splits[split].num_examples for split in splits})


def _checked_split_and_batch(info: "ImageDatasetInfo | TokenSequencesInfo", split: str, batch_size: int) -> int:
    if split not in info.num_examples:
        raise DatasetOptionError(f"split={split!r} does not exist in {info.name!r}; "
                                 f"allowed: {sorted(info.num_examples)}")
    size = info.num_examples[split]
    if not isinstance(batch_size, numbers.Integral) or not 0 < batch_size <= size:
        raise DatasetOptionError(f"batch_size={batch_size!r} must be an integer from 1 to {size}, "
                                 f"the number of examples in split {split!r} of {info.name!r}")
    return size


def _batched(ds: tf.data.Dataset, size: int, batch_size: int, shuffle: bool, seed: int, repeat: bool,
             prepare: Callable[..., Any]) -> tf.data.Dataset:
    """`ds` shuffled (with `seed`, anew each iteration), each example `prepare`d, batched without
    the last partial batch, repeated, prefetching.

    Returns:
        The dataset.
    """
    if shuffle:
        ds = ds.shuffle(min(size, SHUFFLE_BUFFER), seed=seed, reshuffle_each_iteration=True)
    ds = ds.map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size, drop_remainder=True)
    if repeat:
        ds = ds.repeat()
    return ds.prefetch(tf.data.AUTOTUNE)


def load_token_sequences(name: str, split: str, batch_size: int, data_dir: str | None = None, shuffle: bool = False,
                         seed: int = 0, repeat: bool = False) -> tf.data.Dataset:
    """Returns a batched, prefetching ``tf.data.Dataset`` of ``(tokens, targets)``, both int32 of
    shape (batch_size, sequence_length) (see :class:`TokenSequencesInfo`). Batching, ``shuffle``,
    ``seed`` and ``repeat`` are as for :func:`load_image_classification`."""
    builder = _prepared_builder(name, data_dir)
    info = token_sequences_info(name, data_dir)
    size = _checked_split_and_batch(info, split, batch_size)
    ds = builder.as_dataset(split=split, as_supervised=True, shuffle_files=shuffle,
                            read_config=tfds.ReadConfig(shuffle_seed=seed))
    return _batched(ds, size, batch_size, shuffle, seed, repeat,
                    lambda x, y: (tf.cast(x, tf.int32), tf.cast(y, tf.int32)))


def load_image_classification(name: str, split: str, batch_size: int, data_dir: str | None = None,
                              image_size: tuple[int, int] | None = None, channels: int | None = None,
                              shuffle: bool = False, seed: int = 0, repeat: bool = False) -> tf.data.Dataset:
    """Returns a batched, prefetching ``tf.data.Dataset`` of ``(image, label)``.

    Images are float32 in [0, 1] of shape (batch_size, H, W, C): resized to
    (image_size, image_size) when ``image_size`` is given, and converted to
    ``channels`` channels when given (1 -> 3 by tiling, 3 -> 1 by averaging).
    Labels are int32 of shape (batch_size,). The last partial batch is dropped,
    since pipelined training needs fixed batch shapes. ``shuffle`` shuffles
    files and examples with ``seed``, anew each iteration; ``repeat`` repeats
    the data set forever. Data sets are found as ``dataset_info`` finds them.

    Raises:
        DatasetNotFoundError: the data set is unknown or not prepared in ``data_dir``.
        DatasetOptionError: it is not an image-classification data set, or the split, batch size,
            image size or channels cannot be given.
    """
    builder = _prepared_builder(name, data_dir)
    info = _info(builder)
    size = _checked_split_and_batch(info, split, batch_size)
    if image_size is not None and (not isinstance(image_size, numbers.Integral)
                                   or image_size <= 0):
        raise DatasetOptionError(f"image_size={image_size!r} must be None or a positive integer")
    if channels not in (None, 1, 3):
        raise DatasetOptionError(f"channels={channels!r} is not supported; allowed: None "
                                 "(keep the stored channels), 1 or 3")
    height, width, stored = info.image_shape
    if channels not in (None, stored) and stored not in (1, 3):
        raise DatasetOptionError(f"channels={channels!r}: cannot convert the {stored} channels "
                                 f"of {info.name!r}; allowed: None")
    if image_size is None and None in (height, width):
        raise DatasetOptionError(f"{info.name!r} has images of varying size {info.image_shape}: "
                                 "give image_size so that batches have one shape")

    image_key, _ = _image_label_keys(builder)
    image_feature = builder.info.features[image_key]

    def prepare(encoded: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        image = tf.image.convert_image_dtype(image_feature.decode_example(encoded), tf.float32)
        if image_size is not None:
            image = tf.clip_by_value(tf.image.resize(image, (image_size, image_size)), 0.0, 1.0)
        if channels == 3 and stored == 1:
            image = tf.tile(image, [1, 1, 3])
        elif channels == 1 and stored == 3:
            image = tf.reduce_mean(image, axis=-1, keepdims=True)
        return image, tf.cast(label, tf.int32)

    # Images stay encoded until after the shuffle buffer, which keeps it small.
    ds = builder.as_dataset(split=split, as_supervised=True, shuffle_files=shuffle,
                            decoders={image_key: tfds.decode.SkipDecoding()},
                            read_config=tfds.ReadConfig(shuffle_seed=seed))
    return _batched(ds, size, batch_size, shuffle, seed, repeat, prepare)
