"""Maxima over stretches of the tracker's event series, and the thinning of a timeline for output."""

from __future__ import annotations

from llmmem.diagnostics.tracker.records import CATEGORIES

__all__ = ["CHUNK", "span_maxima", "reduce_points"]

CHUNK = 256  # events per precomputed maximum in span_maxima


def span_maxima(values: list, spans: list) -> list:
    """``max(values[lo:hi])`` (0 if empty) for every ``(lo, hi)`` in ``spans``. One pass over
    ``values`` takes the maximum of every chunk of ``CHUNK`` events; a span then reads at most two
    partial chunks and one maximum per whole chunk: O(len(values) + len(spans) * (CHUNK +
    span / CHUNK)), not the sum of the spans' lengths."""
    n, size = len(values), CHUNK
    chunks = [max(values[j : j + size]) for j in range(0, n, size)]
    out = []
    for lo, hi in spans:
        hi = min(hi, n)
        if hi <= lo:
            out.append(0)
        elif hi - lo <= 2 * size:
            out.append(max(values[lo:hi]))
        else:
            first, last = -(-lo // size), hi // size  # the whole chunks inside (at least one)
            top = max(chunks[first:last])
            if lo < first * size:
                top = max(top, max(values[lo : first * size]))
            if last * size < hi:
                top = max(top, max(values[last * size : hi]))
            out.append(top)
    return out


def reduce_points(xs: list, ys: dict, max_points: int) -> list[int]:
    """Indices of at most ``max_points`` points: the highest total of each equal stretch."""
    n = len(xs)
    if n <= max_points:
        return list(range(n))
    totals = [sum(ys[c][i] for c in CATEGORIES) for i in range(n)]
    keep = []
    per = n / max_points
    for k in range(max_points):
        lo, hi = int(k * per), min(n, int((k + 1) * per))
        if hi > lo:
            keep.append(max(range(lo, hi), key=totals.__getitem__))
    return keep
