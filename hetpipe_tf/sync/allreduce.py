"""Pipe-SGD's all-reduce on TensorFlow's collective ops (Pipe-SGD, Algorithm 1, communication
thread line 4: g_sum[t] = Σ g_local[t] over the workers).

Stage s of every virtual worker is one collective group; a stage's all-reduce of minibatch j is
one collective instance of its group, run on the stage's device, with what the stage
communicates compressed (:mod:`hetpipe_tf.sync.compression`):

* ``none``: the stage's float32 values, flattened into one vector, ``CollectiveReduceV2``
  (merge Add): the sum.
* ``truncate16``: the truncated values as bfloat16, reduced as bfloat16 (Algorithm 1 sums the
  compressed gradients, g^c_sum = Σ g^c_local), then widened: half the bytes of ``none``.
* ``quant8``: int8 values cannot be summed in 8 bits (every worker has its own scale), and the
  collectives carry no int8: each worker's payload (its scales, then its int8 values packed four
  to an int32) is gathered with ``CollectiveGatherV2``, and every worker decodes and sums them:
  a payload is a quarter of ``none``'s, and a worker's link carries p - 1 of them, fewer bytes
  than ``none``'s ring all-reduce (2(p-1)/p of its values) below 8 workers.

A group knows its members by their devices: every worker's stage s must be on a device of its
own and hold the same variables (the workers cut the model at the same boundaries).
"""
import functools
import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.sync.compression import decode_quant8, encode_quant8, truncate16, untruncate16
from hetpipe_tf.sync.pipe_sgd import get_compression

_groups: "weakref.WeakValueDictionary[tuple[str, str], AllReduceGroup]" = weakref.WeakValueDictionary()
_groups_lock = threading.Lock()


def group_of(servers: Any, compression: str, timeout_s: float) -> "AllReduceGroup":
    """The all-reduce group of the run `servers` (its :class:`ParameterServers`) belong to, in this
    process: one per run and `compression`, with a member per virtual worker of the run."""
    key = (servers.run, compression)
    with _groups_lock:
        group = _groups.get(key)
        if group is None:
            group = AllReduceGroup(servers.run, len(servers.clock.stages_per_worker), compression, timeout_s)
            _groups[key] = group
        return group


