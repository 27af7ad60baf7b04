"""The training binary's models for token sequences: the zoo's gpt."""
import numpy as np
import pytest

from hetpipe_tf.cli import models
from hetpipe_tf.runtime.stage_rewrite import split_model


def test_gpt_is_a_causal_language_model_cut_between_its_layers():
    model = models.build_model("gpt", (11,), 12)
    x = np.random.default_rng(0).integers(0, 12, size=(3, 11)).astype("int32")
    logits = np.asarray(model(x))
    assert logits.shape == (3, 11, 12)
    changed = x.copy()
    changed[:, 7:] = (changed[:, 7:] + 1) % 12
    again = np.asarray(model(changed))
    np.testing.assert_allclose(again[:, :7], logits[:, :7], atol=1e-6)  # a position sees no later token
    assert not np.allclose(again[:, 7:], logits[:, 7:])
    staged = split_model(model, num_stages=4)
    kinds = [n.kind for n in staged.graph.nodes]
    assert kinds.count("MultiHeadAttention") == 2 and kinds.count("LayerNormalization") == 5
    assert staged.num_stages == 4 and not staged.tied


def test_a_model_given_the_other_kind_of_input_is_refused():
    with pytest.raises(models.ModelInputError, match=r"gpt takes token sequences, not inputs of shape \(8, 8, 1\)"):
        models.build_model("gpt", (8, 8, 1), 10)
    with pytest.raises(models.ModelInputError, match=r"cnn takes images, not inputs of shape \(11,\)"):
        models.build_model("cnn", (11,), 12)
