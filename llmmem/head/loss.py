"""``llmmem.linear_cross_entropy``: the loss of ``F.cross_entropy(F.linear(hidden, weight, bias),
labels)`` without the [tokens x vocabulary] logits, their fp32 upcast or their gradient ever
existing whole: at most one chunk of rows of logits lives at a time.

How (the design choice, measured in ``benchmarks/README.md``, "The LM head"):

- **Gradient in the forward pass** (as Liger does) when the loss will be differentiated and the
  upstream gradient is one number (``reduction="mean"`` or ``"sum"``): per chunk of rows, the
  logits (one matmul), the C pass that takes their row statistics, the pass that turns them in
  place into the gradient of the loss, then the hidden states' gradient (a matmul) and the
  weight's, accumulated (a matmul). Three matmuls in all, as the plain head's forward and backward
  take; backward only multiplies the saved gradients by the upstream scalar.
- **Recompute in backward** (as Cut Cross-Entropy does) for ``reduction="none"`` (a gradient per
  row) or without grad: the forward keeps one log-sum-exp a row; backward recomputes each chunk's
  logits (four matmuls in all).

The chunk's rows are chosen from a memory target (``chunk_size=None``): the chunk's logits take at
most ``max(32 MiB, the hidden states' bytes)`` (so the loss never holds much more than what the
step already does), at least one row. Logits are computed in the inputs' dtype (fp32, bf16, fp16)
and the passes read them in fp32; the weight's gradient is accumulated in fp32.

Memory: the hidden states' gradient [N, H] and the weight's [V, H] (fp32 while accumulated),
which any head needs; one chunk of logits; a few floats a row. Synchronisation: labels are
checked for the range [0, V) once per call (a host synchronisation on a GPU, where torch would
instead raise a device-side assert).
"""

from __future__ import annotations

from typing import Optional

import torch

from llmmem.head import passes
from llmmem.head.passes import Settings

_REDUCTIONS = ("mean", "sum", "none")
_MIN_CHUNK_BYTES = 32 << 20


