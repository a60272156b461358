"""Cross-entropy over logits split along the vocabulary, without ever gathering the logits.

Each rank holds ``logits[..., V/t]`` (the output of a ``ColumnParallelLinear`` head with
``gather_output=False``). Per token, every rank computes the log-sum-exp of its slice and the
target's logit if it owns the target id (0 otherwise); one all-gather of these two numbers per
token gives every rank the global log-sum-exp (combined in rank order, so all ranks get bitwise
the same loss) and the target logit. Backward needs ``softmax - onehot`` on the local slice, which
is recomputed from the saved logits and the global log-sum-exp: memory is the logits you already
have plus two floats per token. Arithmetic is fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmmem.parallel import collectives
from llmmem.parallel.groups import get_tensor_parallel_group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        t = dist.get_world_size(group)
        per = logits.shape[-1]
        start = dist.get_rank(group) * per
        x = logits.float()
        lse_local = torch.logsumexp(x, dim=-1)  # (...)
        owned = (target >= start) & (target < start + per)
        local_target = (target - start).masked_fill(~owned, 0)
        picked = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        if t > 1:
            both = torch.stack([lse_local, picked], dim=0).unsqueeze(0)  # (1, 2, ...)
            gathered = collectives.all_gather(both.contiguous(), 0, group)  # (t, 2, ...)
            lse = torch.logsumexp(gathered[:, 0], dim=0)
            target_logit = gathered[:, 1].sum(dim=0)
        else:
            lse, target_logit = lse_local, picked
        ignored = target == ignore_index
        loss = (lse - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, lse, local_target, owned, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local_target, owned, ignored = ctx.saved_tensors
        g = torch.exp(logits.float() - lse.unsqueeze(-1))  # softmax slice
        g.scatter_add_(-1, local_target.unsqueeze(-1), -owned.to(g.dtype).unsqueeze(-1))
        g.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return g.to(logits.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group=None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ignore_index=..., reduction=...)``
    computed from this rank's vocabulary slice ``logits[..., V/t]``.

    :param logits: ``(..., V/t)``, this rank's slice of the logits (rank ``r`` holds ids
        ``[r*V/t, (r+1)*V/t)``, as :class:`~llmmem.VocabParallelEmbedding` and a
        ``ColumnParallelLinear`` head split them).
    :param target: ``(...)`` integer ids in ``[0, V)`` or ``ignore_index``; the same on every rank.
    :param reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (shape of target).
    Collective: every rank of the group must call it. Synchronises with the GPU only to validate
    CPU targets (never for CUDA tensors).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not torch.is_floating_point(logits):
        raise TypeError(f"vocab_parallel_cross_entropy: logits must be floating point, got {logits.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"vocab_parallel_cross_entropy: target must be int64 or int32, got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal the logits' "
            f"shape without the last dimension, {tuple(logits.shape[:-1])}"
        )
    group = get_tensor_parallel_group(process_group)
    vocab = logits.shape[-1] * dist.get_world_size(group)
    # the range check reads the targets on the host: not while Dynamo traces (a graph break)
    if target.device.type == "cpu" and target.numel() and not torch.compiler.is_compiling():
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
        if bool(bad.any()):
            raise IndexError(
                f"vocab_parallel_cross_entropy: Target {int(target[bad][0])} is out of bounds "
                f"(vocabulary size {vocab})"
            )
    loss = _VocabParallelCrossEntropy.apply(logits, target.long(), group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().to(loss.dtype)
