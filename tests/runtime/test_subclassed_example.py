"""examples/subclassed_model.py runs, at a small size, and its model learns."""
from tests.helpers.subclassed import example


def test_the_subclassed_model_example_trains_its_model_cut_into_stages():
    losses = example()["main"](stages=2, epochs=2, blocks=1, length=8, vocabulary=16)
    assert len(losses) == 2 and losses[1] < losses[0]
