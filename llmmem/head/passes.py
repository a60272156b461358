"""The two passes of the fused head over a chunk of logits, dispatched by device: the C core on
the CPU, the CUDA kernels where they run (:mod:`llmmem.head.cuda` says where), else the same
arithmetic in torch ops (:mod:`llmmem.head.kernels` holds both); and how shards' statistics
combine into a row's loss.
"""

from __future__ import annotations

import warnings

import torch

from llmmem.head import cuda
from llmmem.head.kernels import Settings, Stats, grad_native_, grad_reference_, stats_native, stats_reference

_warned: set = set()


def _native_ok(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return True
    why = f"no llmmem kernel for {t.device.type} tensors here"
    if t.device.type == "cuda":
        why = cuda.unsupported_reason(t.device)
        if why is None:
            return True
    if t.device.type not in _warned:
        _warned.add(t.device.type)
        warnings.warn(
            f"llmmem.linear_cross_entropy: {why}; its passes over the logits run as torch ops (the same "
            "results, more passes over memory)",
            RuntimeWarning,
            stacklevel=4,
        )
    return False


def _native_fits(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    return logits.stride(1) == 1 and labels.is_contiguous() and labels.device == logits.device


def stats(logits: torch.Tensor, labels: torch.Tensor, s: Settings) -> Stats:
    if logits.shape[0] and _native_fits(logits, labels) and _native_ok(logits):
        return stats_native(logits, labels, s)
    if logits.shape[0] == 0:
        return Stats(*(torch.empty(0, dtype=torch.float32, device=logits.device) for _ in range(4)))
    return stats_reference(logits, labels, s)


def grad_(logits: torch.Tensor, labels: torch.Tensor, s: Settings, lse: torch.Tensor, scale: torch.Tensor) -> None:
    """``logits`` becomes the gradient of ``scale[i] * loss_i`` with respect to them, in place."""
    if logits.shape[0] == 0:
        return
    if _native_fits(logits, labels) and _native_ok(logits):
        grad_native_(logits, labels, s, lse, scale)
        return
    grad_reference_(logits, labels, s, lse, scale)


def combine(parts: list[Stats]) -> Stats:
    """The statistics of a whole vocabulary from its shards' (in shard order: the same bits on
    every rank)."""
    if len(parts) == 1:
        return parts[0]
    mx = parts[0].max
    for p in parts[1:]:
        mx = torch.maximum(mx, p.max)
    total = sum((p.sum * torch.exp(p.max - mx) for p in parts), torch.zeros_like(mx))
    return Stats(
        mx,
        total,
        sum((p.target for p in parts), torch.zeros_like(mx)),
        sum((p.zsum for p in parts), torch.zeros_like(mx)),
    )


def loss_rows(st: Stats, labels: torch.Tensor, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, lse per row) from a whole vocabulary's statistics; an ignored row's loss is 0."""
    lse = st.max + torch.log(st.sum)
    eps = s.label_smoothing
    loss = (lse - st.target) * (1.0 - eps)
    if eps:
        loss = loss + (lse - st.zsum / s.vocab_total) * eps
    return loss.masked_fill(labels == s.ignore_index, 0.0), lse
