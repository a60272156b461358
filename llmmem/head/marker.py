"""Which models compute their loss with the fused head: ``llmmem.patch_lm_loss`` marks a model,
the estimator, the planner and ``oom_report`` read the mark (so none of them imports the patching
code, and a model patched by hand can be marked too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_ATTR = "_llmmem_fused_head"


@dataclass(frozen=True)
class FusedHead:
    """What a patched model's loss is: the head ``[vocab, hidden]`` (``tied`` to the input
    embedding or not), Gemma 2's ``softcap`` (None without), the rows of logits a chunk
    (``chunk_size``, None: from the memory target of ``llmmem.head.chunks.chunk_rows``)."""

    vocab: int
    hidden: int
    softcap: Optional[float] = None
    tied: bool = False
    chunk_size: Optional[int] = None


def mark(model: torch.nn.Module, info: FusedHead) -> None:
    # object.__setattr__: a plain attribute, never a submodule, parameter or buffer
    object.__setattr__(model, _ATTR, info)


def unmark(model: torch.nn.Module) -> None:
    model.__dict__.pop(_ATTR, None)


def fused_head(model: torch.nn.Module) -> Optional[FusedHead]:
    """The model's :class:`FusedHead` while it is patched, else None."""
    info = model.__dict__.get(_ATTR)
    return info if isinstance(info, FusedHead) else None
