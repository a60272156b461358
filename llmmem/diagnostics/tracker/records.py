"""The tracker's record of one storage, its categories and phases (see :mod:`llmmem.diagnostics.tracker`)."""

from __future__ import annotations

import os

__all__ = ["CATEGORIES", "PHASES", "IDENTITY_RANK", "Record", "category_of", "ancestors"]


CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "inputs",
    "activations",
    "temporaries",
    "other",
)
PHASES = ("forward", "backward", "recompute", "optimizer", "other")
# An identity wins over a weaker one: a parameter saved for backward stays a parameter.
IDENTITY_RANK = {"parameters": 0, "buffers": 1, "gradients": 2, "optimizer_state": 3, "inputs": 4}


class Record:
    """One storage seen by the tracker. ``alloc``/``free`` are event indices (``free`` None while live)."""

    __slots__ = (
        "index",
        "device",
        "nbytes",
        "alloc",
        "free",
        "phase",
        "module",
        "step",
        "identity",
        "saved",
        "category",
        "stack",
        "shape",
        "dtype",
    )

    def describe(self) -> dict:
        return {
            "bytes": self.nbytes,
            "device": self.device,
            "category": self.category,
            "shape": list(self.shape),
            "dtype": str(self.dtype).replace("torch.", ""),
            "phase": self.phase,
            "module": self.module,
            "step": self.step,
            "where": ["(made before tracking)"]
            if self.stack is None
            else [f"{os.path.basename(f)}:{line} in {fn}" for f, line, fn in self.stack],
        }


def category_of(rec: Record) -> str:
    if rec.identity is not None:
        return rec.identity
    if rec.saved or rec.phase == "recompute":
        return "activations"
    return "other" if rec.phase == "other" else "temporaries"


def ancestors(name: str):
    """``"A.b.c"`` -> ``"A"``, ``"A.b"``, ``"A.b.c"``."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])
