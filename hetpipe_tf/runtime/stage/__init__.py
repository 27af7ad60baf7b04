"""One pipeline stage on its device: weights, optimizer, weight stash, minibatches in flight.

The stage's live weights w_local, its optimizer copy and its weight stash are placed on the
stage's device (``tf.device``). The rules of HetPipe §4 are carried out by the schedule's
instructions; :class:`StageRuntime` is what the device instructions
(:data:`DEVICE_INSTRUCTIONS`) do to the stage:

* ``StashWeights(p)``: w_p := w_local, kept in the C++ weight stash;
* ``Forward(p)``: runs the stage on minibatch p with w_p and keeps what its backward
  pass needs (the pass's intermediate tensors; the backward pass does not recompute
  them); ``live``: with the live weights instead of a stashed version; ``recompute``:
  keeps only the pass's inputs, for ``Recompute(p)``, the same pass again with the live
  weights (GPipe's re-materialisation; NaivePipe's backward against the live weights);
* ``Backward(p)``: gradients of p against the weights its pass used (w_p);
* ``CompensateGradient(p)``: TaylorPipe's delay compensation (TaylorPipe §3.2) of p's
  weight gradient g, computed against w_p: g := g + λ·g⊙g⊙(w_local − w_p);
* ``ApplyUpdate(p)``: w_local := w_local + u_p with the stage's optimizer;
* ``AccumulateGradient(p)`` and ``ApplyAccumulated(first, p)``: GPipe's sum of
  microbatch gradients, and one update from their mean at the flush;
* ``ReleaseWeights(p)``: drops w_p.

The package, one concept a module, each used through its public surface only:

* :mod:`~hetpipe_tf.runtime.stage.runtime`: :class:`StageRuntime`, the façade the executor
  drives (what a minibatch brings and takes, :meth:`StageRuntime.run`, the verdicts read back,
  the state of a checkpoint), and the host's bookkeeping of each instruction;
* :mod:`~hetpipe_tf.runtime.stage.slots`: what the stage holds per minibatch between calls;
* :mod:`~hetpipe_tf.runtime.stage.lowering`: a task's device instructions as one compiled call
  on the stage's device, and the graph of that call;
* :mod:`~hetpipe_tf.runtime.stage.passes`: the stage's pass on given weights, split or timed;
* :mod:`~hetpipe_tf.runtime.stage.updates`: the update, and the terms it takes from every stage;
* :mod:`~hetpipe_tf.runtime.stage.weights`: the variables, the optimizer and the weight stash;
* :mod:`~hetpipe_tf.runtime.stage.synchronised`: the surface the synchronisation schemes of
  :mod:`hetpipe_tf.sync` work on (reading, pushing and merging the synchronised variables, §5);
* :mod:`~hetpipe_tf.runtime.stage.verdicts`: whether a minibatch is finite, and
  :class:`NonFiniteError`;
* :mod:`~hetpipe_tf.runtime.stage.timing`: each stage's passes timed alone (the references
  of emulated devices, the profile's times).

**Non-finite minibatches.** Nothing reads a value back to the host on the way: the loss is
logged as a tensor, and each update is applied only if its verdict says the minibatch is
finite (:mod:`~hetpipe_tf.runtime.stage.verdicts`). A minibatch's verdict travels upstream with
its gradient (``SendGradient`` sends both), each stage combining it with its own gradient, so a
loss or gradient that is NaN or infinite on one stage stops the update of that minibatch on that
stage and every stage before it (they apply after it, §4); nothing of it reaches their w_local,
so nothing of it can be pushed to the parameter servers. The verdicts are read back before the
stage's next task (:meth:`StageRuntime.check_applied`, which the executor also calls before
anything reads the weights: a push, a snapshot, the end of the run), and a non-finite one raises
:class:`NonFiniteError` naming the minibatch and the stage where the loss or gradient went bad.
"""
from hetpipe_tf.runtime.stage.runtime import DEVICE_INSTRUCTIONS, StageRuntime, StageState
from hetpipe_tf.runtime.stage.verdicts import NonFiniteError

__all__ = ["DEVICE_INSTRUCTIONS", "NonFiniteError", "StageRuntime", "StageState"]
