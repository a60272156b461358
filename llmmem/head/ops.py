"""The fused head as torch.library custom ops, with fake (meta) implementations and registered
autograd, so that ``torch.compile`` traces ``linear_cross_entropy`` whole (``fullgraph=True``)
instead of breaking its graph at the C calls (eager calls use the autograd Functions of
llmmem.head.loss, which hand the weight's gradient over without a copy):

- ``llmmem::lce_grads``: loss (mean or sum, in the dtype asked for) and its gradients computed in
  the forward pass; the backward scales them by the upstream gradient, in fp32 where the two
  dtypes differ (as the eager path: a loss scaler's 2**16 is inf in fp16).
- ``llmmem::lce_rows``: the loss of every row and its log-sum-exp; the backward is
  ``llmmem::lce_rows_backward``, which recomputes the logits chunk by chunk.

The vocabulary-parallel path (a process group) is not an op: see :mod:`llmmem.head.loss`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from llmmem.head import chunks
from llmmem.head.kernels import Settings


def _plan(h, w, b, labels, ignore_index, label_smoothing, softcap, rows) -> chunks.Plan:
    s = Settings(0, w.shape[0], ignore_index, label_smoothing, softcap)
    plan = chunks.Plan(h, w, b, labels, s, rows)
    plan.check_labels()
    return plan


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


@torch.library.custom_op("llmmem::lce_grads", mutates_args=())
def lce_grads(
    h: Tensor,
    w: Tensor,
    b: Optional[Tensor],
    labels: Tensor,
    ignore_index: int,
    mean: bool,
    label_smoothing: float,
    softcap: float,
    rows: int,
    need_h: bool,
    need_w: bool,
    need_b: bool,
    loss_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    plan = _plan(h, w, b, labels, ignore_index, label_smoothing, softcap, rows)
    loss, dh, dw, db = chunks.forward_with_grads(plan, mean, need_h, need_w, need_b and b is not None, loss_dtype)
    return (
        loss,
        dh if dh is not None else _empty(h),
        dw if dw is not None else _empty(w),
        db if db is not None else _empty(w),
    )


@lce_grads.register_fake
def _(h, w, b, labels, ignore_index, mean, label_smoothing, softcap, rows, need_h, need_w, need_b, loss_dtype):
    return (
        h.new_empty((), dtype=loss_dtype),
        torch.empty_like(h) if need_h else _empty(h),
        torch.empty_like(w) if need_w else _empty(w),
        w.new_empty(w.shape[0], dtype=b.dtype if b is not None else w.dtype)
        if need_b and b is not None
        else _empty(w),
    )


def _grads_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.has = tuple(inputs[i] for i in (9, 10)) + (inputs[11] and inputs[2] is not None,)


def _scaled(t: Tensor, g: Tensor) -> Tensor:
    """``t * g`` rounded once to ``t``'s dtype, the arithmetic of llmmem.head.loss's ``_scale_``
    out of place (as a traced graph must; eager calls scale in place and avoid the copy)."""
    if t.dtype == torch.float32 or g.dtype == t.dtype:
        return t * g.to(t.dtype)
    return (t.float() * g.float()).to(t.dtype)


def _grads_backward(ctx, grad_loss, *_):
    dh, dw, db = ctx.saved_tensors
    return tuple(_scaled(t, grad_loss) if has else None for t, has in zip((dh, dw, db), ctx.has)) + (None,) * 10


lce_grads.register_autograd(_grads_backward, setup_context=_grads_setup)


@torch.library.custom_op("llmmem::lce_rows", mutates_args=())
def lce_rows(
    h: Tensor,
    w: Tensor,
    b: Optional[Tensor],
    labels: Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    rows: int,
) -> tuple[Tensor, Tensor]:
    return chunks.forward_rows(_plan(h, w, b, labels, ignore_index, label_smoothing, softcap, rows))


@lce_rows.register_fake
def _(h, w, b, labels, ignore_index, label_smoothing, softcap, rows):
    n = h.shape[0]
    return h.new_empty(n, dtype=torch.float32), h.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("llmmem::lce_rows_backward", mutates_args=())
def lce_rows_backward(
    h: Tensor,
    w: Tensor,
    b: Optional[Tensor],
    labels: Tensor,
    lse: Tensor,
    grad_rows: Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    rows: int,
    need_h: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    s = Settings(0, w.shape[0], ignore_index, label_smoothing, softcap)
    plan = chunks.Plan(h, w, b, labels, s, rows)
    dh, dw, db = chunks.backward_rows(plan, lse, grad_rows, need_h, need_w, need_b and b is not None)
    return (
        dh if dh is not None else _empty(h),
        dw if dw is not None else _empty(w),
        db if db is not None else _empty(w),
    )


@lce_rows_backward.register_fake
def _(h, w, b, labels, lse, grad_rows, ignore_index, label_smoothing, softcap, rows, need_h, need_w, need_b):
    return (
        torch.empty_like(h) if need_h else _empty(h),
        torch.empty_like(w) if need_w else _empty(w),
        w.new_empty(w.shape[0], dtype=b.dtype if b is not None else w.dtype)
        if need_b and b is not None
        else _empty(w),
    )


def _rows_setup(ctx, inputs, output):
    h, w, b, labels, ignore_index, label_smoothing, softcap, rows = inputs
    ctx.save_for_backward(h, w, b if b is not None else _empty(w), labels, output[1])
    ctx.has_bias = b is not None
    ctx.args = (ignore_index, label_smoothing, softcap, rows)


def _rows_backward(ctx, grad_rows, _grad_lse):
    h, w, b, labels, lse = ctx.saved_tensors
    need = ctx.needs_input_grad
    dh, dw, db = lce_rows_backward(
        h, w, b if ctx.has_bias else None, labels, lse, grad_rows, *ctx.args, need[0], need[1], bool(need[2])
    )
    return (dh if need[0] else None, dw if need[1] else None, db if need[2] else None) + (None,) * 5


lce_rows.register_autograd(_rows_backward, setup_context=_rows_setup)
