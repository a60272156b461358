"""Whether ``llmmem.patch_lm_loss`` would take a model, asked without patching it: the advice that
offers the fused head (the estimator's fix, ``oom_report``) must not offer a call that raises.

It runs the same checks as :func:`llmmem.head.patch.patch_lm_loss`, in its order; nothing is
patched, no forward runs. Reading a Hugging Face model's ``loss_function`` imports
``transformers.loss.loss_utils``, which the model's own module has loaded already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from llmmem.head import patch
from llmmem.head.marker import fused_head

__all__ = ["Refusal", "patch_refusal"]


@dataclass(frozen=True)
class Refusal:
    """Why ``patch_lm_loss`` refuses a model: ``kind`` is ``"module"`` (not an ``nn.Module``),
    ``"patched"`` (already), ``"architecture"`` (a class it does not know, or one that overrides
    its forward), ``"head"`` (not a plain ``nn.Linear``: an adapter or a quantized head) or
    ``"loss"`` (a custom ``loss_function``); ``message`` what it raises with."""

    kind: str
    message: str


def patch_refusal(model) -> Optional[Refusal]:
    """Why ``llmmem.patch_lm_loss(model)`` would refuse ``model``, or None where it would patch it."""
    if not isinstance(model, nn.Module):
        return Refusal("module", f"patch_lm_loss: model must be an nn.Module, got {type(model).__name__}")
    if patch._installed(model) is not None or fused_head(model) is not None:
        return Refusal("patched", f"patch_lm_loss: this {type(model).__name__} is patched already")
    try:
        arch = patch._architecture(model)
    except TypeError as exc:
        return Refusal("architecture", str(exc))
    try:
        patch._head(model, arch)
    except TypeError as exc:
        return Refusal("head", str(exc))
    if arch.hugging_face:
        try:
            patch._check_loss_function(model)
        except ValueError as exc:
            return Refusal("loss", str(exc))
    return None
