"""TFDS builder for the handwritten digits shipped inside hetpipe_tf.

The main training job and the tests need a small but real image-classification
data set that is there without a download. ``HetpipeDigits`` wraps the bundled
``digits.npz`` as a TensorFlow Datasets builder, registered under the name
``hetpipe_digits``, so that once this module is imported
``tfds.load("hetpipe_digits", data_dir=...)`` prepares and reads it offline, and
it goes through the same code path (``hetpipe_tf.data.datasets``) as any other TFDS
data set.
"""
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

NPZ_PATH = os.path.join(os.path.dirname(__file__), "digits.npz")
NUM_TRAIN = 1437  # the last 360 of the 1797 examples are the test split


class HetpipeDigits(tfds.core.GeneratorBasedBuilder):
    """UCI Optical Recognition of Handwritten Digits, 8x8 grey-scale, 10 classes.

    Data: the 1797 images of scikit-learn's ``load_digits()`` (the test part of
    the UCI "Optical Recognition of Handwritten Digits" data set, E. Alpaydin and
    C. Kaynak, 1998, UCI Machine Learning Repository,
    https://doi.org/10.24432/C50P49), licensed under CC BY 4.0. They are bundled
    as ``digits.npz`` (``images`` uint8 (1797, 8, 8) with values 0..16,
    ``labels`` uint8 (1797,) with values 0..9); nothing is downloaded.

    Pixel values 0..16 are scaled to 0..255 by multiplying by 16 and clipping to
    255, so that the ``Image`` feature holds ordinary uint8 images.

    Splits are fixed and deterministic: ``train`` is the first 1437 examples,
    ``test`` the last 360.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: bundled UCI digits, 1437 train / 360 test."}
    # TFDS 4.9.10 works this path out with `importlib_resources`, which it only
    # installs for Python < 3.9; give it directly (no checksums file lives there).
    code_path = tfds.core.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "8x8 grey-scale images of handwritten digits 0-9 (UCI Optical "
                "Recognition of Handwritten Digits, as shipped by scikit-learn), "
                "bundled with hetpipe_tf so that training needs no download."),
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(8, 8, 1)),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80/"
                     "optical+recognition+of+handwritten+digits",
            citation="""@misc{alpaydin1998digits,
  author       = {Alpaydin, E. and Kaynak, C.},
  title        = {Optical Recognition of Handwritten Digits},
  year         = {1998},
  howpublished = {UCI Machine Learning Repository},
  note         = {DOI: https://doi.org/10.24432/C50P49}
}""",
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager  # the data is bundled: nothing to download
        with np.load(NPZ_PATH) as data:
            images, labels = data["images"], data["labels"]
        images = np.minimum(images.astype(np.int32) * 16, 255).astype(np.uint8)[..., None]
        return {
            "train": self._generate_examples(images[:NUM_TRAIN], labels[:NUM_TRAIN], 0),
            "test": self._generate_examples(images[NUM_TRAIN:], labels[NUM_TRAIN:], NUM_TRAIN),
        }

    def _generate_examples(self, images: np.ndarray, labels: np.ndarray, first_index: int
                           ) -> Iterator[tuple[int, dict[str, Any]]]:
        for i, (image, label) in enumerate(zip(images, labels)):
            yield first_index + i, {"image": image, "label": int(label)}
