"""The chunk loops of the fused head: the logits of a chunk of rows (a matmul through torch), the
C passes over them, and the matmuls of the gradients. Pure functions of a :class:`Plan`, used by the
custom ops (llmmem.head.ops) and by the vocabulary-parallel path (llmmem.head.loss)."""

from __future__ import annotations

from typing import Optional

import torch

from llmmem.head import passes
from llmmem.head.kernels import Settings

_MIN_CHUNK_BYTES = 32 << 20
# Each chunk's matmuls read the whole weight [V, H] (and read and write its fp32 gradient) for
# their rows: with fewer rows than this they run slower (the CPU's took 1.6x as long at 64 rows as
# at 256 or more, V 128256: benchmarks/README.md, "The LM head"). 256 rows of fp32 logits are at
# most the weight's fp32 gradient, which the call makes anyway, when H >= 256.
_MIN_CHUNK_ROWS = 256


def chunk_rows(n: int, vocab: int, hidden_bytes: int, chunk_size: Optional[int]) -> int:
    """Rows of logits a chunk: ``chunk_size``, else the most whose logits (fp32) take
    ``max(32 MiB, the hidden states' bytes)`` but at least 256; at most ``n``, at least one."""
    if chunk_size is not None:
        return max(1, min(n, chunk_size))
    target = max(_MIN_CHUNK_BYTES, hidden_bytes)
    return max(1, min(n, max(_MIN_CHUNK_ROWS, target // (vocab * 4))))


class Plan:
    """One call's inputs (hidden states flattened to [N, H], weight [V_shard, H], bias, labels [N])
    and settings, with the process group the vocabulary is split over (None: not split)."""

    def __init__(self, h, w, b, labels, settings: Settings, rows: int, group=None, world: int = 1) -> None:
        self.h, self.w, self.b, self.labels = h, w, b, labels
        self.settings, self.rows, self.group, self.world = settings, rows, group, world

    def chunks(self):
        n = self.h.shape[0]
        for a in range(0, n, self.rows):
            yield a, min(n, a + self.rows)

    def buffer(self) -> torch.Tensor:
        return torch.empty(self.rows, self.w.shape[0], dtype=self.h.dtype, device=self.h.device)

    def logits(self, buf: torch.Tensor, a: int, b: int) -> torch.Tensor:
        out = buf[: b - a]
        if self.b is not None:
            torch.addmm(self.b, self.h[a:b], self.w.t(), out=out)
        else:
            torch.mm(self.h[a:b], self.w.t(), out=out)
        return out

    def row_stats(self, logits: torch.Tensor, labels: torch.Tensor) -> passes.Stats:
        st = passes.stats(logits, labels, self.settings)
        if self.world == 1:
            return st
        # every rank gathers every shard's statistics and combines them in shard order: the same
        # bits of the loss on every rank
        from llmmem.parallel import collectives

        mine = torch.stack([st.max, st.sum, st.target, st.zsum]).unsqueeze(0)
        parts = collectives.all_gather(mine.contiguous(), 0, self.group)
        return passes.combine([passes.Stats(*parts[r]) for r in range(self.world)])

    def sum_over_shards(self, t: torch.Tensor) -> None:
        if self.world > 1:
            from llmmem.parallel import collectives

            collectives.all_reduce_(t, group=self.group)

    def check_labels(self) -> None:
        """IndexError for a label outside the vocabulary that is not ignore_index (as torch)."""
        s = self.settings
        if self.labels.numel():
            bad = (self.labels != s.ignore_index) & ((self.labels < 0) | (self.labels >= s.vocab_total))
            if bool(bad.any()):
                raise IndexError(
                    f"linear_cross_entropy: label {int(self.labels[bad][0])} is out of bounds for a vocabulary of "
                    f"{s.vocab_total} (and is not ignore_index {s.ignore_index})"
                )

    def valid(self) -> torch.Tensor:
        return (self.labels != self.settings.ignore_index).sum()


def _accumulate(dw: torch.Tensor, logits_grad: torch.Tensor, h: torch.Tensor) -> None:
    """dw (fp32) += logits_grad^T @ h, accumulated in fp32 whatever the inputs' dtype."""
    if logits_grad.dtype == torch.float32:
        dw.addmm_(logits_grad.t(), h if h.dtype == torch.float32 else h.float())
        return
    if dw.device.type == "cuda":
        try:  # cuBLAS: half inputs, fp32 accumulation and output
            torch.addmm(dw, logits_grad.t(), h, out_dtype=torch.float32, out=dw)
            return
        except (RuntimeError, TypeError):  # a torch without the out_dtype overload
            pass
    dw.addmm_(logits_grad.t().float(), h.float())


def _grad_buffers(plan: Plan, need_h: bool, need_w: bool, need_b: bool):
    w = plan.w
    dh = torch.zeros_like(plan.h) if need_h else None
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
    db = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b else None
    return dh, dw, db


def _gradients_of_chunk(plan: Plan, logits: torch.Tensor, a: int, b: int, dh, dw, db) -> None:
    if dh is not None:
        torch.mm(logits, plan.w, out=dh[a:b])
    if dw is not None:
        _accumulate(dw, logits, plan.h[a:b])
    if db is not None:
        db += logits.float().sum(dim=0)


def _finish(plan: Plan, dh, dw, db):
    if dh is not None:
        plan.sum_over_shards(dh)  # the hidden states meet every shard: their gradient is the sum
    dw = dw.to(plan.w.dtype) if dw is not None else None
    db = db.to(plan.b.dtype) if db is not None else None
    return dh, dw, db


def forward_with_grads(
    plan: Plan, mean: bool, need_h: bool, need_w: bool, need_b: bool, loss_dtype: Optional[torch.dtype] = None
):
    """(loss, dh, dw, db): the loss (``mean``: over the rows not ignored, else the sum; in
    ``loss_dtype``, None: the hidden states') and its gradients, each None where not needed."""
    s = plan.settings
    buf = plan.buffer()
    dh, dw, db = _grad_buffers(plan, need_h, need_w, need_b)
    total = torch.zeros((), dtype=torch.float64, device=plan.h.device)
    valid = plan.valid().double() if mean else None
    inv = (1.0 / valid.clamp(min=1)).float() if mean else None
    for a, b in plan.chunks():
        lab = plan.labels[a:b]
        logits = plan.logits(buf, a, b)
        loss, lse = passes.loss_rows(plan.row_stats(logits, lab), lab, s)
        total += loss.double().sum()
        scale = inv.expand_as(lse) if mean else torch.ones_like(lse)
        passes.grad_(logits, lab, s, lse, scale)
        _gradients_of_chunk(plan, logits, a, b, dh, dw, db)
    loss = total / valid if mean else total  # 0 / 0 = NaN when every row is ignored, as torch
    return (loss.to(loss_dtype or plan.h.dtype), *_finish(plan, dh, dw, db))


def forward_rows(plan: Plan):
    """(loss of each row, lse of each row), fp32 [N]: what the backward of 'none' recomputes from."""
    buf = plan.buffer()
    n = plan.h.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=plan.h.device)
    lses = torch.empty_like(losses)
    for a, b in plan.chunks():
        lab = plan.labels[a:b]
        loss, lse = passes.loss_rows(plan.row_stats(plan.logits(buf, a, b), lab), lab, plan.settings)
        losses[a:b], lses[a:b] = loss, lse
    return losses, lses


def backward_rows(plan: Plan, lses: torch.Tensor, grad_rows: torch.Tensor, need_h: bool, need_w: bool, need_b: bool):
    """(dh, dw, db) of sum_i grad_rows[i] * loss_i, recomputing each chunk's logits."""
    buf = plan.buffer()
    dh, dw, db = _grad_buffers(plan, need_h, need_w, need_b)
    g = grad_rows.float().contiguous()
    for a, b in plan.chunks():
        lab = plan.labels[a:b]
        logits = plan.logits(buf, a, b)
        passes.grad_(logits, lab, plan.settings, lses[a:b], g[a:b])
        _gradients_of_chunk(plan, logits, a, b, dh, dw, db)
    return _finish(plan, dh, dw, db)
