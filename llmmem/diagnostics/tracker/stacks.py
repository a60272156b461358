"""Where a storage was made: the innermost user frames (torch, llmmem's diagnostics and
``contextlib``/``functools``/``threading`` frames skipped), as ``(file, line, function)`` tuples."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading

import torch

__all__ = ["SKIP_DIRS", "SKIP_FILES", "where"]

# Frames in these folders and files are skipped when summarising where a tensor was made: torch's,
# and llmmem.diagnostics' (the folder above this package).
SKIP_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    "<",
)
SKIP_FILES = frozenset(os.path.abspath(m.__file__) for m in (contextlib, functools, threading))


def where(cache: dict) -> tuple:
    """The three innermost frames outside :data:`SKIP_DIRS` and :data:`SKIP_FILES`, from the
    caller outward; ``cache`` keeps one tuple per line (``(code, line) -> frame``) and one per
    distinct summary (records made on the same lines share it)."""
    frames = []
    f = sys._getframe(1)
    depth = 0
    while f is not None and depth < 100:
        code = f.f_code
        if not code.co_filename.startswith(SKIP_DIRS) and code.co_filename not in SKIP_FILES:
            key = (code, f.f_lineno)
            frame = cache.get(key)
            if frame is None:
                frame = cache[key] = (code.co_filename, f.f_lineno, code.co_name)
            frames.append(frame)
            if len(frames) == 3:
                break
        f = f.f_back
        depth += 1
    frames = tuple(frames)
    return cache.setdefault(frames, frames)
