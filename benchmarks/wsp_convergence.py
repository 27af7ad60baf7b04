"""Convergence under Wave Synchronous Parallel: test accuracy against wall time for D = 0, 4, 32.

HetPipeStrategy on the bundled digits dataset (CNN with BatchNorm), the ``local``
cluster of four EMULATED devices grouped by ED into two virtual workers, trained in one
process (launch "in_process"), one after the other with the same seed; beside them one
virtual worker on two of the devices (hetpipe's single-worker path) as the reference.
Every epoch's test accuracy and the wall time since training began go out as JSON
lines; ``--plot`` also draws them (PNG; needs matplotlib, see benchmarks/requirements.txt).

SGD without momentum: under WSP every other worker's updates arrive late, and late
updates act like extra momentum, so momentum 0.9 (single-worker's setting) trains
several workers noticeably worse (measured while building this; see the README).

    python benchmarks/wsp_convergence.py [--epochs=12] [--plot=wsp_convergence.png]
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _emit(**fields):
    print(json.dumps({"benchmark": "wsp_convergence", **fields}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--dilation", type=float, default=3.0)
    parser.add_argument("--plot", default=None, help="write the accuracy-vs-time plot here (PNG)")
    args = parser.parse_args()

    from hetpipe_tf.api.strategy import HetPipeStrategy

    strategies = {d: HetPipeStrategy(cluster="local", policy="ed", staleness_bound=d, launch="in_process",
                                     dilation=args.dilation) for d in (0, 4, 32)}
    strategies[0]._connect()  # the logical devices, before anything starts TensorFlow
    import keras

    from hetpipe_tf.data import datasets

    from hetpipe_tf.cli import models
    from hetpipe_tf.runtime.virtual_worker import VirtualWorker

    class Clock(keras.callbacks.Callback):
        def __init__(self, label, extra):
            super().__init__()
            self.label, self.extra, self.curve = label, extra, []

        def on_train_begin(self, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            row = {"run": self.label, "epoch": epoch + 1, "seconds": time.perf_counter() - self.t0,
                   "test_accuracy": logs["val_accuracy"], "train_loss": logs["loss"], **self.extra}
            self.curve.append(row)
            _emit(**row)

    def build():
        keras.utils.set_random_seed(0)
        train = datasets.load_image_classification("hetpipe_digits", "train", batch_size=32, shuffle=True, seed=0)
        test = datasets.load_image_classification("hetpipe_digits", "test", batch_size=32)
        model = models.build_model("cnn", tuple(train.element_spec[0].shape[1:]), 10)
        return train, test, model

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    curves = {}
    for d, strategy in strategies.items():
        with strategy.scope():
            train, test, model = build()
            model.compile(optimizer=keras.optimizers.SGD(args.learning_rate), loss=loss, metrics=["accuracy"])
        clock = Clock(f"WSP D={d}", {"staleness_bound": d, "virtual_workers": 2, "emulated": True,
                                     "launch": "in_process"})
        model.fit(train, epochs=args.epochs, validation_data=test, callbacks=[clock], verbose=0)
        curves[clock.label] = clock.curve
    train, test, model = build()
    vw = VirtualWorker(model, "0.5@32M,1@64M", optimizer=keras.optimizers.SGD(args.learning_rate), loss=loss,
                       metrics=["accuracy"], dilation=args.dilation)
    clock = Clock("one virtual worker", {"virtual_workers": 1, "emulated": True})
    vw.fit(train, epochs=args.epochs, validation_data=test, callbacks=[clock], verbose=0)
    curves[clock.label] = clock.curve
    _emit(summary=True, final_test_accuracy={k: c[-1]["test_accuracy"] for k, c in curves.items()},
          seconds={k: c[-1]["seconds"] for k, c in curves.items()},
          emulation="EMULATED devices of the 'local' cluster (speeds 1 and 0.5), dilation %g" % args.dilation)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for label, curve in curves.items():
            ax.plot([r["seconds"] for r in curve], [r["test_accuracy"] for r in curve], marker="o", label=label)
        ax.set_xlabel("wall time (s, EMULATED devices)")
        ax.set_ylabel("test accuracy")
        ax.set_title("hetpipe_digits CNN: WSP with 2 virtual workers (ED)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
