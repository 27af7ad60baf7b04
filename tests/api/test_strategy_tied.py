"""keras_hub's GPT2CausalLM (its token embedding used again, reversed, for the logits) planned and
trained by HetPipeStrategy: no cut keeps the embedding's two calls together, so the planner
replicates it on the first and last stages, says so, and the replicas end equal."""
import keras
import numpy as np
import tensorflow as tf

from hetpipe_tf import HetPipeStrategy
from tests.helpers.data import gpt2_batches
from tests.helpers.models import gpt2_causal_lm


def test_gpt2_causal_lm_is_planned_with_its_tied_embedding_replicated_and_trains():
    strategy = HetPipeStrategy(cluster="local", policy="ed", vw_size=2, num_in_flight=2, launch="in_process",
                               dilation=1.0, timeout_s=120)
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = gpt2_causal_lm()
        model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = gpt2_batches(8)
    x = {k: np.concatenate([b[0][k] for b in batches]) for k in ("token_ids", "padding_mask")}
    data = tf.data.Dataset.from_tensor_slices((x, np.concatenate([b[1] for b in batches]))).batch(4, drop_remainder=True)
    history = model.fit(data, epochs=1, verbose=0)
    # keras_hub's compile adds a weighted accuracy: without sample weights, the accuracy.
    assert np.isfinite(history.history["loss"][0]) and 0 <= history.history["sparse_categorical_accuracy"][0] <= 1
    plan = strategy.plan
    stages = plan.to_dict()["virtual_workers"][0]["stages"]
    # Whatever the measured profile, every two-stage cut separates the embedding's calls.
    (first,), (last,) = [s["replicas"] for s in stages]
    assert first == last and first.endswith("/token_embedding")
    assert "replicated on worker 0's stages 0, 1" in plan.notes[-1]
    # The replicas' gradients were summed before either applied: both stages hold the same table,
    # up to float rounding (each stage applies with its own kernels, which the measured plan sets).
    runtimes = strategy.runner.vws[0].runtimes
    tables = [v.numpy() for rt in runtimes for v in rt.trainable if v.path.endswith("token_embedding/embeddings")]
    assert len(tables) == 2
    np.testing.assert_allclose(tables[0], tables[1], rtol=0, atol=1e-6)
