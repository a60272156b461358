"""The two passes of the fused head over a chunk of logits, dispatched by device: the C core on
the CPU, the CUDA kernels where they run (:mod:`llmmem.head.cuda` says where), else the same
arithmetic in torch ops (the reference, also the tests' oracle). See ``csrc/include/llmmem/head.h`` for what they compute.

Every function takes a chunk ``logits`` [rows, V_shard] (fp32, bf16 or fp16; a row may be strided
as long as its elements are contiguous), ``labels`` [rows] int64 and the settings, and returns or
writes fp32 per-row vectors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

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


_warned: set = set()


def _native_ok(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return True
    why = f"no llmmem kernel for {t.device.type} tensors here"
    if t.device.type == "cuda":
        from llmmem.head import cuda

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


def _launch(t: torch.Tensor) -> tuple:
    """The native calls' trailing arguments: CPU threads, or the GPU and its current stream."""
    if t.device.type == "cpu":
        return (torch.get_num_threads(),)
    from llmmem._devices import cuda_index

    index = cuda_index(t.device)
    return (0, index, torch.cuda.current_stream(t.device).cuda_stream)


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
