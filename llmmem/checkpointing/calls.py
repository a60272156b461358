"""Block calls: how a model calls a block, and which argument is the chain's activation.

A :class:`BlockCall` holds a block's positional and keyword arguments and says which one is the
chain activation (the output of the block before); :func:`find_hidden` finds it among a call's
arguments, :func:`hidden_of` in a block's output; :func:`without_cache` takes a Hugging Face
key/value cache out of a call, as a recompute needs.

Not here: running a call in a mode (:mod:`llmmem.checkpointing.modes`), measuring it
(:mod:`llmmem.checkpointing.costs`), recording the calls of a model's step
(:mod:`llmmem.checkpointing.recording`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

__all__ = ["BlockCall", "hidden_of", "find_hidden", "without_cache"]


def hidden_of(out) -> torch.Tensor:
    """The chain activation in a block's output: the output itself, or the first element of a
    tuple or list (Hugging Face layers return either), or the first tensor of a mapping."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, Mapping):
        for v in out.values():
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(
        f"a block returned {type(out).__name__}: expected a tensor, or a tuple or list whose first element is "
        "the tensor the next block takes"
    )


_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(obj) -> bool:
    """A Hugging Face key/value cache (any ``transformers`` class named ``Cache`` or derived from it)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(obj).__mro__)


def without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
    """``(args, kwargs, what changed)`` with the key/value cache taken out, as Hugging Face's
    ``GradientCheckpointingLayer`` does for a checkpointed layer: a recompute runs the layer again and
    must not write the cache a second time. ``use_cache`` becomes ``False``; ``cache`` /
    ``past_key_values`` / ``past_key_value`` / ``layer_past`` keywords and positional cache objects
    become ``None``."""
    changed = []
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
        changed.append("use_cache=False")
    for name in _CACHE_KEYWORDS:
        if kwargs.get(name) is not None:
            kwargs = {**kwargs, name: None}
            changed.append(f"{name}=None")
    if any(_is_cache(a) for a in args):
        args = tuple(None if _is_cache(a) else a for a in args)
        changed.append("positional cache=None")
    return args, kwargs, changed


@dataclass
class BlockCall:
    """How a block is called: its positional and keyword arguments, and where among them the chain
    activation is (``hidden``: an index into ``args`` or a keyword)."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    hidden: int | str = 0
    # whether the step differentiates the chain activation: not the first block's input when what
    # comes before the chain is frozen (a LoRA model's embeddings), so no gradient of it is made
    input_grad: bool = True

    @property
    def hidden_tensor(self) -> torch.Tensor:
        return self.args[self.hidden] if isinstance(self.hidden, int) else self.kwargs[self.hidden]

    def with_hidden(self, h) -> tuple[tuple, dict]:
        if isinstance(self.hidden, int):
            args = list(self.args)
            args[self.hidden] = h
            return tuple(args), dict(self.kwargs)
        return tuple(self.args), {**self.kwargs, self.hidden: h}

    def other_tensors(self) -> list:
        """The tensors of the call besides the chain activation (masks, position embeddings, ...)."""
        args, kwargs = self.with_hidden(None)
        return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def signature(self) -> tuple:
        """What the cost of a call depends on, besides the block: shapes, dtypes, devices and
        whether each tensor needs a gradient; the other arguments by value when simple."""

        def describe(v):
            if isinstance(v, torch.Tensor):
                return ("tensor", tuple(v.shape), v.dtype, v.device, v.requires_grad)
            if v is None or isinstance(v, (bool, int, float, str)):
                return v
            return type(v).__name__

        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        return (self.hidden, self.input_grad, str(spec), tuple(describe(v) for v in leaves))

    def fresh_input(self) -> torch.Tensor:
        """A new leaf with the chain activation's value, needing a gradient as the step's does."""
        h = self.hidden_tensor
        return h.detach().clone().requires_grad_(self.input_grad and h.is_floating_point())


def find_hidden(args: tuple, kwargs: dict, previous=None) -> tuple[int | str | None, bool]:
    """``(where, linked)``: the argument that is ``previous`` (the last block's output) if any
    (``linked``), else the first floating-point tensor among the positional then keyword arguments."""
    if previous is not None:
        for i, a in enumerate(args):
            if a is previous:
                return i, True
        for k, v in kwargs.items():
            if v is previous:
                return k, True
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return i, False
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k, False
    return None, False
