"""HetPipeStrategy.scope() takes the models compiled in it and no others: not those of another
thread compiling at the same time, and in nested scopes only the innermost's."""
import threading

import keras

from hetpipe_tf.api.strategy import HetPipeStrategy


def _model() -> keras.Model:
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2)(inputs))


def _compile(model: keras.Model) -> None:
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")


def _strategy() -> HetPipeStrategy:
    return HetPipeStrategy(cluster="local", policy="ed", launch="in_process", dilation=1)


def _taken(model: keras.Model) -> bool:
    """True when a strategy replaced the model's fit (a model Keras alone compiled keeps its own)."""
    return "fit" in vars(model)


def test_a_thread_outside_the_scope_compiles_a_plain_model_while_another_is_inside():
    strategy = _strategy()
    inside_entered, outside_done = threading.Event(), threading.Event()
    models: dict[str, keras.Model] = {}
    errors: list[BaseException] = []

    def inside() -> None:
        try:
            with strategy.scope():
                inside_entered.set()
                # Stay in the scope until the other thread has compiled.
                assert outside_done.wait(60)
                models["inside"] = _model()
                _compile(models["inside"])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def outside() -> None:
        try:
            assert inside_entered.wait(60)
            models["outside"] = _model()
            _compile(models["outside"])
        except BaseException as e:
            errors.append(e)
        finally:
            outside_done.set()

    threads = [threading.Thread(target=inside), threading.Thread(target=outside)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert _taken(models["inside"]) and id(models["inside"]) in strategy._compiled
    assert not _taken(models["outside"]) and id(models["outside"]) not in strategy._compiled
    # The plain model trains with Keras's own fit.
    history = models["outside"].fit(keras.ops.ones((8, 4)), keras.ops.zeros((8, 2)), epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1


def test_nested_scopes_attach_to_the_innermost_and_the_outer_takes_over_again():
    outer, inner = _strategy(), _strategy()
    with outer.scope():
        first = _model()
        _compile(first)
        with inner.scope():
            second = _model()
            _compile(second)
        third = _model()
        _compile(third)
    after = _model()
    _compile(after)
    assert id(first) in outer._compiled and id(third) in outer._compiled and id(second) not in outer._compiled
    assert list(inner._compiled) == [id(second)]
    assert not _taken(after) and id(after) not in outer._compiled


def test_the_same_strategy_entered_twice_keeps_its_models_after_the_inner_exit():
    strategy = _strategy()
    with strategy.scope():
        with strategy.scope():
            first = _model()
            _compile(first)
        second = _model()
        _compile(second)
    assert {id(first), id(second)} <= set(strategy._compiled)
