"""What today's training recipe costs a pipelined virtual worker, side by side in one run (JSON lines).

One emulated virtual worker of four devices of equal speed, Nm = 4 (HetPipe's schedule), training
the ``gpt`` model of ``hetpipe-train`` (a decoder-only transformer, `--blocks` blocks of width
`--width`) on sums of ``hetpipe_addition``, under four recipes:

* ``sgd``: SGD with momentum;
* ``adamw``: AdamW;
* ``adamw_global_clipnorm``: AdamW with ``global_clipnorm`` (every stage's update of a minibatch
  waits for the first stage's clip factor: ``hetpipe_tf.runtime.update_terms``);
* ``adamw_global_clipnorm_bf16``: the same under the ``mixed_bfloat16`` policy (activations and
  gradients cross the cuts in bfloat16; weights stay float32).

Each recipe's worker is built and its stages' solo times measured once; one dilation (the
largest any worker's calibration asks for) paces them all, so that the emulated devices are the
same for every row; then the recipes run interleaved, round after round, and each figure is the
median over the rounds. Per row: tokens per second, its ratio to ``adamw``'s, the bytes each
cut carries per minibatch (what the stages' Send instructions handed on, also in a trace's span
arguments) and its ratio to ``adamw``'s, and the emulation's overrun fraction (faithful below
5 %). Targets: global clipnorm costs <= 3 % of AdamW's throughput at Nm >= k; bfloat16
halves the bytes crossing a cut.

    python benchmarks/recipe_overhead.py [--rounds=5] [--steps=48]
"""
import argparse
import json
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEVICES = "1,1,1,1"
RECIPES = ("sgd", "adamw", "adamw_global_clipnorm", "adamw_global_clipnorm_bf16")
FAITHFUL = 0.05


def _emit(**fields):
    print(json.dumps({"benchmark": "recipe_overhead", **fields}), flush=True)


def _optimizer(keras, recipe):
    if recipe == "sgd":
        return keras.optimizers.SGD(0.01, momentum=0.9)
    return keras.optimizers.AdamW(1e-3, global_clipnorm=1.0 if "global_clipnorm" in recipe else None)


def _worker(recipe, args, dilation=None, references=None):
    import keras

    from hetpipe_tf.cli.models import gpt
    from hetpipe_tf.data import addition
    from hetpipe_tf.runtime.virtual_worker import VirtualWorker

    keras.config.set_dtype_policy("mixed_bfloat16" if recipe.endswith("bf16") else "float32")
    try:
        keras.utils.set_random_seed(0)
        model = gpt(addition.SEQUENCE_LENGTH, len(addition.VOCABULARY), width=args.width, blocks=args.blocks)
        return VirtualWorker(model, DEVICES, num_in_flight=4, optimizer=_optimizer(keras, recipe),
                             loss=addition.loss(), dilation=dilation, references=references, timeout_s=600)
    finally:
        keras.config.set_dtype_policy("float32")


def _pairs(references):
    """(forward, backward) seconds per stage, as a worker takes them, from its measured references."""
    from hetpipe_tf.pipeline.instructions import Backward, Forward

    return [(r[Forward], r[Backward]) for r in references]


def _batches(args):
    from hetpipe_tf.data import addition

    tokens, targets = addition.examples(0, args.steps * args.batch_size)
    return [(tokens[i:i + args.batch_size], targets[i:i + args.batch_size])
            for i in range(0, len(tokens), args.batch_size)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()

    from hetpipe_tf.data import addition

    data = _batches(args)
    # Each recipe's stages timed alone, and the dilation each one's calibration asks for.
    probes = {r: _worker(r, args) for r in RECIPES}
    for vw in probes.values():
        vw.prepare(*data[0])
        vw.calibrate_dilation(data[0])
    dilation = max(vw.dilation.value for vw in probes.values())
    workers = {r: _worker(r, args, dilation=dilation, references=_pairs(probes[r].references)) for r in RECIPES}
    rows = {r: [] for r in RECIPES}
    for _ in range(args.rounds):
        for r, vw in workers.items():
            report = vw.train(iter(data), len(data))
            emulation = report.emulation
            rows[r].append({"tokens_per_s": report.minibatches_per_s * args.batch_size * addition.SEQUENCE_LENGTH,
                            "bytes_per_cut": sum(s.sent_bytes for s in report.stages) / len(data) / (len(report.stages) - 1),
                            "overrun_fraction": emulation.overrun_fraction if emulation else None})
    median = {r: {k: statistics.median(x[k] for x in rows[r]) for k in ("tokens_per_s", "bytes_per_cut")}
              for r in RECIPES}
    for r in RECIPES:
        overrun = max(x["overrun_fraction"] for x in rows[r])
        _emit(recipe=r, devices=DEVICES, num_in_flight=4, dilation=round(dilation, 3), emulated=True,
              tokens_per_s=round(median[r]["tokens_per_s"], 1),
              throughput_vs_adamw=round(median[r]["tokens_per_s"] / median["adamw"]["tokens_per_s"], 3),
              bytes_per_cut_per_minibatch=round(median[r]["bytes_per_cut"]),
              bytes_vs_adamw=round(median[r]["bytes_per_cut"] / median["adamw"]["bytes_per_cut"], 3),
              overrun_fraction=round(overrun, 4), faithful=overrun < FAITHFUL,
              rounds=args.rounds, steps=len(data), width=args.width, blocks=args.blocks)


if __name__ == "__main__":
    main()
