"""Parameter servers of Wave Synchronous Parallel (HetPipe §5, §8.1).

The global weights are TensorFlow variables on the parameter-server devices (tasks of
job ``ps`` on TensorFlow's distributed runtime, or local devices in a single process),
one per trainable variable of the model and per floating-point state variable
(BatchNorm's moving statistics, which thus average over every worker's minibatches),
sharded by layer: ``default`` placement puts
the layers round-robin over the servers, ``local`` puts each layer on a server chosen
by the caller (for ED, the server on the node of the device that trains the layer).
The WSP clock (:mod:`hetpipe_tf.ops.wsp_clock`) lives on the first server. Every variable
and the clock is a resource with a name of its run (``hetpipe/<run>/<position>``): the chief
creates them, and the process that drives a virtual worker attaches to them by name
(``variable_devices``), so that every process reads and updates the same global weights.

A stage pushes the aggregated update of a wave, ``w_global += u`` for its layers, then
records the push on the clock. With uneven minibatches (beyond the paper) the servers weight
every push by its worker's share of the samples, ``w_global += a_i · u`` with
``a_i = n · b_i / B`` for n workers of minibatch sizes b_i, B = Σ b_j
(:func:`hetpipe_tf.planning.uneven.push_weights`): u is the sum of the worker's local updates,
each from the gradient of its mean loss over b_i samples, so with D = 0 and Nm = 1 under SGD
at rate η the global step is -η·n·(gradient of the mean loss over all B samples of the
round), SGD on the concatenated batch at rate n·η, which is exactly what the unweighted sum
does with even sizes (every a_i = 1, the paper's rule). Each push is applied once, scaled once:
the global weights are the initial ones plus Σ a_i · (worker i's updates), nothing lost and
nothing applied twice. A pull waits on the clock until every worker has pushed
wave c - D, reads the workers' clocks, then reads the stage's layers: the weights read
hold at least every wave below each worker's clock read before them.

A push and a pull are each one ``tf.function`` spanning the servers: one call from the
chief per stage and wave, however many variables the stage has, and the pull's wait
runs in the servers' graph executor, which holds no thread while it waits.
"""
import functools
import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from dataclasses import dataclass

import keras
import tensorflow as tf

from hetpipe_tf.ops.first_calls import FirstCallLocked
from hetpipe_tf.ops.wsp_clock import WspClock
from hetpipe_tf.sync.allreduce import group_of
from hetpipe_tf.sync.wsp import PLACEMENTS

_runs = itertools.count()


@dataclass(frozen=True)
class ServerLayout:
    """Where a run's global weights live: what :class:`ParameterServers` is built from, the one
    place they are built (:meth:`servers`). The parameter-server `devices`, each virtual worker's
    number of stages, the `placement` ("default": layers round-robin; "local": `layer_devices`,
    {layer name: server device}, §8.1) and each worker's push weight (None: every weight 1). A
    layout with `run` and `variable_devices` attaches to the servers another process created for
    that run (:meth:`ParameterServers.layout` gives it; a worker's process receives it)."""
    devices: tuple[str, ...]
    stages_per_worker: tuple[int, ...]
    placement: str = "default"
    layer_devices: Mapping[str, str] | None = None
    push_weights: tuple[float, ...] | None = None
    run: str | None = None
    variable_devices: tuple[str, ...] | None = None

    def servers(self, model: keras.Model) -> "ParameterServers":
        """The run's servers of `model`'s weights: new ones, or, with `variable_devices`, those of `run`."""
        return ParameterServers(model, self.devices, self.stages_per_worker, self.placement, self.layer_devices,
                                run=self.run, variable_devices=self.variable_devices, push_weights=self.push_weights)


