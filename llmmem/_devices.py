"""Device helpers shared by the modules that hand a CUDA device to the C core or to torch by index."""

from __future__ import annotations

import torch


def cuda_index(device: torch.device) -> int:
    """The GPU index of a CUDA ``device``; ``"cuda"`` without one means the current GPU (this
    initialises torch's CUDA state if it is not yet)."""
    return device.index if device.index is not None else torch.cuda.current_device()
