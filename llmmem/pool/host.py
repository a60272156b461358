"""How much host memory this process can still get: the figures the host pool checks before it
commits memory (``csrc/pool/host_limits.c``), for callers that must refuse work that cannot fit."""

from __future__ import annotations

import sys

from llmmem._native import native

__all__ = ["host_memory"]


def host_memory() -> dict:
    """``{"available", "total", "bound"}``: bytes this process can still commit (the least of
    ``MemAvailable + SwapFree``, the headroom under its cgroup's memory limit and ``RLIMIT_DATA``
    less what it uses; ``None`` when nothing known bounds it), the most it could ever have (RAM +
    swap, the cgroup's limit, ``RLIMIT_DATA``, ``RLIMIT_AS``; ``None`` when unknown) and what sets
    ``available`` (``"MemAvailable + SwapFree"``, ``"the cgroup's memory limit"``, ``"RLIMIT_DATA"``
    or ``"no limit known"``).

    Reads a few small files under /proc and /sys (tens of microseconds); no GPU, no torch.

    :raises ImportError: when the C core is not built.
    """
    available, total, bound = native.pool_host_memory()
    return {
        "available": None if available >= sys.maxsize else available,
        "total": None if total >= sys.maxsize else total,
        "bound": bound,
    }
