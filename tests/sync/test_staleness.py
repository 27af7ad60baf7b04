import pytest

from hetpipe_tf.sync.staleness import Bounds, StalenessViolation, check


def test_seed_001_example():
    b = Bounds(num_in_flight=4, staleness_bound=0)
    assert (b.s_local, b.s_global) == (3, 6)
    assert b.waves_required(7) == set()  # the first (D+1) waves and s_local more start freely
    assert b.waves_required(11) == {0}  # minibatch 11: the global updates of 1..4
    assert b.waves_required(12) == {0, 1}  # minibatch 12 waits for wave 1 of every worker
    assert b.local_required(11) == {1, 2, 3, 4, 5, 6, 7}


def test_check_accepts_what_wsp_guarantees_and_names_what_is_missing():
    ok = {(0, 11): (range(1, 8), {(1, 0)}), (0, 12): (range(1, 9), {(1, 0), (1, 1)}),
          (1, 3): ((), set())}
    assert check(ok, num_in_flight=4, staleness_bound=0, num_workers=2) == 3
    bad = {(0, 12): (range(1, 9), {(1, 0)}), (1, 6): ((1,), set())}
    with pytest.raises(StalenessViolation, match=r"worker 0 minibatch 12: global updates \(worker, wave\) "
                                                 r"\[\(1, 1\)\] missing; worker 1 minibatch 6: local updates \[2\] missing"):
        check(bad, num_in_flight=4, staleness_bound=0, num_workers=2)


@pytest.mark.parametrize("d", [0, 1, 4])
def test_larger_d_allows_more_global_staleness(d):
    b = Bounds(num_in_flight=3, staleness_bound=d)
    first = (d + 1) * 3 + 2 + 1  # the first minibatch with a global requirement
    assert b.waves_required(first - 1) == set() and b.waves_required(first) == {0}
