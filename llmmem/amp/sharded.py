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
iteration with the same parameters, whatever its own gradients hold: one call per (mesh, device),
in the order of the parameters. It never runs in ``overflowed_params``, which a rank may call alone.
"""

from __future__ import annotations

from typing import Callable

import torch

from llmmem.dtensors import max_over_shards

__all__ = ["agree"]


def agree(sharded: list, flags_per_device: dict, found_inf_of: Callable[[torch.device], torch.Tensor]) -> None:
    """``sharded``: ``(k, gradient)`` for each DTensor gradient, ``k`` its position in the checked
    list; ``flags_per_device``: ``{device: (uint8 flags, positions in the checked list)}`` as the
    check left them (the local shards' flags). Replaces those flags by their max over each mesh and
    raises the device's ``found_inf`` (``found_inf_of(device)``) to 1 where one is set. No host sync."""
    where = {}  # position in the checked list -> (device, index in that device's flags)
    for device, (_, positions) in flags_per_device.items():
        for j, k in enumerate(positions):
            where[k] = (device, j)
    groups: dict = {}  # (mesh, device) -> [(index in flags, gradient)], in the parameters' order
    for k, grad in sharded:
        device, j = where[k]
        groups.setdefault((grad.device_mesh, device), []).append((j, grad))
    for (_, device), members in groups.items():
        flags = flags_per_device[device][0]
        index = torch.tensor([j for j, _ in members], dtype=torch.long).to(device, non_blocking=True)
        agreed = max_over_shards(flags.index_select(0, index).float(), [g for _, g in members])
        flags.index_copy_(0, index, agreed.ne(0).to(flags.dtype))
        found_inf = found_inf_of(device)
        found_inf.copy_(torch.maximum(found_inf, agreed.max()))
