"""GradScaler on DTensor gradients (FSDP2's ``fully_shard``, torch's tensor parallelism): one
overflow flag per gradient, agreed by every rank.

A DTensor gradient's local shard is checked like a plain gradient, with a flag of its own; but it
is one rank's part of the gradient, so the step must be skipped on every rank when any rank's part
overflowed, and :meth:`GradScaler.overflowed_params` must name the same parameters everywhere.
:func:`agree` max-reduces the flags of each mesh's gradients over the mesh (one all-reduce of one
float per gradient, :func:`llmmem.dtensors.max_over_shards`) and folds them into that device's
``found_inf``. (torch's op on DTensors reduces ``found_inf`` once per dtype group, so its result
could only flag the whole group: every parameter was named for one inf.)

The collective runs in ``unscale_`` (or the ``step`` that unscales), which every rank calls each
iteration with the same parameters: it is built from the optimizer's DTensor parameters, not from
the gradients a rank happens to hold (a parameter without a gradient on one rank has a 0 flag
there), one call per (mesh, device), in the order of the parameters. It never runs in ``overflowed_params``, which a rank may call alone.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from llmmem.dtensors import is_dtensor, local, max_over_shards

__all__ = [
    "agree",
    "agree_found_inf",
    "dtensor_params",
    "mark_tensor_parallel",
    "tp_groups",
]

# The process group a parameter is split over by llmmem's tensor-parallel layers (plain tensors, each
# rank its own slice): an overflow in one rank's slice must skip the step on every rank of the group.
# Set through mark_tensor_parallel only: a parameter given the attribute otherwise is not looked for.
TENSOR_PARALLEL_GROUP_ATTR = "llmmem_tensor_parallel_group"
_marked = False  # whether any parameter was ever marked: until then no step looks for the mark


def mark_tensor_parallel(param: torch.Tensor, group) -> None:
    """Record that ``param`` is split over ``group`` (each rank its own slice)."""
    global _marked
    setattr(param, TENSOR_PARALLEL_GROUP_ATTR, group)
    _marked = True


def tp_groups(param_groups) -> list:
    """The tensor-parallel groups that ``param_groups``' parameters are split over (none, at no cost,
    without an initialised ``torch.distributed`` or before any parameter was marked)."""
    if not _marked:
        return []
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    found = {}
    for group in param_groups:
        for p in group["params"]:
            g = getattr(p, TENSOR_PARALLEL_GROUP_ATTR, None)
            if g is not None:
                found[id(g)] = g
    return list(found.values())


def agree_found_inf(found_inf_per_device: dict, groups: list) -> None:
    """Max-reduce each device's ``found_inf`` over each of ``groups`` (a collective on their ranks,
    which all call ``unscale_`` with the same parameters): a step skipped on one skips on all."""
    import torch.distributed as dist

    for found_inf in found_inf_per_device.values():
        for group in groups:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def dtensor_params(param_groups, resume: int = 0) -> list:
    """``(slot, parameter)`` for each DTensor parameter at flat position ``slot >= resume``."""
    if sys.modules.get("torch.distributed.tensor") is None:
        return []
    flat = (p for group in param_groups for p in group["params"])
    return [(slot, p) for slot, p in enumerate(flat) if slot >= resume and is_dtensor(p)]


def agree(members: list, flags_per_device: dict, found_inf_of: Callable, slots: list) -> None:
    """``members``: ``(k, slot, parameter)`` for every DTensor parameter of the optimizer, in its order
    (the same list on every rank), ``k`` its gradient's position in the checked list or None where
    this rank has no gradient for it (its flag is then 0), ``slot`` its flat position in the
    optimizer; ``flags_per_device``: ``{device: (uint8 flags, positions in the checked list)}`` as
    the check left them (the local shards' flags); ``slots``: the checked list's flat positions.
    Replaces those flags by their max over each mesh, adds the parameters this rank has no gradient
    for to the record (``slots`` and the flags, so that every rank names the same parameters), and
    raises the device's ``found_inf`` (``found_inf_of(device)``) to 1 where a flag is set. No host sync."""
    where = {}  # position in the checked list -> (device, index in that device's flags)
    for device, (_, positions) in flags_per_device.items():
        for j, k in enumerate(positions):
            where[k] = (device, j)
    groups: dict = {}  # (mesh, device) -> [(index in flags or None, slot, parameter)], in the parameters' order
    for k, slot, param in members:
        device, j = where[k] if k is not None else (local(param).device, None)
        groups.setdefault((param.device_mesh, device), []).append((j, slot, param))
    for (_, device), entries in groups.items():
        values = torch.zeros(len(entries), device=device)
        have = [(i, j) for i, (j, _, _) in enumerate(entries) if j is not None]
        if have:
            flags = flags_per_device[device][0]
            at = torch.tensor([i for i, _ in have], dtype=torch.long).to(device, non_blocking=True)
            index = torch.tensor([j for _, j in have], dtype=torch.long).to(device, non_blocking=True)
            values.index_copy_(0, at, flags.index_select(0, index).float())
        agreed = max_over_shards(values, [p for _, _, p in entries])
        if have:
            flags.index_copy_(0, index, agreed.index_select(0, at).ne(0).to(flags.dtype))
        missing = [i for i, (j, _, _) in enumerate(entries) if j is None]
        if missing:
            old, positions = flags_per_device.get(device, (torch.zeros(0, dtype=torch.uint8, device=device), []))
            at = torch.tensor(missing, dtype=torch.long).to(device, non_blocking=True)
            added = agreed.index_select(0, at).ne(0).to(old.dtype)
            new_positions = list(range(len(slots), len(slots) + len(missing)))
            slots.extend(entries[i][1] for i in missing)
            flags_per_device[device] = (torch.cat([old, added]), list(positions) + new_positions)
        found_inf = found_inf_of(device)
        found_inf.copy_(torch.maximum(found_inf, agreed.max()))
