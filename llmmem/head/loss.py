"""``llmmem.linear_cross_entropy``: the loss of ``F.cross_entropy(F.linear(hidden, weight, bias),
labels)`` without the [tokens x vocabulary] logits, their fp32 upcast or their gradient ever
existing whole: at most one chunk of rows of logits lives at a time.

How (the design choice, measured in ``benchmarks/README.md``, "The LM head"):

- **Gradient in the forward pass** (as Liger does) when the loss will be differentiated and the
  upstream gradient is one number (``reduction="mean"`` or ``"sum"``) and the inputs are fp32 or
  bf16: per chunk of rows, the logits (one matmul), the C pass that takes their row statistics,
  the pass that turns them in place into the gradient of the loss, then the hidden states' gradient
  (a matmul) and the weight's, accumulated (a matmul). Three matmuls in all, as the plain head's
  forward and backward take; backward only multiplies the saved gradients by the upstream scalar.
- **Recompute in backward** (as Cut Cross-Entropy does) for ``reduction="none"`` (a gradient per
  row), without grad, and for fp16 inputs: the forward keeps one log-sum-exp a row; backward
  recomputes each chunk's logits (four matmuls in all). fp16 takes this path because a gradient
  made in the forward is rounded to fp16 before a loss scaler's factor (2**16) reaches it: the
  logits' gradient ``softmax / tokens`` is ~1e-8 at a vocabulary of 32k and 4k tokens, under fp16's
  smallest subnormal (6e-8), so most of the weight's gradient would be 0. In backward the upstream
  gradient (scale / tokens a row, fp32) multiplies each chunk's gradient in fp32 before it is
  rounded to fp16, as in the plain head, for the same memory (one chunk of logits, the fp32
  accumulator of the weight's gradient) and one more matmul. bf16 has fp32's exponent range.

The chunk's rows are chosen from a memory target (``chunk_size=None``): the most rows whose logits
take ``max(32 MiB, the hidden states' bytes)`` (so the loss never holds much more than what the
step already does), but at least 256 rows (at most N): fewer make the chunk's matmuls slow, and
256 rows of fp32 logits are no more than the weight's fp32 gradient when H >= 256. Logits are computed in the inputs' dtype (fp32, bf16, fp16)
and the passes read them in fp32; the weight's gradient is accumulated in fp32.

Memory: the hidden states' gradient [N, H] and the weight's [V, H] (fp32 while accumulated),
which any head needs; one chunk of logits; a few floats a row. Synchronisation: labels are
checked for the range [0, V) once per call (a host synchronisation on a GPU, where torch would
instead raise a device-side assert).
"""

from __future__ import annotations

from typing import Optional

import torch

from llmmem.head import chunks, kernels, ops
from llmmem.head.kernels import Settings

_REDUCTIONS = ("mean", "sum", "none")


_SCALE_BLOCK = 4 << 20  # elements scaled in fp32 at a time: a 16 MiB temporary


