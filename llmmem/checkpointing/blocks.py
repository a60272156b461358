"""Block lists: the checks a chain of blocks passes before it is profiled or planned.

:func:`as_block_list` takes an ``nn.Sequential``, an ``nn.ModuleList`` or a list of modules;
:func:`check_distinct` refuses a module that is twice in the chain and two blocks that share a
parameter that trains (the planner's model is a chain of distinct blocks).

Not here: finding a model's blocks (:mod:`llmmem.checkpointing.auto`,
:mod:`llmmem.checkpointing.stacks`).
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

__all__ = ["as_block_list", "check_distinct"]


def as_block_list(blocks, who: str) -> list:
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        blocks = list(blocks)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise TypeError(f"{who}: blocks must be a non-empty nn.Sequential, nn.ModuleList or list of modules")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"{who}: blocks[{i}] must be an nn.Module, got {type(b).__name__}")
    check_distinct(blocks, who)
    return list(blocks)


def check_distinct(blocks: Sequence[nn.Module], who: str) -> None:
    """Raise ``ValueError`` when a module is twice in the chain, or two blocks share a parameter that
    trains. The planner's model is a chain of distinct blocks: a parameter used by two blocks of
    one step has its first gradient held by autograd (which sums the two before accumulating) from
    the later block's backward until the earlier one's, memory the plan does not count; and a plan
    runs in place per module, so a module cannot be two blocks."""
    first: dict = {}
    for j, b in enumerate(blocks):
        i = first.setdefault(id(b), j)
        if i != j:
            raise ValueError(
                f"{who}: blocks[{j}] is blocks[{i}], the same {type(b).__name__} module: each block of the chain must "
                "be a module of its own (a module run several times in a step, sharing its weights, is not a chain "
                "the planner can budget: its parameters' gradients are held between its uses)"
            )
    owner: dict = {}
    for j, b in enumerate(blocks):
        for name, p in b.named_parameters():
            if not p.requires_grad:
                continue
            i, other = owner.setdefault(id(p), (j, name))
            if i != j:
                raise ValueError(
                    f"{who}: blocks[{i}] and blocks[{j}] share a parameter that trains ({other!r} of blocks[{i}] is "
                    f"{name!r} of blocks[{j}], shape {list(p.shape)}): the planner needs blocks that share no trained "
                    "weights (autograd holds a shared weight's gradient from the later block's backward until the "
                    "earlier one's, memory the plan does not count)"
                )
