"""Seeing where memory goes: ``python -m llmmem info`` (what llmmem and the process have),
:class:`MemoryTracker` (bytes per module x phase x category over a step, with a timeline picture),
:func:`oom_report` (an out-of-memory error turned into what was live and what to change),
:func:`find_batch_size` (the largest batch that fits, tried under a cap and checked both ways) and :func:`monitor`
(a background memory sampler). Only ``info`` is imported eagerly: it must work where torch is
broken; the others load torch when first used."""

from __future__ import annotations

import importlib

from llmmem.diagnostics.info import info

__all__ = ["info", "MemoryTracker", "oom_report", "find_batch_size", "monitor"]

_LAZY = {
    "MemoryTracker": "llmmem.diagnostics.tracker",
    "oom_report": "llmmem.diagnostics.oom",
    "find_batch_size": "llmmem.diagnostics.batch_size",
    "monitor": "llmmem.diagnostics.monitor",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmmem.diagnostics' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
