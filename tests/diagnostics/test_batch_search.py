"""The choice of the next trial in find_batch_size, on peaks given as functions of the batch: the
search it drives always ends at the true largest batch (checked both ways), stays inside the
bracket the trials established, and takes few trials on linear and quadratic memory."""

from __future__ import annotations

import math
import random

import pytest

from llmmem.diagnostics.batch_search import BatchSearch, quadratic_root

SHAPES = {
    "linear": lambda b: 40e6 + 4.2e6 * b,
    "quadratic": lambda b: 1e5 + 3000 * b + 46 * b * b,
    "steps of 8": lambda b: 10e6 + 8e6 * math.ceil(b / 8),
    "line and steps": lambda b: 10e6 + 3e5 * b + 2e6 * math.ceil(b / 5),
    "two phases": lambda b: max(60e6 + 0.2e6 * b, 30e6 + 4e6 * b),  # optimizer step, then backward
}


def _search(peak, budget, *, low=1, high=None, warm=0.0):
    """find_batch_size's loop on a peak function; ``warm``: extra bytes of the first trial only."""
    search = BatchSearch(low, high, budget)
    trials = [low]
    assert peak(low) + warm <= budget
    search.record(low, True, peak(low) + warm, steady=not warm)
    while not search.done:
        b = search.propose()
        assert b > search.lo and (search.hi is None or b < search.hi) and (high is None or b <= high)
        trials.append(b)
        search.record(b, peak(b) <= budget, peak(b))
        assert len(trials) < 40
    return search.lo, trials


def _largest(peak, budget, low=1, high=None):
    b = low
    while peak(b + 1) <= budget and (high is None or b < high):
        b += 1
    return b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("warm", [0.0, 0.1])
def test_the_search_ends_at_the_true_largest_batch(shape, warm):
    peak = SHAPES[shape]
    rng = random.Random(0)
    counts = []
    for _ in range(60):
        budget = peak(1) * (1 + warm) * rng.uniform(1.5, 60)
        got, trials = _search(peak, budget, warm=warm * peak(1))
        assert got == _largest(peak, budget), (shape, budget, trials)
        assert got in trials and got + 1 in trials  # checked both ways
        counts.append(len(trials))
    counts.sort()
    median = counts[len(counts) // 2]
    # measured: linear 4 (5 with a first trial unlike the others), quadratic 6 (7), two phases 9-10,
    # step-shaped 11-13
    assert median <= {"linear": 5, "quadratic": 7, "two phases": 10}.get(shape, 14), counts


@pytest.mark.parametrize("low, high", [(3, 40), (5, 6), (2, 1000)])
def test_low_and_high_bound_the_trials(low, high):
    peak = SHAPES["linear"]
    for budget in (peak(low) + 1, peak(20) + 1, peak(high) + 1, peak(10 * high)):
        got, trials = _search(peak, budget, low=low, high=high)
        assert got == _largest(peak, budget, low, high)


def test_quadratic_root_is_exact_on_a_parabola():
    def f(b):
        return 7 + 3 * b + 2 * b * b

    root = quadratic_root([(1, f(1)), (5, f(5)), (9, f(9))], f(40))
    assert root == pytest.approx(40)
    assert quadratic_root([(1, 1), (2, 2), (3, 3)], 10) is None  # a line: no curvature
    assert quadratic_root([(1, 1), (2, 3), (3, 4)], 10) is None  # concave


def test_misuse_is_a_clear_error():
    search = BatchSearch(4, 5, 100)
    search.record(4, True, 10)
    search.record(5, False)
    assert search.done
    with pytest.raises(ValueError, match="search is over"):
        search.propose()
    with pytest.raises(ValueError, match="did not fit, but 4 did"):
        search.record(3, False)
    with pytest.raises(ValueError, match="outside the bracket"):
        search.record(7, True, 10)
