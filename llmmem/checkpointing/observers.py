"""Observers of the tensors a checkpointing mode keeps outside autograd's saved-tensor hooks.

Selective recompute, cheap rematerialisation and offload keep some tensors where an outer
``saved_tensors_hooks`` cannot see them; they report each one here, so that whoever measures what a
block keeps (:class:`llmmem.checkpointing.meters.measure_saved_bytes`) counts it, on the memory it
is kept in. One list of observers per thread.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

__all__ = ["notify_kept", "observe_kept"]

_observers = threading.local()


def notify_kept(tensor: torch.Tensor) -> None:
    """Tell this thread's observers that ``tensor`` is kept for backward."""
    for observe in getattr(_observers, "active", ()):
        observe(tensor)


@contextlib.contextmanager
def observe_kept(callback: Callable[[torch.Tensor], None]):
    """Inside: ``callback(tensor)`` for every tensor reported by :func:`notify_kept` on this thread."""
    active = _observers.__dict__.setdefault("active", [])
    active.append(callback)
    try:
        yield
    finally:
        active.remove(callback)
