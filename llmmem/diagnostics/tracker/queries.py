"""Reading a :class:`~llmmem.diagnostics.tracker.MemoryTracker`: bytes now, at the peak, by
category over the events, per phase and per module."""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict

import torch

from llmmem.diagnostics.live import device_key
from llmmem.diagnostics.tracker.records import CATEGORIES, Record, ancestors
from llmmem.diagnostics.tracker.series import span_maxima
from llmmem.dtensors import local

__all__ = ["TrackerQueries"]


class TrackerQueries:
    """The reading methods of :class:`~llmmem.diagnostics.tracker.MemoryTracker` (mixed into it)."""

    def current(self, device=None) -> dict:
        """Bytes live now on ``device`` (default: the tracker's), by category."""
        self.live.flush()
        totals = self._totals.get(self._dev(device))
        return dict(totals) if totals is not None else dict.fromkeys(CATEGORIES, 0)

    def peak_bytes(self, device=None) -> int:
        """The most bytes live at once on ``device`` since the tracker started."""
        self.live.flush()
        peak = self._peak.get(self._dev(device))
        return peak["bytes"] if peak else 0

    def peak(self, device=None) -> dict:
        """The peak on ``device``: ``bytes``, ``event``, ``phase``, ``module`` (innermost module
        running), ``step`` and ``categories`` (bytes by category at that moment)."""
        self.live.flush()
        dev = self._dev(device)
        peak = dict(self._peak.get(dev) or {"bytes": 0, "event": -1, "phase": "other", "module": "", "step": -1})
        if peak["event"] < 0:
            peak["categories"] = dict.fromkeys(CATEGORIES, 0)
        elif self.timeline_enabled:
            peak["categories"] = self.categories_at(peak["event"], dev)
        return peak

    def roots(self) -> list:
        """The outermost modules seen (the model first when given)."""
        return [m for m in (r() for r in self._roots) if m is not None]

    def batch_and_seq(self):
        """``(batch, seq)`` read off the last step's token ids (its ``input_ids`` keyword, else the
        first 2-D integer input of the outermost module), or None."""
        named = self.named_inputs.get("input_ids")
        for shape, dtype in ([named] if named is not None else []) + self.input_shapes:
            if len(shape) == 2 and not dtype.is_floating_point and dtype != torch.bool:
                return shape
        return None

    def devices(self) -> list[str]:
        """Devices on which the tracker saw storages (host memory of offloaded tensors included)."""
        self.live.flush()
        return sorted(set(self._dev_total) | {self.device})

    def _dev(self, device) -> str:
        if device is None:
            return self.device
        return (
            device
            if isinstance(device, str) and (device == "cpu" or ":" in device)
            else device_key(torch.device(device))
        )

    def _require_timeline(self, what: str) -> None:
        if not self.timeline_enabled:
            raise RuntimeError(f"MemoryTracker.{what} needs the event timeline; create the tracker with timeline=True")

    def categories_at(self, event: int, device=None) -> dict:
        """Bytes by category on ``device`` just after event ``event`` (final categories)."""
        self.live.flush()
        self._require_timeline("categories_at")
        dev = self._dev(device)
        totals = dict.fromkeys(CATEGORIES, 0)
        recs = self._records
        for ri, delta in zip(self._ev_rec[: event + 1], self._ev_delta[: event + 1]):
            rec = recs[ri]
            if rec.device == dev:
                totals[rec.category] += delta
        return totals

    def timeline(self, device=None) -> tuple[list, dict]:
        """``(events, {category: bytes})``: the bytes live on ``device`` after each of its events."""
        self.live.flush()
        self._require_timeline("timeline")
        dev = self._dev(device)
        recs = self._records
        totals = dict.fromkeys(CATEGORIES, 0)
        xs: list[int] = []
        ys: dict[str, list] = {c: [] for c in CATEGORIES}
        for i, (ri, delta) in enumerate(zip(self._ev_rec, self._ev_delta)):
            rec = recs[ri]
            if rec.device != dev:
                continue
            totals[rec.category] += delta
            xs.append(i)
            for c in CATEGORIES:
                ys[c].append(totals[c])
        return xs, ys

    def phases(self) -> list[dict]:
        """Phase spans in event order: ``phase``, ``step``, ``start`` and ``end`` events."""
        self.live.flush()
        spans = []
        marks = self._phase_marks + [(self.events, None, None)]
        for (start, phase, step), (end, _, _) in zip(marks, marks[1:]):
            if end > start:
                if spans and spans[-1]["phase"] == phase and spans[-1]["step"] == step and spans[-1]["end"] == start:
                    spans[-1]["end"] = end
                else:
                    spans.append({"phase": phase, "step": step, "start": start, "end": end})
        return spans

    def end_of_forward(self, device=None):
        """Bytes by category when the last step's backward started (None before any backward)."""
        self.live.flush()
        if not self._bw_start:
            return None
        return self.categories_at(self._bw_start[max(self._bw_start)] - 1, device)

    def _largest(self, n: int, device=None) -> list[Record]:
        recs = [r for r in self._alive.values() if device is None or r.device == device]
        return sorted(recs, key=lambda r: -r.nbytes)[:n]

    def largest_tensors(self, n: int = 10, device=None) -> list[dict]:
        """The ``n`` largest live storages: bytes, shape, dtype, category, phase and module where
        made, step, and where (file:line, innermost user frames first)."""
        self.live.flush()
        return [r.describe() for r in self._largest(n, None if device is None else self._dev(device))]

    def _outlived(self) -> dict:
        """Storages made during an earlier step (forward, backward or recompute, not kept as a
        gradient, optimizer state or input) that are still alive: the "never freed" leak check."""
        old = [
            r
            for r in self._alive.values()
            if r.step < self._step and r.phase in ("forward", "backward", "recompute") and r.identity is None
        ]
        old.sort(key=lambda r: -r.nbytes)
        return {"bytes": sum(r.nbytes for r in old), "count": len(old), "largest": [r.describe() for r in old[:5]]}

    def outlived(self) -> dict:
        """Tensors made in an earlier step that are still alive (see :meth:`largest_tensors` for the
        fields): ``bytes``, ``count``, ``largest``."""
        with self._lock:
            return self._outlived()

    def live_by_module(self, device=None) -> dict:
        """Bytes live now by module where made or owned (self only, not submodules), by category."""
        self.live.flush()
        out: dict[str, dict] = {}
        for r in list(self._alive.values()):
            if device is not None and r.device != device:
                continue
            per = out.setdefault(r.module or "(outside modules)", {})
            per[r.category] = per.get(r.category, 0) + r.nbytes
        return dict(sorted(out.items(), key=lambda kv: -sum(kv[1].values())))

    def modules(self, device=None) -> list[dict]:
        """Per module (hierarchical names, submodules included in each figure):

        ``parameters`` (bytes of its parameters), ``kept_for_backward`` (activations made in its
        forward and alive when backward started; max over steps), ``forward_peak`` /
        ``backward_peak`` / ``recompute_peak`` (the most bytes live on the device while it ran in
        that phase), ``recomputed`` (bytes its forward, run again inside backward by activation
        checkpointing, made and left alive for backward: what checkpointing stopped keeping from
        the forward to the backward; max over its recomputes).
        """
        self.live.flush()
        self._require_timeline("modules")
        dev = self._dev(device)
        names: dict[str, dict] = {}

        def row(name: str) -> dict:
            r = names.get(name)
            if r is None:
                r = names[name] = {
                    "module": name,
                    "parameters": 0,
                    "kept_for_backward": 0,
                    "forward_peak": None,
                    "backward_peak": None,
                    "recompute_peak": None,
                    "recomputed": 0,
                }
            return r

        for ref in self._roots:
            root = ref()
            if root is None:
                continue
            for sub in root.modules():
                name = self._names.get(sub)
                if name is None:
                    continue
                seen, total = set(), 0
                for p in sub.parameters():
                    if p.device.type == "meta" or id(p) in seen:
                        continue
                    seen.add(id(p))
                    total += local(p).untyped_storage().nbytes()  # a DTensor's is a placeholder
                row(name)["parameters"] = total
        kept: dict[tuple, int] = defaultdict(int)
        for rec in self._records:
            if rec.device != dev or not rec.module:
                continue
            if rec.category == "activations" and rec.phase == "forward":
                start = self._bw_start.get(rec.step)
                if start is not None and rec.alloc < start and (rec.free is None or rec.free >= start):
                    for a in ancestors(rec.module):
                        kept[(a, rec.step)] += rec.nbytes
        for (name, _), nbytes in kept.items():
            r = row(name)
            r["kept_for_backward"] = max(r["kept_for_backward"], nbytes)
        totals = self._total_series(dev)
        n = len(totals)
        # The device's peak while each module ran: the events from the one before it entered to the
        # one before it left, all answered in one pass over the series.
        spans = []
        for _, _, _, start, end, _ in self._intervals:
            lo = max(0, start - 1)
            spans.append((lo, min(n, max(self.events if end is None else end, lo + 1))))
        peaks = span_maxima(totals, spans)
        allocs = [rec.alloc for rec in self._records]  # increasing: records are made in event order
        enclosing: dict[tuple, int] = defaultdict(int)  # (ancestor, step) -> bytes recomputed under it
        for (name, phase, step, start, end, outermost), value in zip(self._intervals, peaks):
            end = self.events if end is None else end
            if phase == "recompute":
                left = 0
                for rec in self._records[bisect.bisect_left(allocs, start) : bisect.bisect_left(allocs, end)]:
                    if rec.device == dev and rec.phase == "recompute" and (rec.free is None or rec.free >= end):
                        left += rec.nbytes
                r = row(name)
                r["recomputed"] = max(r["recomputed"], left)
                if outermost:
                    for a in list(ancestors(name))[:-1]:
                        enclosing[(a, step)] += left
            r = row(name)
            key = f"{phase}_peak"
            r[key] = value if r[key] is None else max(r[key], value)
        for (name, _), nbytes in enclosing.items():
            r = row(name)
            r["recomputed"] = max(r["recomputed"], nbytes)
        return list(names.values())

    def _total_series(self, dev: str) -> list[int]:
        """Bytes live on ``dev`` after every event (all devices' events, so indices are event numbers).
        Kept until the next event: :meth:`table` reads it for the modules and the phases."""
        cached = self._series
        if cached is not None and cached[0] == dev and cached[1] == self.events:
            return cached[2]
        if set(self._dev_total) <= {dev}:  # every event is on dev
            out = list(itertools.accumulate(self._ev_delta))
        else:
            recs = self._records
            out = list(
                itertools.accumulate(d if recs[ri].device == dev else 0 for ri, d in zip(self._ev_rec, self._ev_delta))
            )
        self._series = (dev, self.events, out)
        return out

    def phase_peaks(self, device=None) -> dict:
        """The most bytes live on ``device`` during each phase."""
        self.live.flush()
        self._require_timeline("phase_peaks")
        dev = self._dev(device)
        totals = self._total_series(dev)
        n = len(totals)
        spans = [span for span in self.phases() if span["start"] < min(n, span["end"])]
        out: dict[str, int] = {}
        for span, value in zip(spans, span_maxima(totals, [(s["start"], min(n, s["end"])) for s in spans])):
            out[span["phase"]] = max(out.get(span["phase"], 0), value)
        return out