class ParameterServers:
    """Global weights and the WSP clock.

    Args:
      model: the Keras model whose trainable variables are trained (paths are the keys).
      devices: the parameter-server devices, e.g. ["/job:ps/task:0/device:CPU:0", ...].
      stages_per_worker: the number of stages of every virtual worker.
      placement: "default" (layers round-robin) or "local" (`layer_devices` says where).
      layer_devices: for "local", {layer name: server device}.
      run: the name of the run the resources carry (default: one of this object's own).
      variable_devices: to attach to the resources another process created for `run`, its
        :meth:`variable_devices` (then `placement`, `layer_devices` and `push_weights` are not
        used: the run's push weights are read from the first server). Variables
        are named by their position in the model, so a copy of the model rebuilt in another
        process, whose paths may differ, finds them.
      push_weights: the weight a_i of each worker's pushes (see the module docstring; None:
        every weight 1, the paper's unweighted sum).
    """

    def __init__(self, model: keras.Model, devices: Sequence[str], stages_per_worker: Sequence[int],
                 placement: str = "default", layer_devices: Mapping[str, str] | None = None, run: str | None = None,
                 variable_devices: Sequence[str] | None = None, push_weights: Sequence[float] | None = None) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown parameter placement {placement!r}; allowed: {', '.join(PLACEMENTS)}")
        if not devices:
            raise ValueError("at least one parameter-server device is needed")
        self.devices = tuple(devices)
        self.placement = placement
        self.run = run or f"run{next(_runs)}_{os.getpid()}"
        self.variables = {}
        self.device_of = {}
        layers = []
        variables = synchronised_variables(model.trainable_variables, model.non_trainable_variables)
        if variable_devices is not None and len(variable_devices) != len(variables):
            raise ValueError(f"run {self.run!r} has {len(variable_devices)} global variables, this model "
                             f"{len(variables)}: it is not the model the run was created for")
        for n, v in enumerate(variables):
            layer = layer_of(v.path)
            if layer not in layers:
                layers.append(layer)
            if variable_devices is not None:
                device = variable_devices[n]
            elif placement == "local":
                if not layer_devices or layer not in layer_devices:
                    raise ValueError(f"local placement needs the server of layer '{layer}'")
                device = layer_devices[layer]
            else:
                device = self.devices[layers.index(layer) % len(self.devices)]
            self.variables[v.path] = GlobalVariable(f"hetpipe/{self.run}/{n}", v, device,
                                                    create=variable_devices is None)
            self.device_of[v.path] = device
        self.clock = WspClock(stages_per_worker, device=self.devices[0], shared_name=f"hetpipe/{self.run}/wsp_clock",
                              create=variable_devices is None)
        workers = len(stages_per_worker)
        weights = (1.0,) * workers if push_weights is None else tuple(float(a) for a in push_weights)
        if len(weights) != workers or not all(a > 0 for a in weights):
            raise ValueError(f"push_weights must be one positive weight per virtual worker ({workers}), got "
                             f"{list(weights)}: give n * b_i / B for minibatch sizes b_i "
                             f"(hetpipe_tf.planning.uneven.push_weights)")
        stored = GlobalVariable(f"hetpipe/{self.run}/push_weights", tf.constant(weights, tf.float32),
                                self.devices[0], create=variable_devices is None)
        self.push_weights = tuple(float(a) for a in stored.numpy())
        self._push_fns: dict[tuple[str, ...], FirstCallLocked] = {}
        self._pull_fns: dict[tuple[tuple[str, ...], str | None], FirstCallLocked] = {}

    def _push_graph(self, paths: tuple[str, ...], worker: tf.Tensor, stage: tf.Tensor, wave: tf.Tensor,
                    weight: tf.Tensor, deltas: Sequence[tf.Tensor]) -> None:
        updates = []
        weighted = any(a != 1.0 for a in self.push_weights)  # even sizes: the update as it is, bit for bit
        for path, delta in zip(paths, deltas):
            with tf.device(self.device_of[path]):
                if weighted:
                    delta = delta * tf.cast(weight, delta.dtype)
                updates.append(self.variables[path].assign_add(delta))
        with tf.control_dependencies(updates):
            self.clock.push_graph(worker, stage, wave)

    def _pull_graph(self, paths: tuple[str, ...], to_device: str | None, wave: tf.Tensor, timeout: tf.Tensor
                    ) -> tuple[list[tf.Tensor], tf.Tensor]:
        global_clock = self.clock.wait_graph(wave, timeout)
        with tf.control_dependencies([global_clock]):
            clocks, _ = self.clock.clocks_graph()
        values = []
        with tf.control_dependencies([clocks]):
            for path in paths:
                with tf.device(self.device_of[path]):
                    value = self.variables[path].read_value()
                if to_device is not None:
                    with tf.device(to_device):
                        value = tf.identity(value)
                values.append(value)
        return values, clocks

    def push(self, worker: int, stage: int, wave: int, paths: Sequence[str], deltas: Sequence[tf.Tensor]) -> None:
        """w_global += a_worker · u for these variables (on their servers), then the clock records
        the push."""
        paths = tuple(paths)
        if paths not in self._push_fns:
            # A partial, not a lambda: TensorFlow keys its retracing warning on a function's code,
            # which one lambda per stage would share.
            self._push_fns[paths] = FirstCallLocked(tf.function(functools.partial(self._push_graph, paths)))
        self._push_fns[paths](tf.constant(worker, tf.int64), tf.constant(stage, tf.int64),
                              tf.constant(wave, tf.int64), tf.constant(self.push_weights[worker], tf.float32),
                              list(deltas))

    def pull(self, paths: Sequence[str], wave: int, timeout: float, to_device: str | None = None
             ) -> tuple[list[tf.Tensor], tuple[int, ...]]:
        """Waits until every worker pushed `wave` (none when wave < 0), then reads `paths`; with
        `to_device`, the values arrive there within the same call (one call, not a copy per
        variable when the stage that merges them asks for its inputs).

        Returns (values, worker clocks read before the values).

        Returns:
            The values and the worker clocks read before them.
        """
        key = (tuple(paths), to_device)
        if key not in self._pull_fns:
            self._pull_fns[key] = FirstCallLocked(tf.function(functools.partial(self._pull_graph, *key)), waits=True)
        values, clocks = self._pull_fns[key](tf.constant(wave, tf.int64), tf.constant(float(timeout), tf.float32))
        return values, tuple(int(c) for c in clocks.numpy())

    def all_reduce_group(self, compression: Any, timeout_s: float) -> Any:
        """The all-reduce group of this run's virtual workers in this process
        (:func:`hetpipe_tf.sync.allreduce.group_of`), for the schemes that all-reduce (Pipe-SGD).

        Returns:
            The group.
        """
        return group_of(self, compression, timeout_s)

    def abort(self, reason: str) -> None:
        """Ends the run: every pull of it, waiting or later, in any process, fails at once
        naming `reason` (:meth:`hetpipe_tf.ops.wsp_clock.WspClock.abort`). Servers that are
        gone keep no pull waiting, so their error is not raised."""
        try:
            self.clock.abort(reason)
        except tf.errors.OpError:
            pass

    def advance_clocks(self, clocks: Sequence[int]) -> None:
        """Records that every stage of each worker pushed its first clocks[worker] waves (a
        resumed run's clocks go on from the saved ones)."""
        for worker, clock in enumerate(clocks):
            for stage in range(self.clock.stages_per_worker[worker]):
                for wave in range(clock):
                    self.clock.push(worker, stage, wave)

    def rejoin(self, workers: Iterable[int]) -> None:
        """`workers` start a run together: each holds the global clock back again at once
        (:meth:`hetpipe_tf.ops.wsp_clock.WspClock.retire`), not only when its own run begins, so
        that no worker's pull passes a wave that another, not yet started, has still to push."""
        for worker in workers:
            self.clock.retire(worker, retired=False)

    def variable_devices(self) -> list[str]:
        """Each global variable's server, in the model's order: what another process needs to
        attach (see the `variable_devices` argument).

        Returns:
            The device of each variable.
        """
        return list(self.device_of.values())

    def layout(self) -> ServerLayout:
        """What another process attaches to these servers with (its own copy of the model given)."""
        return ServerLayout(self.devices, tuple(self.clock.stages_per_worker), run=self.run,
                            variable_devices=tuple(self.variable_devices()))

    def values(self) -> dict[str, tf.Tensor]:
        """The global weights, by variable path."""
        return {p: v.read_value() for p, v in self.variables.items()}

    def write_to(self, model: keras.Model) -> None:
        """Puts the global weights (and synchronised state) into the Keras model."""
        for v in synchronised_variables(model.trainable_variables, model.non_trainable_variables):
            v.assign(self.variables[v.path].read_value())


