"""Timing: the median seconds of repeated calls, synchronised with a CUDA device.

Not here: the timed steps of a block's modes (round-robin, ratios to store-all within a round:
:mod:`llmmem.checkpointing.costs`); work units (:mod:`llmmem.checkpointing.work`), which choose
plans where seconds only predict.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["median_time", "sync"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
