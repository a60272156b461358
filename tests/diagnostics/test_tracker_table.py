"""MemoryTracker.table() and its per-module figures are computed in one pass over the events; this
checks them against the straightforward computation (each module's interval of events replayed on
its own: the implementation before the one-pass one, kept here as the reference) on llmmem's GPT,
plain and with checkpointed blocks, over several steps."""

from __future__ import annotations

import bisect
from collections import defaultdict

import pytest
import torch
from support.diagnostics import checkpoint_blocks, gpt_step, tiny_gpt

from llmmem.diagnostics.tracker import MemoryTracker, _ancestors

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _series(tracker, dev: str) -> list[int]:
    out, total = [], 0
    for ri, delta in zip(tracker._ev_rec, tracker._ev_delta):
        if tracker._records[ri].device == dev:
            total += delta
        out.append(total)
    return out


def _modules_by_replay(tracker) -> list[dict]:
    dev = tracker.device
    names: dict[str, dict] = {}

    def row(name: str) -> dict:
        if name not in names:
            names[name] = {
                "module": name,
                "parameters": 0,
                "kept_for_backward": 0,
                "forward_peak": None,
                "backward_peak": None,
                "recompute_peak": None,
                "recomputed": 0,
            }
        return names[name]

    for root in tracker.roots():
        for sub in root.modules():
            name = tracker._names.get(sub)
            if name is None:
                continue
            seen, total = set(), 0
            for p in sub.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.untyped_storage().nbytes()
            row(name)["parameters"] = total
    kept: dict[tuple, int] = defaultdict(int)
    for rec in tracker._records:
        if rec.device != dev or not rec.module:
            continue
        if rec.category == "activations" and rec.phase == "forward":
            start = tracker._bw_start.get(rec.step)
            if start is not None and rec.alloc < start and (rec.free is None or rec.free >= start):
                for a in _ancestors(rec.module):
                    kept[(a, rec.step)] += rec.nbytes
    for (name, _), nbytes in kept.items():
        r = row(name)
        r["kept_for_backward"] = max(r["kept_for_backward"], nbytes)
    totals = _series(tracker, dev)
    allocs = [rec.alloc for rec in tracker._records]
    enclosing: dict[tuple, int] = defaultdict(int)
    for name, phase, step, start, end, outermost in tracker._intervals:
        end = tracker.events if end is None else end
        if phase == "recompute":
            left = 0
            for rec in tracker._records[bisect.bisect_left(allocs, start) : bisect.bisect_left(allocs, end)]:
                if rec.device == dev and rec.phase == "recompute" and (rec.free is None or rec.free >= end):
                    left += rec.nbytes
            r = row(name)
            r["recomputed"] = max(r["recomputed"], left)
            if outermost:
                for a in list(_ancestors(name))[:-1]:
                    enclosing[(a, step)] += left
        lo = max(0, start - 1)
        segment = totals[lo : max(end, lo + 1)]
        value = max(segment) if segment else 0
        r = row(name)
        key = f"{phase}_peak"
        r[key] = value if r[key] is None else max(r[key], value)
    for (name, _), nbytes in enclosing.items():
        r = row(name)
        r["recomputed"] = max(r["recomputed"], nbytes)
    return list(names.values())


def _phase_peaks_by_replay(tracker) -> dict:
    totals = _series(tracker, tracker.device)
    out: dict[str, int] = {}
    for span in tracker.phases():
        segment = totals[span["start"] : span["end"]]
        if segment:
            out[span["phase"]] = max(out.get(span["phase"], 0), max(segment))
    return out


def _tracked(checkpointed: bool) -> MemoryTracker:
    model, opt = tiny_gpt(layers=3)
    if checkpointed:
        checkpoint_blocks(model)
    with MemoryTracker(model, opt, stacks=False) as tracker:
        for _ in range(3):
            gpt_step(model, opt, 2)
        idx = torch.randint(0, 256, (2, 64))
        _, loss = model(idx, targets=idx)  # a forward left open: intervals without an end
    del loss
    return tracker


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_table_and_module_figures_equal_the_replayed_ones(checkpointed, monkeypatch):
    tracker = _tracked(checkpointed)
    reference = _modules_by_replay(tracker)
    assert len(reference) > 10 and any(r["backward_peak"] for r in reference)
    if checkpointed:
        assert any(r["recomputed"] for r in reference) and any(r["recompute_peak"] for r in reference)
    assert tracker.modules() == reference
    assert tracker.phase_peaks() == _phase_peaks_by_replay(tracker)
    text = tracker.table(top=50)
    monkeypatch.setattr(tracker, "modules", lambda device=None: _modules_by_replay(tracker))
    monkeypatch.setattr(tracker, "phase_peaks", lambda device=None: _phase_peaks_by_replay(tracker))
    assert text == tracker.table(top=50)
    assert "GPT.blocks.2" in text
