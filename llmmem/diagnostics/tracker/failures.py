"""What counts as an out-of-memory error, and how its text is read (the tracker's failure snapshot
and the OOM report share these)."""

from __future__ import annotations

import re

import torch

__all__ = ["OOM_TEXTS", "is_out_of_memory", "step_text", "requested_bytes"]

# The CPU allocator's error text (c10/core/alloc_cpu.cpp) and the text of an installed llmmem pool's
# out-of-memory (llmmem.pool.torch_allocator); torch's own CUDA OOM is a torch.OutOfMemoryError.
OOM_TEXTS = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory", "out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: torch's ``torch.OutOfMemoryError`` (CUDA and
    other accelerators), llmmem's :class:`llmmem.OutOfMemoryError` (pools, the tracker's budget),
    Python's ``MemoryError``, or a ``RuntimeError`` with the CPU allocator's or an installed llmmem
    pool's message."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(t in text for t in OOM_TEXTS)
    return False


def step_text(step: int) -> str:
    """A step number as reports print it: ``"step 3"``; the tracker's step -1 (no training step
    had begun: no outermost module's forward had run under the tracker) as ``"outside a tracked step"``."""
    return f"step {step}" if step >= 0 else "outside a tracked step"


def requested_bytes(message: str):
    """The request size in an allocator's message ("Tried to allocate 2.00 GiB", "allocate 4096 bytes")."""
    m = re.search(r"[Tt]ried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB|bytes)", message)
    if m is None:
        m = re.search(r"allocat\w* ([0-9]+) bytes", message)
        return int(m.group(1)) if m else None
    unit = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * unit)
