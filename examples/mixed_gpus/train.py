"""Mixed GPUs of one machine as a HetPipe cluster: two TITAN V and two RTX 2060 (cluster.json here).

NOT RUN BY CI: it needs the GPUs cluster.json names (CI machines have none; the tests only check that
cluster.json loads and maps onto a fake listing of such a machine). Edit cluster.json to your GPUs
first: `python -m hetpipe_tf.distributed.gpus` prints what TensorFlow lists here (the indices
"gpus" names), and `python benchmarks/gpu_check.py` checks the machine. Each node's worker task then
sees only its node's GPUs (CUDA_VISIBLE_DEVICES), the parameter servers and the virtual workers'
processes none (docs/gpus.md).

    python examples/mixed_gpus/train.py [--epochs=3] [--policy=ed]

The same run from the command line: hetpipe-train --cluster=examples/mixed_gpus/cluster.json --policy=ed
"""
import argparse
import os

import keras

import hetpipe_tf
from hetpipe_tf.cli.models import build_model
from hetpipe_tf.data.datasets import load_image_classification

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--policy", default="ed", help="np, ed, hd or auto")
    parser.add_argument("--cluster", default=CLUSTER)
    args = parser.parse_args()
    strategy = hetpipe_tf.HetPipeStrategy(cluster=args.cluster, policy=args.policy, staleness_bound=1,
                                          launch="processes")
    with strategy.scope():  # starts the tasks, each with its node's GPUs; datasets and the model inside
        train = load_image_classification("hetpipe_digits", "train", batch_size=64, shuffle=True)
        test = load_image_classification("hetpipe_digits", "test", batch_size=64)
        model = build_model("cnn", input_shape=(8, 8, 1), num_classes=10)
        model.compile(optimizer=keras.optimizers.AdamW(1e-3, global_clipnorm=1.0), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, epochs=args.epochs, validation_data=test)
    print(strategy.describe())


if __name__ == "__main__":
    main()
