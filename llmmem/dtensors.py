"""What a process holds of a tensor that may be a DTensor (FSDP2's ``fully_shard``, torch's tensor
parallelism): its local shard. Memory accounting (storages, their bytes) works on that; a DTensor's
own storage is a placeholder without data. Per-shard findings (an overflow in one rank's shard)
are agreed over the mesh with :func:`max_over_shards`. Never imports ``torch.distributed`` at
import: a DTensor exists only once its module is loaded."""

from __future__ import annotations

import sys

import torch

__all__ = ["is_dtensor", "local", "local_share", "max_over_shards"]


def is_dtensor(t) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if it is a DTensor (no copy, no graph), else ``t``."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def local_share(tensors) -> float:
    """The fraction of ``tensors``' elements this process holds: their local shards' elements over
    their whole ones (1.0 when none is a DTensor or they are empty). What scales a figure made for
    the whole model (an estimate of its gradients) to this rank's."""
    whole = held = 0
    for t in tensors:
        n = t.numel()  # a DTensor's numel() is the whole tensor's
        whole += n
        held += local(t).numel() if is_dtensor(t) else n
    return held / whole if whole else 1.0


def max_over_shards(values: torch.Tensor, tensors) -> torch.Tensor:
    """The elementwise max of ``values`` (one entry per DTensor of ``tensors``, all on one mesh)
    over the ranks that hold other parts of them: one all-reduce over the mesh dimensions on which
    some of them is not replicated; ``values`` itself, and no collective, when none is.

    A collective: every rank of those dimensions must call it with the same DTensors in the same
    order, or it waits for the others (within the process group's timeout).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = tensors[0].device_mesh
    split = {i for t in tensors for i, p in enumerate(t.placements) if not p.is_replicate()}
    if not split:  # replicated everywhere: every rank holds the same values already
        return values
    # the collective runs on the mesh's device type (NCCL takes no CPU tensors; FSDP2's CPU
    # offload keeps gradients on the host under a GPU mesh)
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    placements = [Partial("max") if i in split else Replicate() for i in range(mesh.ndim)]
    part = DTensor.from_local(values.to(device), mesh, placements, run_check=False)
    return part.full_tensor().to(values.device)
