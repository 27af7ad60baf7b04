"""examples/subclassed_model.py runs, at a small size, and its model learns."""
import pathlib
import runpy


def test_the_subclassed_model_example_trains_its_model_cut_into_stages():
    path = pathlib.Path(__file__).parents[2] / "examples" / "subclassed_model.py"
    main = runpy.run_path(str(path))["main"]
    losses = main(stages=2, epochs=2, blocks=1, length=8, vocabulary=16)
    assert len(losses) == 2 and losses[1] < losses[0]
