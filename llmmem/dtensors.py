"""What a process holds of a tensor that may be a DTensor (FSDP2's ``fully_shard``, torch's tensor
parallelism): its local shard. Memory accounting (storages, their bytes) works on that; a DTensor's
own storage is a placeholder without data. Never imports ``torch.distributed``: a DTensor exists
only once its module is loaded."""

from __future__ import annotations

import sys

import torch

__all__ = ["is_dtensor", "local"]


def is_dtensor(t) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if it is a DTensor (no copy, no graph), else ``t``."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t
