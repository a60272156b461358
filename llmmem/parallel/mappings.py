"""Autograd-aware moves of activations into and out of the tensor-parallel region (Megatron's "f" and "g").

Each mapping is a pair of collectives, one in forward and its adjoint in backward, so that
gradients of a sharded computation equal those of the unsharded one:

=====================================================  ==========================  ==========================
mapping                                                forward                     backward
=====================================================  ==========================  ==========================
:func:`copy_to_tensor_parallel_region`                 identity                    all-reduce (sum)
:func:`reduce_from_tensor_parallel_region`             all-reduce (sum)            identity
:func:`scatter_to_tensor_parallel_region`              keep my slice of last dim   all-gather last dim
:func:`gather_from_tensor_parallel_region`             all-gather last dim         keep my slice of last dim
:func:`scatter_to_sequence_parallel_region`            keep my slice of seq dim    all-gather seq dim
:func:`gather_from_sequence_parallel_region`           all-gather seq dim          reduce-scatter seq dim
:func:`reduce_scatter_to_sequence_parallel_region`     reduce-scatter seq dim      all-gather seq dim
=====================================================  ==========================  ==========================

The sequence dimension is ``sequence_dim`` (default 0, Megatron's ``[s, b, h]`` layout; pass 1 for
``[b, s, h]``). With a group of one rank every mapping is the identity and costs nothing.
Collectives go through :mod:`llmmem.parallel.collectives`, so they use llmmem's own engines where
they apply. Every call is synchronous on CPU; on CUDA it is ordered on the current stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmmem.parallel import collectives
from llmmem.parallel.groups import get_tensor_parallel_group


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    w = dist.get_world_size(group)
    if w == 1:
        return x
    if x.shape[dim] % w != 0:
        raise ValueError(
            f"llmmem.parallel: dimension {dim} has size {x.shape[dim]}, which is not divisible by "
            f"the tensor-parallel size {w}"
        )
    return x.chunk(w, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return collectives.all_reduce(x, group)  # out of place: the input may be a view another op needs

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return collectives.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather forward; in backward the gradient w.r.t. the gathered tensor is a partial sum on
    each rank (it fed a column-parallel matmul), so it is reduce-scattered, not merely split."""

    @staticmethod
    def forward(ctx, x, group, dim, grad_is_partial):
        ctx.group, ctx.dim, ctx.partial = group, dim, grad_is_partial
        return collectives.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return collectives.reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return collectives.reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, process_group=None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (entry of a column-parallel layer)."""
    return _CopyToRegion.apply(x, get_tensor_parallel_group(process_group))


def reduce_from_tensor_parallel_region(x: torch.Tensor, process_group=None) -> torch.Tensor:
    """All-reduce forward, identity backward (exit of a row-parallel layer)."""
    return _ReduceFromRegion.apply(x, get_tensor_parallel_group(process_group))


def scatter_to_tensor_parallel_region(x: torch.Tensor, process_group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers it."""
    return _ScatterToRegion.apply(x, get_tensor_parallel_group(process_group), -1)


def gather_from_tensor_parallel_region(x: torch.Tensor, process_group=None) -> torch.Tensor:
    """All-gather along the last dimension; backward keeps this rank's slice."""
    return _GatherFromRegion.apply(x, get_tensor_parallel_group(process_group), -1)


def scatter_to_sequence_parallel_region(x: torch.Tensor, process_group=None, *, sequence_dim: int = 0) -> torch.Tensor:
    """Keep this rank's slice of the sequence dimension; backward all-gathers it."""
    return _ScatterToRegion.apply(x, get_tensor_parallel_group(process_group), sequence_dim)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, process_group=None, *, sequence_dim: int = 0, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather along the sequence dimension.

    Backward reduce-scatters the gradient when the gathered tensor feeds a tensor-parallel
    computation (``tensor_parallel_output_grad=True``, the default: each rank holds a partial
    gradient), and only keeps this rank's slice when the consumer was replicated.
    """
    return _GatherFromSequenceRegion.apply(
        x, get_tensor_parallel_group(process_group), sequence_dim, tensor_parallel_output_grad
    )


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, process_group=None, *, sequence_dim: int = 0
) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of the sequence dimension; backward all-gathers."""
    return _ReduceScatterToSequenceRegion.apply(x, get_tensor_parallel_group(process_group), sequence_dim)
