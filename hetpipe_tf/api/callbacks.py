"""Keras callbacks for pipelined training."""
import time
from typing import Any

import keras
import tensorflow as tf


class PipelineTensorBoard(keras.callbacks.Callback):
    """Writes epoch scalars to TensorBoard: the epoch logs (loss, accuracy, images/s,
    validation) and the busy fraction of every device of the virtual worker.

    Runs with emulated devices also get a text summary saying so, and the emulation's
    overrun fraction as a scalar.

    Args:
        log_dir: the directory TensorBoard's event files are written to.
        virtual_worker: the VirtualWorker whose fit this callback is given to.
    """

    def __init__(self, log_dir: str, virtual_worker: Any) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.vw = virtual_worker
        self._writer = None
        self._last = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Opens the event file; an emulated run's text summary says so."""
        self._writer = tf.summary.create_file_writer(self.log_dir)
        if self.vw.emulated:
            with self._writer.as_default():
                tf.summary.text("emulation", self.vw.describe(), step=0)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Writes the epoch's logs and every stage's busy fraction since the last epoch."""
        now, busy = time.perf_counter(), self.vw.busy_seconds()
        with self._writer.as_default():
            for key, value in (logs or {}).items():
                tf.summary.scalar(key, value, step=epoch)
            if self._last is not None and busy:
                wall = now - self._last[0]
                for s, (b, b0) in enumerate(zip(busy, self._last[1])):
                    tf.summary.scalar(f"busy_fraction/stage_{s}", (b - b0) / wall, step=epoch)
        self._writer.flush()
        self._last = (now, busy)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Starts the busy fractions' clock at the first minibatch."""
        if self._last is None:
            self._last = (time.perf_counter(), self.vw.busy_seconds())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Closes the event file."""
        self._writer.close()


class WSPTensorBoard(keras.callbacks.Callback):
    """Writes epoch scalars of training under Wave Synchronous Parallel to TensorBoard.

    The epoch logs, and per virtual worker (``vw_<i>/...``, §5, §8.4): its clock, its distance
    to the slowest worker's clock, its first stage's average wait for pulled weights and the
    part of that wait it ran nothing (idle), and its images/s over the epoch. Runs with
    emulated devices also get a text summary saying so.

    Args:
      log_dir: the TensorBoard directory.
      strategy: a HetPipeStrategy or a WSPRunner.
    """

    def __init__(self, log_dir: str, strategy: Any) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.strategy = strategy
        self._writer = None
        self._since = None

    def _runner(self) -> Any:
        return getattr(self.strategy, "runner", None) or self.strategy

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Opens the event file and writes the plan, and whether the devices are emulated, as text."""
        self._writer = tf.summary.create_file_writer(self.log_dir)
        self._since = time.perf_counter()
        describe = getattr(self.strategy, "describe", None)
        with self._writer.as_default():
            if describe is not None:
                tf.summary.text("plan", describe(), step=0)
            if self._runner().emulated:
                tf.summary.text("emulation", "EMULATED devices: " + "; ".join(self._runner().descriptions), step=0)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Writes the epoch's logs and every virtual worker's clock, wait, idle time and images/s."""
        runner = self._runner()
        stats = runner.stats(since=self._since)
        self._since = time.perf_counter()
        with self._writer.as_default():
            for key, value in (logs or {}).items():
                tf.summary.scalar(key, value, step=epoch)
            for st in stats:
                prefix = f"vw_{st['worker']}"
                tf.summary.scalar(f"{prefix}/clock", st["clock"], step=epoch)
                tf.summary.scalar(f"{prefix}/clock_distance", st["clock_distance"], step=epoch)
                tf.summary.scalar(f"{prefix}/wait_s", st["average_wait_s"], step=epoch)
                tf.summary.scalar(f"{prefix}/idle_s", st["average_idle_s"], step=epoch)
                tf.summary.scalar(f"{prefix}/images_per_s", st["images_per_s"], step=epoch)
        self._writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Closes the event file."""
        self._writer.close()