class AllReduceGroup:
    """The collectives of one run: per stage, one group of `num_workers` members.

    Args:
      run: the run's name (the same in every process of the run); the group keys derive from it.
      num_workers: the virtual workers of the run.
      compression: a name of :data:`hetpipe_tf.sync.pipe_sgd.COMPRESSIONS`.
      timeout_s: the longest a collective waits for the other members.
    """

    def __init__(self, run: str, num_workers: int, compression: str, timeout_s: float = 300.0) -> None:
        self.run = run
        self.num_workers = int(num_workers)
        self.compression = get_compression(compression).name
        self.timeout_s = float(timeout_s)
        self._members: dict[int, dict[int, tuple[str, tuple[str, ...]]]] = {}  # stage -> {worker: (device, paths)}
        self._functions: dict[tuple[int, int], Callable[..., list[tf.Tensor]]] = {}  # (worker, stage) -> its function
        self._lock = threading.Lock()

    def group_key(self, stage: int) -> int:
        """Stage `stage`'s collective group key: the same in every process of the run."""
        return 1 + zlib.crc32(f"hetpipe/{self.run}/{self.compression}/stage{stage}".encode()) % (2 ** 30)

    def join(self, worker: int, stage: int, device: str, paths: Sequence[str]) -> None:
        """Records `worker`'s stage `stage` as a member on `device` holding `paths`; a ValueError if
        another worker's same stage is on that device or holds other variables."""
        with self._lock:
            members = self._members.setdefault(stage, {})
            if worker in members:
                return
            for other, (other_device, other_paths) in members.items():
                if other_device == device:
                    raise ValueError(
                        f"Pipe-SGD all-reduces stage {stage} of every virtual worker with TensorFlow's collectives, "
                        f"which need a device per member, but workers {other} and {worker} both have it on {device}; "
                        f"give each worker its own devices (emulated devices get one logical device each)")
                if list(other_paths) != list(paths):
                    raise ValueError(
                        f"Pipe-SGD all-reduces stage {stage} of every virtual worker with the same stage of the "
                        f"others, so every worker must cut the model at the same boundaries: worker {other}'s "
                        f"stage {stage} holds {list(other_paths)}, worker {worker}'s {list(paths)}; give every "
                        f"worker the same boundaries (an ED allocation, or equal WorkerSpec.boundaries)")
            members[worker] = (device, tuple(paths))

    def all_reduce(self, worker: int, stage: int, device: str, instance: int, tensors: Sequence[tf.Tensor],
                   paths: Sequence[str]) -> list[tf.Tensor]:
        """Σ over the workers of their `tensors` (worker `worker`'s stage `stage`, on `device`),
        communicated compressed; collective instance `instance` (>= 1) of the stage's group, the
        same on every worker for the same minibatch. Blocks until every member has contributed."""
        values = list(tensors)
        if not values:
            return []
        self.join(worker, stage, device, paths)
        fn = self._functions.get((worker, stage))
        if fn is None:
            fn = FirstCallLocked(tf.function(functools.partial(self._reduce_graph, self.group_key(stage))), waits=True)
            self._functions[(worker, stage)] = fn
        try:
            with tf.device(self.member_device(worker, device)):
                return fn(tf.constant(instance, tf.int32), values)
        except tf.errors.DeadlineExceededError as exc:
            raise TimeoutError(
                f"Pipe-SGD: all-reduce {instance} of stage {stage} (virtual worker {worker}) did not hear from all "
                f"{self.num_workers} workers within {self.timeout_s:g} s. Every worker must train the same "
                f"minibatches of a run: a stop that ends them at different ones (stop_training, EarlyStopping), or "
                f"a lost worker, leaves an all-reduce unanswered. TensorFlow then aborts every later collective of "
                f"this process: start a new process to train again") from exc

    def member_device(self, worker: int, device: str) -> str:
        """Where `worker`'s collectives run. In one process: its stage's `device`. In a run of one
        process per virtual worker (`device` is a task's of a cluster), each process is a client of
        its own, and collectives between clients cannot meet (a client's cluster names no other
        client: two clients naming each other hang TensorFlow 2.21's connect), while those between
        the cluster's tasks do: worker w's collectives then run on the w-th CPU of the worker tasks
        (by task, then index), one per virtual worker, for every stage."""
        if tf.DeviceSpec.from_string(device).job in (None, "localhost"):
            return device
        specs = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices("CPU")]
        cpus = sorted((d.task, d.device_index) for d in specs if d.job == "worker")
        if len(cpus) < self.num_workers:
            raise ValueError(f"Pipe-SGD runs the collectives of a run of several processes on the CPUs of the "
                             f"cluster's worker tasks, one per virtual worker: {self.num_workers} workers, but the "
                             f"worker tasks have {len(cpus)} CPU device(s); give the worker tasks more logical CPUs "
                             f"or run fewer virtual workers")
        task, index = cpus[worker]
        return f"/job:worker/replica:0/task:{task}/device:CPU:{index}"

    def payload(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
        """What one worker sends of its `tensors` (float32, as its stage holds them): the flat
        float32 values (``none``), their truncation as bfloat16 (``truncate16``), or its scales and
        packed int8 values as int32 words (``quant8``)."""
        if self.compression == "quant8":
            return encode_quant8(tensors)
        if self.compression == "truncate16":
            return tf.concat([tf.reshape(truncate16(x), [-1]) for x in tensors], 0)
        dtypes = {x.dtype for x in tensors}
        if len(dtypes) > 1:
            raise ValueError(f"the all-reduce of a stage sums one floating-point type, this stage holds "
                             f"{sorted(d.name for d in dtypes)}")
        return tf.concat([tf.reshape(x, [-1]) for x in tensors], 0)

    def _reduce_graph(self, group_key: int, instance: tf.Tensor, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        size, key = tf.constant(self.num_workers), tf.constant(group_key)
        sent = self.payload(tensors)
        if self.compression == "quant8":
            gathered = tf.raw_ops.CollectiveGatherV2(input=sent, group_size=size, group_key=key, instance_key=instance,
                                                     ordering_token=[], timeout_seconds=self.timeout_s)
            payloads = tf.reshape(gathered, [self.num_workers, -1])
            decoded = [decode_quant8(payloads[w], tensors) for w in range(self.num_workers)]
            return [tf.add_n(list(parts)) for parts in zip(*decoded)]
        total = tf.raw_ops.CollectiveReduceV2(
            input=sent, group_size=size, group_key=key, instance_key=instance, ordering_token=[],
            merge_op="Add", final_op="Id", timeout_seconds=self.timeout_s)
        if self.compression == "truncate16":
            total = untruncate16(total)
        out: list[tf.Tensor] = []
        at = 0
        for x in tensors:
            n = x.shape.num_elements()
            out.append(tf.reshape(total[at:at + n], x.shape))
            at += n
        return out
