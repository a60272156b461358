"""Which batch :func:`llmmem.find_batch_size` tries next: a model of the peak fitted to the trials
that fit, kept inside the bracket the trials have established.

The peak of a training step is a sum of sizes proportional to the batch (activations), to its
square (attention scores over a sequence that grows with it) and constant (model state), taken at
whichever moment of the step is largest, and rounded by an allocator: piecewise linear, quadratic
or step-shaped. So:

- before any trial failed, the line through the two largest fitting trials is extrapolated to the
  budget (a jump of any size is cheap: a trial that would cross the cap stops at its first
  allocation that would); while the peak does not grow, the batch doubles;
- once one failed, the answer lies between the largest fit ``lo`` and the smallest failure ``hi``.
  The next trial is the model's answer (the line, or the parabola through the three largest fits
  when it also predicts the fourth) when that lies strictly inside; otherwise, and whenever two
  trials have not halved the bracket, the middle (the geometric middle while ``hi > 4 lo``);
- it ends when ``lo + 1`` has failed (or ``lo`` is ``high``): the answer is then checked both ways.
"""

from __future__ import annotations

import math

__all__ = ["BatchSearch", "quadratic_root"]

# a parabola through the three largest fits is trusted when it predicts the fourth within this
# fraction of the peak's range over the four (the peaks are exact byte counts on the CPU)
_QUADRATIC_TOLERANCE = 0.02


def quadratic_root(points, budget: float) -> float | None:
    """The batch at which the parabola through ``points`` (three ``(batch, peak)``, batches
    distinct) reaches ``budget`` on its rising side, or None when it is not convex or never does."""
    (x1, y1), (x2, y2), (x3, y3) = points
    d1, d2 = (y2 - y1) / (x2 - x1), (y3 - y2) / (x3 - x2)
    c = (d2 - d1) / (x3 - x1)
    if c <= 0:
        return None
    b = d2 - c * (x2 + x3)
    a = y3 - b * x3 - c * x3 * x3
    disc = b * b - 4 * c * (a - budget)
    if disc < 0:
        return None
    return (-b + math.sqrt(disc)) / (2 * c)


def _parabola_predicts(points) -> bool:
    if len(points) < 4:
        return True
    (x1, y1), (x2, y2), (x3, y3) = points[-3:]
    d1, d2 = (y2 - y1) / (x2 - x1), (y3 - y2) / (x3 - x2)
    c = (d2 - d1) / (x3 - x1)
    x0, y0 = points[-4]
    predicted = y2 + d2 * (x0 - x2) + c * (x0 - x2) * (x0 - x3)
    return abs(predicted - y0) <= _QUADRATIC_TOLERANCE * (y3 - y0)


class BatchSearch:
    """The state of a search between ``low`` and ``high`` (None: no limit) for ``budget`` bytes:
    :meth:`propose` the next batch, :meth:`record` its outcome, until :attr:`done`.

    ``lo`` is the largest batch that fit, ``hi`` the smallest that did not (None: none failed yet);
    ``fits`` maps the batches that fit in a steady state to their peaks (bytes)."""

    def __init__(self, low: int, high: int | None, budget: int) -> None:
        self.low, self.high, self.budget = low, high, budget
        self.lo, self.hi = low, None
        self.fits: dict[int, int] = {}
        self._widths: list[int] = []  # hi - lo after each trial since the first failure

    @property
    def done(self) -> bool:
        return self.lo == self.high or (self.hi is not None and self.hi == self.lo + 1)

    def record(self, batch: int, fits: bool, peak: int | None = None, *, steady: bool = True) -> None:
        """The outcome of the trial at ``batch``: whether it ``fits`` and its ``peak`` (bytes; used
        when it fits and is ``steady``, i.e. like the steps after it)."""
        if fits:
            if batch < self.lo or (self.hi is not None and batch >= self.hi):
                raise ValueError(f"BatchSearch.record: batch {batch} fit, outside the bracket ({self.lo}, {self.hi})")
            self.lo = batch
            if steady and peak is not None:
                self.fits[batch] = peak
        else:
            if batch <= self.lo:
                raise ValueError(f"BatchSearch.record: batch {batch} did not fit, but {self.lo} did")
            if self.hi is None or batch < self.hi:
                self.hi = batch
        if self.hi is not None:
            self._widths.append(self.hi - self.lo)

    def _model(self) -> int | None:
        points = sorted(self.fits.items())
        if len(points) < 2:
            return None
        (b1, p1), (b2, p2) = points[-2:]
        slope = (p2 - p1) / (b2 - b1)
        if slope <= 0:
            return None
        guess = b2 + (self.budget - p2) / slope
        # Beyond the fits a convex peak rises above the line: once a failure has bounded the
        # search, the parabola, when it explains the trials, is the better guess.
        if self.hi is not None and len(points) >= 3 and _parabola_predicts(points):
            root = quadratic_root(points[-3:], self.budget)
            if root is not None:
                guess = min(guess, root)
        return max(math.floor(guess), self.lo + 1)

    def propose(self) -> int:
        """The next batch to try: strictly between ``lo`` and ``hi`` (or above ``lo``, at most ``high``)."""
        if self.done:
            raise ValueError(
                f"BatchSearch.propose: the search is over ({self.lo} fits, {self.hi or self.high} is the end)"
            )
        lo, hi, widths = self.lo, self.hi, self._widths
        guess = self._model()
        if hi is None:
            nxt = guess if guess is not None else 2 * lo
            return nxt if self.high is None else min(nxt, self.high)
        stalled = len(widths) >= 3 and widths[-1] > widths[-3] / 2
        # the model's check of its own answer (lo + 1) goes ahead, unless it is how lo crept up already
        crawling = len(widths) >= 3 and widths[-3] - widths[-1] <= 2
        if guess is not None and guess < hi and (not stalled or (guess == lo + 1 and not crawling)):
            return guess
        return math.isqrt(lo * hi) if hi > 4 * lo else (lo + hi) // 2
