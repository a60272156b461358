"""The arithmetic of the fused head's two passes over a chunk of logits, two ways: by the native
core (the C passes on the CPU, the CUDA kernels on a GPU; see ``csrc/include/llmmem/head.h`` for what
they compute) and in torch ops (the reference, also the tests' oracle and the fallback).
:mod:`llmmem.head.passes` chooses between them.

Every function takes a chunk ``logits`` [rows, V_shard] (fp32, bf16 or fp16; a row may be strided
as long as its elements are contiguous), ``labels`` [rows] int64 and the settings, and returns or
writes fp32 per-row vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmmem._devices import cuda_index
from llmmem._native import native

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass(frozen=True)
class Settings:
    """What the passes need besides the chunk."""

    vocab_start: int
    vocab_total: int
    ignore_index: int
    label_smoothing: float
    softcap: float  # 0: none


@dataclass
class Stats:
    """Per-row statistics of one shard's logits (fp32 [rows] each)."""

    max: torch.Tensor
    sum: torch.Tensor
    target: torch.Tensor
    zsum: torch.Tensor


def _launch(t: torch.Tensor) -> tuple:
    """The native calls' trailing arguments: CPU threads, or the GPU and its current stream."""
    if t.device.type == "cpu":
        return (torch.get_num_threads(),)
    index = cuda_index(t.device)
    return (0, index, torch.cuda.current_stream(t.device).cuda_stream)


def stats_native(logits: torch.Tensor, labels: torch.Tensor, s: Settings) -> Stats:
    """Pass 1 by the C core (CPU) or the CUDA kernel, whichever holds ``logits``; rows' elements
    contiguous, labels contiguous on the same device. Labels are checked by the caller: a CUDA
    kernel treats a label outside the vocabulary as ignored."""
    rows, vocab = logits.shape
    out = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4)]
    if rows:
        native.head_stats(
            logits.data_ptr(), labels.data_ptr(), rows, vocab, logits.stride(0), s.vocab_start, s.vocab_total,
            s.ignore_index, s.label_smoothing, s.softcap, DTYPE_CODES[logits.dtype],
            *(o.data_ptr() for o in out), 0, *_launch(logits),
        )  # fmt: skip
    return Stats(*out)


def grad_native_(logits: torch.Tensor, labels: torch.Tensor, s: Settings, lse: torch.Tensor, scale: torch.Tensor):
    """Pass 2 by the C core or the CUDA kernel (see :func:`stats_native`), in place."""
    rows, vocab = logits.shape
    if rows:
        lse, scale = lse.float().contiguous(), scale.float().contiguous()
        native.head_grad(
            logits.data_ptr(), labels.data_ptr(), rows, vocab, logits.stride(0), s.vocab_start, s.vocab_total,
            s.ignore_index, s.label_smoothing, s.softcap, DTYPE_CODES[logits.dtype],
            lse.data_ptr(), scale.data_ptr(), *_launch(logits),
        )  # fmt: skip


# ---- the reference in torch ops ---------------------------------------------------------------


def _z(logits: torch.Tensor, s: Settings) -> torch.Tensor:
    z = logits.float()
    return z if not s.softcap else torch.tanh(z / s.softcap) * s.softcap


def _local_target(labels: torch.Tensor, s: Settings, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = labels - s.vocab_start
    has = (labels != s.ignore_index) & (local >= 0) & (local < vocab)
    return local.masked_fill(~has, 0), has


def stats_reference(logits: torch.Tensor, labels: torch.Tensor, s: Settings) -> Stats:
    z = _z(logits, s)
    mx = z.max(dim=1).values
    total = torch.exp(z.double() - mx.double().unsqueeze(1)).sum(dim=1).float()
    local, has = _local_target(labels, s, z.shape[1])
    target = z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~has, 0.0)
    return Stats(mx, total, target, z.double().sum(dim=1).float())


def grad_reference_(logits, labels, s: Settings, lse, scale) -> None:
    z = _z(logits, s)
    g = torch.exp(z - lse.unsqueeze(1)) - s.label_smoothing / s.vocab_total
    local, has = _local_target(labels, s, z.shape[1])
    g.scatter_add_(1, local.unsqueeze(1), -(1.0 - s.label_smoothing) * has.float().unsqueeze(1))
    if s.softcap:
        g = g * (1.0 - (z / s.softcap) ** 2)
    ignored = labels == s.ignore_index
    g = g * scale.masked_fill(ignored, 0.0).unsqueeze(1)
    logits.copy_(g)
