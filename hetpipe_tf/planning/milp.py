"""Mixed-integer linear programs of the planner, solved by HiGHS (scipy.optimize.milp; §7 uses
CPLEX): the memory-constrained partition (:func:`hetpipe_tf.planning.partitioner.partition_milp`)
and HD's least spread (:func:`hetpipe_tf.planning.allocation.hybrid_distribution`).

Pure Python over numpy and scipy: a program is its constraint rows, added one at a time as
sparse (variable, coefficient) lists, then solved with a zero gap (an optimum, not a bound)."""
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator

import numpy as np
import numpy.typing as npt


class Program:
    """min cost . x subject to low <= row . x <= high for every row added, lower <= x <= upper,
    x integer where `integrality` is 1."""

    def __init__(self, num_variables: int) -> None:
        self.num_variables = num_variables
        self.rows: list[npt.NDArray[np.float64]] = []
        self.low: list[float] = []
        self.high: list[float] = []

    def add(self, coefficients: Iterable[tuple[int, float]], low: float, high: float) -> None:
        """One row: sum of coefficient * x[index] over the (index, coefficient) pairs."""
        row = np.zeros(self.num_variables)
        for i, v in coefficients:
            row[i] += v
        self.rows.append(row)
        self.low.append(low)
        self.high.append(high)

    def solve(self, cost: npt.ArrayLike, integrality: npt.ArrayLike, lower: npt.ArrayLike, upper: npt.ArrayLike,
              time_limit: float | None = None) -> npt.NDArray[np.float64] | None:
        """The optimal x, or None if there is none (within `time_limit` seconds)."""
        from scipy.optimize import Bounds, LinearConstraint, milp  # late: slow to load: only plans that solve one pay

        options = {"mip_rel_gap": 0.0, **({"time_limit": time_limit} if time_limit else {})}
        with _quiet_stdout():  # HiGHS prints debug lines of its own
            res = milp(cost, constraints=LinearConstraint(np.array(self.rows), self.low, self.high),
                       integrality=integrality, bounds=Bounds(lower, upper), options=options)
        x: npt.NDArray[np.float64] | None = res.x
        return x


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silences file descriptor 1 (C-level prints) for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
