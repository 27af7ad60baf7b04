"""The models tests/planning/test_profile.py imports from here (it is the planner's to change): the
tests' models are tests/helpers/models.py. This file goes once that test imports them from there."""
from tests.helpers.models import cnn, mlp, resnet_block  # noqa: F401
