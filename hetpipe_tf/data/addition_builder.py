"""The TFDS builder of ``hetpipe_addition`` (the sums of :mod:`hetpipe_tf.data.addition`), registered
with TensorFlow Datasets once this module is imported."""
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from hetpipe_tf.data.addition import NUM_TEST, NUM_TRAIN, SEQUENCE_LENGTH, VOCABULARY, examples


class HetpipeAddition(tfds.core.GeneratorBasedBuilder):
    """Sums of two 3-digit integers as token sequences: 20000 for training, 1000 held out.

    Features: ``tokens`` (``SEQUENCE_LENGTH`` token ids, the sum without its last token)
    and ``targets`` (the next token of every position, ``IGNORED`` before the answer).
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: 3-digit sums, 20000 train / 1000 test."}
    code_path = tfds.core.Path(__file__)  # as HetpipeDigits: TFDS 4.9.10 cannot work it out

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Integer addition written as tokens ('482+917=1399'), generated deterministically "
                "by hetpipe_tf: a language-model task whose metric is exact match on held-out sums."),
            features=tfds.features.FeaturesDict({
                "tokens": tfds.features.Sequence(tfds.features.ClassLabel(names=list(VOCABULARY)),
                                                 length=SEQUENCE_LENGTH),
                "targets": tfds.features.Tensor(shape=(SEQUENCE_LENGTH,), dtype=np.int32),
            }),
            supervised_keys=("tokens", "targets"),
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager  # generated: nothing to download
        return {"train": self._generate_examples(0, NUM_TRAIN),
                "test": self._generate_examples(NUM_TRAIN, NUM_TEST)}

    def _generate_examples(self, first: int, count: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        tokens, targets = examples(first, count)
        for i, (x, y) in enumerate(zip(tokens, targets)):
            yield first + i, {"tokens": x, "targets": y}
