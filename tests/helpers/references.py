"""What training must give, computed another way: the same model cloned for Keras to train,
HetPipe's stale SGD done sequentially, the exact result of data-only gradients, and which
weight versions each classic schedule uses."""
import keras
import numpy as np
import tensorflow as tf

from tests.helpers.models import LOSS


def clone(model):
    """A copy of `model` with its weights and its state (the same dropout random state)."""
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    for a, b in zip(ref.non_trainable_variables, model.non_trainable_variables):
        a.assign(b)  # the same dropout random state
    return ref


def stale_sgd_reference(model, batches, nm, optimizer):
    """HetPipe §4 done sequentially on a clone of `model` (:func:`stale_sgd_run`)."""
    return stale_sgd_run(clone(model), batches, nm, optimizer)


def stale_sgd_run(ref, batches, nm, optimizer):
    """HetPipe §4 done sequentially, training `ref` itself: minibatch p's gradient at w_p = w after
    updates 1..p-Nm, given to `optimizer` (which clips by a global norm itself, if it has one).
    Returns the final trainable weights and every minibatch's loss."""
    optimizer.build(ref.trainable_variables)
    ntv = [v.value for v in ref.non_trainable_variables]
    history = [[v.numpy() for v in ref.trainable_variables]]
    losses = []
    for p, (x, y) in enumerate(batches, start=1):
        w_p = [tf.constant(a) for a in history[max(p - nm, 0)]]
        with tf.GradientTape() as tape:
            tape.watch(w_p)
            out, _ = ref.stateless_call(w_p, ntv, x, training=True)
            loss = LOSS(y, out)
        optimizer.apply(tape.gradient(loss, w_p), ref.trainable_variables)
        history.append([v.numpy() for v in ref.trainable_variables])
        losses.append(float(loss))
    return history[-1], losses


def constant_gradients(model, x):
    """{path: gradient} of the mean output of `model` at `x` (a constant_gradient_model's do not
    depend on its weights)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x))
    return {v.path: g.numpy() for v, g in zip(model.trainable_variables,
                                                tape.gradient(loss, model.trainable_variables))}


def exact_sgd_case(model, n, workers=2, lr=0.05):
    """n minibatches per worker, and the weights SGD must end with: w0 - lr * every gradient."""
    data = [[(np.random.default_rng(10 * w + i).normal(size=(4, 6)).astype("float32"), np.zeros(4, "int64"))
             for i in range(n)] for w in range(workers)]
    expected = {v.path: v.numpy().copy() for v in model.trainable_variables}
    for batches in data:
        for x, _ in batches:
            for p, g in constant_gradients(model, x).items():
                expected[p] -= lr * g
    return data, expected


#: Per schedule (k = 2, Nm = 2): how many local updates the weights held that minibatch p's
#: forward pass on stage 0, its backward pass on stage 0, and its pass on stage 1 used. In 1F1B
#: stage 0 runs F1 F2 B1 F3 B2 F4 ..., stage 1 F1B1 F2B2 ...
WEIGHT_VERSIONS = {
    "pipedream": lambda p: (p - 2, p - 2, p - 1),  # stage 0's backward: the version its forward stashed
    "naivepipe": lambda p: (p - 2, p - 1, p - 1),  # stage 0's backward: the live weights, update p-1 in
    "pipedream-vsync": lambda p: (p - 2, p - 2, p - 2),  # every stage: w_p = updates 1..p-Nm
    "hetpipe": lambda p: (p - 2, p - 2, p - 2),  # HetPipe's rule (§4), the same
}


def max_difference(a, b):
    """The largest absolute difference between two lists of weights."""
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def keras_fit_weights(model, optimizer, loss, batches):
    """The weights of `model` after Keras's own fit of `batches` (x, y), one step each, in order."""
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    x, y = (np.concatenate(part) for part in zip(*batches))
    model.fit(x, y, batch_size=len(batches[0][1]), epochs=1, shuffle=False, verbose=0)
    return [v.numpy() for v in model.weights]
