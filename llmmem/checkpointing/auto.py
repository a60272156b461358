"""``auto_checkpoint``: profile a chain of blocks, plan it for a budget and run the plan."""

from __future__ import annotations

import torch.nn as nn

from llmmem.checkpointing.core import checkpoint
from llmmem.checkpointing.offload import offload_without_prefetch
from llmmem.checkpointing.plan import DEFAULT_SLOTS, CheckpointPlan, plan_checkpoints
from llmmem.checkpointing.profile import ChainProfile, as_block_list, run_mode

__all__ = ["auto_checkpoint", "AutoCheckpointed"]


class _Step:
    """What iterating an :class:`AutoCheckpointed` yields: the first block of a top-level item runs
    the whole item; the other blocks of a region pass their input through (it is already done)."""

    def __init__(self, owner, item) -> None:
        self._owner, self._item = owner, item

    def __call__(self, x):
        return self._owner._run_item(self._item, x) if self._item is not None else x


class AutoCheckpointed(nn.ModuleList):
    """The blocks of a chain, run according to a :class:`CheckpointPlan`.

    A ``ModuleList`` of the original blocks (same ``state_dict`` keys, ``len``, indexing). Calling
    it runs the whole chain: ``y = module(x)``. Iterating it (``for block in model.layers: x =
    block(x)``, as most models' forward do) yields one callable per block that together run the
    plan: only valid when the loop passes each output straight to the next block.

    Memory: what the plan predicts (``.plan``); time: the plan's recompute overhead.
    """

    def __init__(self, blocks, plan: CheckpointPlan, **checkpoint_options) -> None:
        super().__init__(blocks)
        if len(self) != plan.n_blocks:
            raise ValueError(f"auto_checkpoint: the plan is for {plan.n_blocks} blocks, got {len(self)}")
        self.plan = plan
        self._options = checkpoint_options
        self._offloaded = set(plan.offloaded)
        self._items = self._build(0, len(self))

    def _build(self, s: int, e: int) -> list:
        """Items of the sequence [s, e): ("block", i) or ("region", start, end, inner items)."""
        # The regions directly inside [s, e): maximal ones among those strictly inside it.
        inside = sorted(
            {r for r in self.plan.regions if s <= r[0] and r[1] <= e and r != (s, e)}, key=lambda r: (r[0], -r[1])
        )
        children, reach = {}, s
        for rs, re_ in inside:
            if rs >= reach:  # not nested in the previous maximal region
                children[rs] = re_
                reach = re_
        items, i = [], s
        while i < e:
            if i in children:
                items.append(("region", i, children[i], self._build(i, children[i])))
                i = children[i]
            else:
                items.append(("block", i))
                i += 1
        return items

    def _run_item(self, item, x):
        if item[0] == "block":
            i = item[1]
            return run_mode(self[i], x, self.plan.modes[i], **self._options)
        _, start, end, inner = item
        if (start, end) in self._offloaded:
            with offload_without_prefetch():
                return checkpoint(self._run_items, inner, x, **{**self._options, "offload": True})
        return checkpoint(self._run_items, inner, x, **self._options)

    def _run_items(self, items, x):
        for item in items:
            x = self._run_item(item, x)
        return x

    def forward(self, x):
        return self._run_items(self._items, x)

    def __iter__(self):
        firsts = {}
        for item in self._items:
            firsts[item[1]] = item
        return iter([_Step(self, firsts.get(i)) for i in range(len(self))])


def auto_checkpoint(
    blocks,
    sample_input,
    budget=0.5,
    *,
    slots: int = DEFAULT_SLOTS,
    profile: ChainProfile | None = None,
    offload: bool = False,
    host_bandwidth: float | None = None,
    **options,
) -> AutoCheckpointed:
    """Profile ``blocks``, plan them for ``budget`` and return a module that runs the plan.

    ``model.layers = llmmem.auto_checkpoint(model.layers, x0, budget="6GB")``: the result is an
    ``nn.ModuleList`` of the same blocks (same parameters and state_dict keys). ``budget`` is
    bytes, a string like ``"6GB"``, or a fraction of the activation memory without checkpointing.
    ``offload=True`` lets the planner keep some regions' inputs in host memory (those in
    ``.plan.offloaded`` run as ``llmmem.checkpoint(offload=True)``); ``host_bandwidth`` as in
    :func:`plan_checkpoints`. ``options`` are passed to :func:`llmmem.checkpoint` for every region
    (``preserve_rng_state``, ``determinism_check``, ...). The plan is in ``.plan``
    (``print(module.plan.describe())``).

    Raises :class:`llmmem.InfeasibleError` (a ``ValueError``) stating the smallest feasible budget.
    """
    blocks = as_block_list(blocks, "auto_checkpoint")
    plan = plan_checkpoints(
        blocks, sample_input, budget, slots=slots, profile=profile, offload=offload, host_bandwidth=host_bandwidth
    )
    return AutoCheckpointed(blocks, plan, **options)
