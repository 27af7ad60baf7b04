import itertools
import random

import pytest

from hetpipe_tf.partitioner import balanced_boundaries


def _brute(costs, k, speeds, allowed):
    best = None
    for cuts in itertools.combinations(sorted(allowed), k - 1):
        b = (0,) + cuts
        ends = cuts + (len(costs),)
        t = max(sum(costs[lo:hi]) / v for lo, hi, v in zip(b, ends, speeds))
        if best is None or t < best[0] - 1e-12:
            best = (t, b)
    return best[0]


@pytest.mark.parametrize("seed", range(25))
def test_dynamic_program_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    k = rng.randint(1, min(4, n))
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    speeds = [rng.choice([0.5, 1.0, 2.0]) for _ in range(k)]
    allowed = [c for c in range(1, n) if rng.random() < 0.8] or list(range(1, n))
    if len(allowed) < k - 1:
        allowed = list(range(1, n))
    b = balanced_boundaries(costs, k, allowed_cuts=allowed, speeds=speeds)
    ends = b[1:] + (n,)
    got = max(sum(costs[lo:hi]) / v for lo, hi, v in zip(b, ends, speeds))
    assert got == pytest.approx(_brute(costs, k, speeds, allowed))
    assert b[0] == 0 and set(b[1:]) <= set(allowed)


def test_errors():
    with pytest.raises(ValueError, match="only 1 cut points"):
        balanced_boundaries([1, 1, 1], 3, allowed_cuts=[1])
    with pytest.raises(ValueError, match="speeds"):
        balanced_boundaries([1, 1], 2, speeds=[1.0])
    with pytest.raises(ValueError, match="num_stages"):
        balanced_boundaries([1], 0)