def _scale_(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``t *= g`` in place, the product rounded once to ``t``'s dtype: a half-precision ``t`` is
    scaled in fp32 a block at a time, since ``g`` itself may not fit its dtype (a loss scaler's
    2**16 is inf in fp16) or keep its digits there (1 / tokens in bf16)."""
    if t.dtype == torch.float32 or g.dtype == t.dtype:
        return t.mul_(g.to(t.dtype))
    flat = t.view(-1)
    for a in range(0, flat.numel(), _SCALE_BLOCK):
        part = flat[a : a + _SCALE_BLOCK]
        part.copy_(part.float().mul_(g.float()))
    return t


_PATCHED = "through llmmem.patch_lm_loss, remove the patch (handle.remove()) for it"


def _refuse_double_backward() -> None:
    # autograd runs backward with grad mode on exactly when create_graph=True
    if torch.is_grad_enabled():
        raise RuntimeError(
            "linear_cross_entropy: double backward (create_graph=True) is not supported: its gradients come from "
            "passes autograd cannot differentiate. Compute the head unfused, F.cross_entropy(F.linear(...)), for "
            f"that; {_PATCHED}"
        )


class _Grads(torch.autograd.Function):
    """The loss (mean or sum), gradients computed in the forward pass; backward scales them in
    place and hands them over (autograd then takes them as ``.grad`` without a copy)."""

    @staticmethod
    def forward(ctx, h, w, b, plan: chunks.Plan, mean: bool, loss_dtype=None):
        need_b = b is not None and b.requires_grad
        loss, dh, dw, db = chunks.forward_with_grads(plan, mean, h.requires_grad, w.requires_grad, need_b, loss_dtype)
        ctx.grads = (dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, g):
        _refuse_double_backward()
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "linear_cross_entropy: its gradients were computed in the forward pass and are used up; it cannot be "
                "backpropagated twice (retain_graph=True). Call it with reduction='none' and reduce the result, "
                f"which recomputes in backward; {_PATCHED}"
            )
        return tuple(_scale_(t, g) if t is not None else None for t in grads) + (None, None, None)


class _Rows(torch.autograd.Function):
    """The loss of every row, gradients recomputed in backward."""

    @staticmethod
    def forward(ctx, h, w, b, plan: chunks.Plan):
        rows, lse = chunks.forward_rows(plan)
        ctx.plan, ctx.lse = plan, lse
        return rows

    @staticmethod
    def backward(ctx, g):
        _refuse_double_backward()
        need = ctx.needs_input_grad
        dh, dw, db = chunks.backward_rows(ctx.plan, ctx.lse, g, need[0], need[1], need[2])
        return dh, dw, db, None


def _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size):
    where = "linear_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if not hidden.is_floating_point() or hidden.dtype not in kernels.DTYPE_CODES:
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
    return _linear_cross_entropy(
        hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size, group, None
    )


def _linear_cross_entropy(
    hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size, group, loss_dtype
):
    """:func:`linear_cross_entropy` with its loss in ``loss_dtype`` (None: hidden's dtype). A loss
    in fp32 from half-precision inputs (``llmmem.patch_lm_loss``'s, as Hugging Face's loss is fp32)
    also takes its upstream gradient in fp32: a loss scaler's 2**16 stays finite."""
    _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size)
    h = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    rows = chunks.chunk_rows(h.shape[0], weight.shape[0], h.numel() * h.element_size(), chunk_size)
    grads = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    # fp16 recomputes in backward even for one upstream number: see the module docstring
    in_forward = reduction != "none" and grads and hidden.dtype != torch.float16
    out_dtype = loss_dtype or hidden.dtype
    cap = float(softcap or 0.0)
    if group is None and torch.compiler.is_compiling():
        # traced whole by torch.compile through the custom ops (llmmem.head.ops)
        args = (int(ignore_index), float(label_smoothing), cap, rows)
        if in_forward:
            need_b = bias is not None and bias.requires_grad
            loss, *_ = ops.lce_grads(
                h, weight, bias, flat, args[0], reduction == "mean", args[1], cap, rows,
                hidden.requires_grad, weight.requires_grad, need_b, out_dtype,
            )  # fmt: skip
            return loss
        per_row, _ = ops.lce_rows(h, weight, bias, flat, *args)
        return _reduce(per_row, flat, labels.shape, reduction, ignore_index, out_dtype)
    world, rank = 1, 0
    if group is not None:
        import torch.distributed as dist

        from llmmem.parallel.groups import get_tensor_parallel_group

        group = get_tensor_parallel_group(group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    v = weight.shape[0]
    settings = Settings(rank * v, v * world, int(ignore_index), float(label_smoothing), cap)
    plan = chunks.Plan(h, weight, bias, flat, settings, rows, group, world)
    plan.check_labels()
    if in_forward:
        return _Grads.apply(h, weight, bias, plan, reduction == "mean", out_dtype)
    per_row = _Rows.apply(h, weight, bias, plan)
    return _reduce(per_row, flat, labels.shape, reduction, ignore_index, out_dtype)


def _reduce(per_row, flat_labels, shape, reduction, ignore_index, dtype):
    if reduction == "none":
        return per_row.reshape(shape).to(dtype)
    total = per_row.double().sum()
    if reduction == "mean":
        total = total / (flat_labels != ignore_index).sum()  # 0 / 0 = NaN when every row is ignored, as torch
    return total.to(dtype)