class GlobalVariable:
    """One global weight: a resource variable on a server device, named so that every process
    of the run finds it (``tf.Variable`` names its resource for its own process only)."""

    def __init__(self, shared_name: str, like: Any, device: str, create: bool = True) -> None:
        self.dtype = tf.as_dtype(like.dtype)
        self.shape = tf.TensorShape(like.shape)
        with tf.device(device):
            self.handle = tf.raw_ops.VarHandleOp(dtype=self.dtype, shape=self.shape, shared_name=shared_name,
                                                 container="")
        self.device = self.handle.device  # the full name
        if create:
            with tf.device(self.device):
                tf.raw_ops.AssignVariableOp(resource=self.handle, value=tf.convert_to_tensor(like.numpy(), self.dtype))

    def read_value(self) -> tf.Tensor:
        """The variable's value, read on its server."""
        with tf.device(self.device):
            return tf.raw_ops.ReadVariableOp(resource=self.handle, dtype=self.dtype)

    def assign_add(self, delta: tf.Tensor) -> tf.Operation:
        """Adds `delta` to the variable on its server."""
        with tf.device(self.device):
            return tf.raw_ops.AssignAddVariableOp(resource=self.handle, value=delta)

    def numpy(self) -> Any:
        """The variable's value as a NumPy array."""
        return self.read_value().numpy()


def synchronised_variables(trainable: Iterable[keras.Variable],
                           non_trainable: Iterable[keras.Variable]) -> list[keras.Variable]:
    """What virtual workers synchronise, of a model's or a stage's variables: the trainable
    weights and the floating-point state (BatchNorm's moving statistics, frozen weights), so
    that moving averages take every worker's minibatches; not integer state such as random
    seeds. In this order: the parameter servers' keys and a stage's exchanges follow it.

    Returns:
        Those variables, in that order.
    """
    return list(trainable) + [v for v in non_trainable if tf.as_dtype(v.dtype).is_floating]


def layer_of(path: str) -> str:
    """The layer a variable path belongs to ("mlp/dense/kernel" -> "mlp/dense")."""
    return path.rsplit("/", 1)[0]
