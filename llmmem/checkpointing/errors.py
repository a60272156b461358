"""The error of activation checkpointing, in a module of its own so that every part of the
checkpointing package (regions, selective recompute, rematerialisation) can raise it."""

from __future__ import annotations

import torch.utils.checkpoint as _torch_ckpt

from llmmem.errors import LlmmemError

__all__ = ["CheckpointError"]


class CheckpointError(_torch_ckpt.CheckpointError, LlmmemError):
    """The recompute of a checkpointed region did not reproduce what the forward saved.

    A subclass of ``torch.utils.checkpoint.CheckpointError`` (so code that catches torch's error
    keeps working) and of :class:`llmmem.LlmmemError`.
    """