def _chunk_rows(n: int, vocab: int, hidden_bytes: int, chunk_size: Optional[int]) -> int:
    if chunk_size is not None:
        return max(1, min(n, chunk_size))
    target = max(_MIN_CHUNK_BYTES, hidden_bytes)
    return max(1, min(n, target // (vocab * 4)))


class _Setup:
    """The validated call: flattened inputs and everything the chunk loop needs."""

    def __init__(
        self, hidden, weight, bias, labels, ignore_index, reduction, label_smoothing, softcap, chunk_size, group
    ):
        self.h = hidden.reshape(-1, hidden.shape[-1])
        self.w, self.b = weight, bias
        self.labels = labels.reshape(-1)
        self.shape = labels.shape
        self.reduction = reduction
        self.group = group
        world, rank = 1, 0
        if group is not None:
            import torch.distributed as dist

            world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world, self.rank = world, rank
        v_local = weight.shape[0]
        self.settings = Settings(
            vocab_start=rank * v_local,
            vocab_total=v_local * world,
            ignore_index=int(ignore_index),
            label_smoothing=float(label_smoothing),
            softcap=float(softcap or 0.0),
        )
        n = self.h.shape[0]
        self.rows = _chunk_rows(n, v_local, self.h.numel() * self.h.element_size(), chunk_size)
        self.valid = (self.labels != ignore_index).sum() if reduction == "mean" else None

    def chunks(self):
        n = self.h.shape[0]
        for a in range(0, n, self.rows):
            yield a, min(n, a + self.rows)

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
        allp = collectives.all_gather(mine.contiguous(), 0, self.group)
        return passes.combine([passes.Stats(*allp[r]) for r in range(self.world)])

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            from llmmem.parallel import collectives

            collectives.all_reduce_(t, group=self.group)
        return t


class _GradInForward(torch.autograd.Function):
    """Loss forward with the gradients computed there (reduction mean or sum)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, setup: _Setup):
        s = setup
        dtype = hidden2d.dtype
        buf = torch.empty(s.rows, weight.shape[0], dtype=dtype, device=hidden2d.device)
        need_h, need_w = hidden2d.requires_grad, weight.requires_grad
        need_b = bias is not None and bias.requires_grad
        dh = torch.zeros_like(hidden2d) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        total = torch.zeros((), dtype=torch.float64, device=hidden2d.device)
        n_valid = s.valid.clamp(min=1).double() if s.reduction == "mean" else None
        for a, b in s.chunks():
            lab = s.labels[a:b]
            logits = s.logits(buf, a, b)
            st = s.row_stats(logits, lab)
            loss, lse = passes.loss_rows(st, lab, s.settings)
            total += loss.double().sum()
            scale = torch.ones_like(lse) if n_valid is None else (1.0 / n_valid).float().expand_as(lse)
            passes.grad_(logits, lab, s.settings, lse, scale)
            if dh is not None:
                torch.mm(logits, weight, out=dh[a:b])
            if dw is not None:
                _accumulate(dw, logits, s.h[a:b])
            if db is not None:
                db += logits.float().sum(dim=0)
        if dh is not None:
            s.all_reduce(dh)  # the hidden states meet every shard: their gradient is the sum
        out = total / n_valid if n_valid is not None else total
        if s.reduction == "mean" and bool(s.valid == 0):
            out = torch.full((), float("nan"), dtype=torch.float64, device=hidden2d.device)  # as torch: 0 / 0
        ctx.save_for_backward(
            dh if dh is not None else torch.empty(0),
            dw.to(weight.dtype) if dw is not None else torch.empty(0),
            db.to(bias.dtype) if db is not None else torch.empty(0),
        )
        ctx.has = (dh is not None, dw is not None, db is not None)
        return out.to(torch.float32 if dtype == torch.float64 else dtype)

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw, db = ctx.saved_tensors
        g = grad_out
        return (
            dh * g.to(dh.dtype) if ctx.has[0] else None,
            dw * g.to(dw.dtype) if ctx.has[1] else None,
            db * g.to(db.dtype) if ctx.has[2] else None,
            None,
        )


def _accumulate(dw: torch.Tensor, logits_grad: torch.Tensor, h: torch.Tensor) -> None:
    """dw (fp32) += logits_grad^T @ h, accumulated in fp32 whatever the inputs' dtype."""
    if logits_grad.dtype == torch.float32:
        dw.addmm_(logits_grad.t(), h.float() if h.dtype != torch.float32 else h)
    elif dw.device.type == "cuda":
        torch.addmm(dw, logits_grad.t(), h, out_dtype=torch.float32, out=dw)
    else:
        dw.addmm_(logits_grad.t().float(), h.float())


class _Recompute(torch.autograd.Function):
    """Loss per row forward, gradients by recomputing each chunk's logits in backward."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, setup: _Setup):
        s = setup
        buf = torch.empty(s.rows, weight.shape[0], dtype=hidden2d.dtype, device=hidden2d.device)
        losses = torch.empty(hidden2d.shape[0], dtype=torch.float32, device=hidden2d.device)
        lses = torch.empty_like(losses)
        for a, b in s.chunks():
            lab = s.labels[a:b]
            logits = s.logits(buf, a, b)
            loss, lse = passes.loss_rows(s.row_stats(logits, lab), lab, s.settings)
            losses[a:b], lses[a:b] = loss, lse
        ctx.setup = s
        ctx.save_for_backward(hidden2d, weight, bias if bias is not None else torch.empty(0), lses)
        ctx.has_bias = bias is not None
        return losses

    @staticmethod
    def backward(ctx, grad_rows):
        hidden2d, weight, bias, lses = ctx.saved_tensors
        s = ctx.setup
        s.h, s.w, s.b = hidden2d, weight, bias if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        buf = torch.empty(s.rows, weight.shape[0], dtype=hidden2d.dtype, device=hidden2d.device)
        dh = torch.zeros_like(hidden2d) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        g = grad_rows.float().contiguous()
        for a, b in s.chunks():
            lab = s.labels[a:b]
            logits = s.logits(buf, a, b)
            passes.grad_(logits, lab, s.settings, lses[a:b], g[a:b])
            if dh is not None:
                torch.mm(logits, weight, out=dh[a:b])
            if dw is not None:
                _accumulate(dw, logits, hidden2d[a:b])
            if db is not None:
                db += logits.float().sum(dim=0)
        if dh is not None:
            s.all_reduce(dh)
        return (
            dh,
            dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None,
            None,
        )


def _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size):
    where = "linear_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if not hidden.is_floating_point() or hidden.dtype not in passes.DTYPE_CODES:
        raise TypeError(f"{where}: hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{where}: hidden's last dimension ({hidden.shape[-1] if hidden.dim() else None}) must equal "
            f"weight's second ({weight.shape[1]}): hidden is [..., H] and weight [V, H]"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{where}: hidden is {hidden.dtype} and weight {weight.dtype}; they must match")
    if labels.dtype != torch.int64:
        raise TypeError(f"{where}: labels must be int64 (torch.long), got {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{where}: labels' shape {tuple(labels.shape)} must be hidden's without its last dimension, "
            f"{tuple(hidden.shape[:-1])}"
        )
    if labels.device != hidden.device or weight.device != hidden.device:
        raise ValueError(f"{where}: hidden, weight and labels must be on one device")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"{where}: bias must be None or a tensor of shape ({weight.shape[0]},)")
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"{where}: bias is {bias.dtype}; it must match hidden's {hidden.dtype}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{where}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"{where}: label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"{where}: softcap must be None or a number > 0, got {softcap!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(
            f"{where}: chunk_size must be None or an int > 0 (rows of logits a chunk), got {chunk_size!r}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{where}: ignore_index must be an int, got {ignore_index!r}")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    group=None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=..., reduction=...,
    label_smoothing=...)`` (with Gemma 2's ``softcap * tanh(logits / softcap)`` when ``softcap``
    is set) without the logits: see the module docstring for how and what it costs.

    :param hidden: ``[..., H]`` float32, bfloat16 or float16.
    :param weight: ``[V, H]`` (this rank's ``[V / t, H]`` shard with ``group``), hidden's dtype.
    :param labels: ``[...]`` int64, each in ``[0, V)`` or ``ignore_index``.
    :param reduction: ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"`` (labels' shape).
    :param chunk_size: rows of logits a chunk (None: from the memory target).
    :param group: a process group over which the vocabulary is split (rank ``r`` holds rows
        ``[r V/t, (r+1) V/t)`` of the weight, as ``llmmem.VocabParallelEmbedding`` and a
        ``ColumnParallelLinear`` head split them); every rank must call it, with the same hidden
        states and labels. One small all-gather per chunk; the loss is the same bits on every rank.
    :returns: the loss (a 0-dim tensor, or labels' shape for ``"none"``), in hidden's dtype.
    :raises IndexError: a label outside ``[0, V)`` that is not ``ignore_index`` (as torch).
    """
    _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size)
    if group is not None:
        from llmmem.parallel.groups import get_tensor_parallel_group

        group = get_tensor_parallel_group(group)
    setup = _Setup(hidden, weight, bias, labels, ignore_index, reduction, label_smoothing, softcap, chunk_size, group)
    vocab = setup.settings.vocab_total
    if labels.numel():
        bad = (setup.labels != ignore_index) & ((setup.labels < 0) | (setup.labels >= vocab))
        if bool(bad.any()):
            raise IndexError(
                f"linear_cross_entropy: label {int(setup.labels[bad][0])} is out of bounds for a vocabulary of "
                f"{vocab} (and is not ignore_index {ignore_index})"
            )
    grads = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if reduction != "none" and grads:
        return _GradInForward.apply(setup.h, weight, bias, setup)
    rows = _Recompute.apply(setup.h, weight, bias, setup)
    if reduction == "none":
        return rows.reshape(setup.shape).to(hidden.dtype)
    total = rows.double().sum()
    if reduction == "mean":
        total = total / setup.valid  # 0 / 0 = NaN when every row is ignored, as torch
    return total.to(hidden.dtype)
