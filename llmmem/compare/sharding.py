"""The ZeRO-2/3 rows: torch's FSDP2 over the data-parallel ranks, and what each rank then holds of
the model state (parameters, gradients, optimizer state), counted on its local shards."""

from __future__ import annotations

import torch

from llmmem.dtensors import local


def shard_over(model, dp_group, device, *, reshard: bool) -> None:
    """``fully_shard`` on each block of ``model`` (a GPT or its tensor-parallel form), then on the
    model, over ``dp_group``: one block's parameters at a time are gathered. ``reshard`` (ZeRO-3)
    frees them again after the block's forward; the root keeps its own (backward starts with them)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dp_group, device.type)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def local_bytes(tensors, *, elements: bool = False) -> int:
    """Bytes (or elements) of ``tensors`` that this rank holds: a DTensor's local shard."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        shard = local(t)
        total += shard.numel() * (1 if elements else shard.element_size())
    return total


def state_bytes(model, optimizer) -> dict:
    """This rank's model state, in bytes: ``{"parameters", "gradients", "optimizer"}`` (ZeRO-1: the
    rank's own optimizer; FSDP2: the shards)."""
    opt = getattr(optimizer, "optim", optimizer)
    moments = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    params = list(model.parameters())
    return {
        "parameters": local_bytes(params),
        "gradients": local_bytes(p.grad for p in params),
        "optimizer": local_bytes(moments),
    }
