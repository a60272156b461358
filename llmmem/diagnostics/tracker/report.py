"""A :class:`~llmmem.diagnostics.tracker.MemoryTracker`'s outputs: the text table, the JSON
dictionary and the PNG."""

from __future__ import annotations

import json

from llmmem.diagnostics.tracker.environment import rank_text
from llmmem.diagnostics.tracker.failures import step_text
from llmmem.diagnostics.tracker.records import CATEGORIES
from llmmem.diagnostics.tracker.series import reduce_points
from llmmem.units import format_bytes

__all__ = ["TrackerReport"]


class TrackerReport:
    """The output methods of :class:`~llmmem.diagnostics.tracker.MemoryTracker` (mixed into it)."""

    def table(self, top: int = 10, depth: int | None = None) -> str:
        """A text report: the peak, bytes by category (at the peak, when backward started, now),
        the peak of each phase, CUDA allocator figures, and the ``top`` modules by bytes kept for
        backward (``depth`` limits how deep names go: 1 = the outermost module only)."""
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"MemoryTracker.table: top must be an int >= 0, got {top!r}")
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"MemoryTracker.table: depth must be None or an int >= 1, got {depth!r}")
        with self._lock:
            return self._table(top, depth)

    def _table(self, top: int, depth: int | None) -> str:
        dev = self.device
        peak = self.peak()
        lines = [f"MemoryTracker on {dev}{rank_text(self.rank)}: {self.steps} step(s), {self.events:,} events"]
        if peak["event"] >= 0:
            where = f"{peak['phase']}" + (f" of {peak['module']}" if peak["module"] else "")
            lines.append(
                f"peak {format_bytes(peak['bytes'])} ({peak['bytes']:,} B) at event {peak['event']:,}: {where}, "
                + step_text(peak["step"])
            )
        if self.budget is not None:
            lines.append(f"budget {format_bytes(self.budget)} ({self.budget:,} B)")
        columns = [("at peak", peak["categories"])]
        if self.timeline_enabled:
            eof = self.end_of_forward()
            if eof is not None:
                columns.append(("backward start", eof))
        columns.append(("now", self.current()))
        lines += ["", f"{'bytes by category':<20}" + "".join(f"{title:>16}" for title, _ in columns)]
        for cat in CATEGORIES:
            if any(col[cat] for _, col in columns):
                lines.append(f"  {cat:<18}" + "".join(f"{format_bytes(col[cat]):>16}" for _, col in columns))
        lines.append(f"  {'total':<18}" + "".join(f"{format_bytes(sum(col.values())):>16}" for _, col in columns))
        for other in self.devices():
            if other != dev:
                cats = self.current(other)
                held = ", ".join(f"{c} {format_bytes(b)}" for c, b in cats.items() if b)
                pk = self.peak_bytes(other)
                lines.append(
                    f"  on {other}: {format_bytes(sum(cats.values()))} now ({held or 'nothing'}), peak {format_bytes(pk)}"
                )
        if self.timeline_enabled:
            pp = self.phase_peaks()
            if pp:
                lines += ["", "peak by phase: " + ", ".join(f"{p} {format_bytes(b)}" for p, b in pp.items())]
        if self.cuda_samples:
            last = self.cuda_samples[-1]
            lines += [
                "",
                f"{dev} allocator: allocated {format_bytes(last['allocated'])} (max {format_bytes(last['max_allocated'])}),"
                f" reserved {format_bytes(last['reserved'])} (max {format_bytes(last['max_reserved'])}),"
                f" reserved but free {format_bytes(last['reserved'] - last['allocated'])}",
            ]
            if last.get("pool"):
                p = last["pool"]
                lines.append(
                    f"llmmem pool: reserved {format_bytes(p.get('reserved_bytes.current', 0))}, free "
                    f"{format_bytes(p.get('free_bytes', 0))}, largest free block {format_bytes(p.get('largest_free_block', 0))}"
                )
        if self.timeline_enabled and top:
            rows = [r for r in self.modules() if depth is None or r["module"].count(".") < depth]
            rows.sort(key=lambda r: (-r["kept_for_backward"], -(r["backward_peak"] or 0), r["module"]))
            rows = rows[:top]
            if rows:
                width = max(30, *(len(r["module"]) for r in rows))
                lines += [
                    "",
                    f"top {len(rows)} modules by bytes kept for backward (submodules included; a peak is the whole "
                    "device's while the module ran)",
                    f"{'module':<{width}} {'params':>11} {'kept for bw':>12} {'fwd peak':>11} {'bwd peak':>11} "
                    f"{'recomputed':>11}",
                ]
                for r in rows:
                    lines.append(
                        f"{r['module']:<{width}} {format_bytes(r['parameters']):>11} "
                        f"{format_bytes(r['kept_for_backward']):>12} {format_optional(r['forward_peak']):>11} "
                        f"{format_optional(r['backward_peak']):>11} {format_bytes(r['recomputed']):>11}"
                    )
        if self.failure is not None:
            f = self.failure
            lines += ["", f"out of memory in {f['phase']} of {f['module'] or '(no module)'}: {f['message']}"]
        return "\n".join(lines)

    def to_dict(self, max_points: int = 2000) -> dict:
        """Every figure, in bytes, JSON-ready; the timeline of the tracker's device is reduced to at
        most ``max_points`` events (each kept point is the highest of its stretch, so the peak stays)."""
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
            raise ValueError(f"MemoryTracker.to_dict: max_points must be an int >= 2, got {max_points!r}")
        with self._lock:
            out = {
                "device": self.device,
                "devices": self.devices(),
                "rank": self.rank,
                "steps": self.steps,
                "events": self.events,
                "budget": self.budget,
                "peak": self.peak(),
                "peaks": {d: self.peak_bytes(d) for d in self.devices()},
                "now": {d: self.current(d) for d in self.devices()},
                "cuda": list(self.cuda_samples),
                "failure": self.failure,
                "largest": self.largest_tensors(10),
                "outlived": self._outlived(),
            }
            if self.timeline_enabled:
                xs, ys = self.timeline()
                keep = reduce_points(xs, ys, max_points)
                out.update(
                    end_of_forward=self.end_of_forward(),
                    phases=self.phases(),
                    phase_peaks=self.phase_peaks(),
                    modules=self.modules(),
                    timeline={
                        "device": self.device,
                        "event": [xs[i] for i in keep],
                        "categories": {c: [ys[c][i] for i in keep] for c in CATEGORIES},
                    },
                )
        return out

    def to_json(self, path, max_points: int = 2000) -> None:
        """Writes :meth:`to_dict` to ``path`` as JSON."""
        data = self.to_dict(max_points=max_points)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=1, default=str)

    def plot(self, path, *, device=None, title: str | None = None, max_points: int = 4000) -> None:
        """Writes a PNG: the bytes live on ``device`` over the events, stacked by category, with the
        phases marked, the peak annotated (and the budget and CUDA reserved bytes when known).
        Needs matplotlib; uses its Agg canvas (no display, no pyplot state)."""
        from llmmem.diagnostics.plot import plot_tracker

        self._require_timeline("plot")
        with self._lock:
            plot_tracker(self, path, device=self._dev(device), title=title, max_points=max_points)


def format_optional(value) -> str:
    return "-" if value is None else format_bytes(value)
