"""Says when a training loop keeps the model's output through the backward that a plan assumed freed.

A plan profiled on a batch (``auto_checkpoint(model, sample=batch)``) runs the step as
``model(**batch).loss.backward()``: the output (the logits, mostly) is gone before the backward.
A loop written ``out = model(**batch); out.loss.backward()`` (Hugging Face's ``Trainer`` does so)
holds it through the backward, above the budget the plan was made for. This watches the model's
output by weak references and, when the gradient reaches the end of the chain (the head and loss
are differentiated by then, so autograd holds none of it any more), warns once if some of it is
still alive, with its size and the two ways out.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.utils import _pytree as pytree

from llmmem.errors import user_stacklevel
from llmmem.units import format_bytes

__all__ = ["OutputWatch"]


class OutputWatch:
    """Installed on ``model`` and its chain's last block for a plan whose profile freed the output;
    :meth:`remove` takes the hooks away. Costs a weak reference per output tensor and a gradient
    hook per step; keeps nothing alive."""

    def __init__(self, model: torch.nn.Module, last_block: torch.nn.Module, predicted_peak: int, budget: int) -> None:
        self.predicted_peak, self.budget = predicted_peak, budget
        self.outputs: list = []  # weak references to the last forward's output tensors
        self.warned = False
        self._handles = [
            model.register_forward_hook(self._on_model_output),
            last_block.register_forward_hook(self._on_chain_output),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.outputs = []

    def _on_model_output(self, module, args, out) -> None:
        if self.warned or not torch.is_grad_enabled():
            return
        # the loss (a scalar) is what the backward starts from: the rest is what a loop may keep
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel() > 1]
        self.outputs = [weakref.ref(t) for t in tensors]

    def _on_chain_output(self, module, args, out) -> None:
        if self.warned or not torch.is_grad_enabled():
            return
        h = (
            out
            if isinstance(out, torch.Tensor)
            else next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        )
        if h is not None and h.requires_grad:
            h.register_hook(self._on_chain_backward)

    def _on_chain_backward(self, grad):
        alive = [t for t in (r() for r in self.outputs) if t is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
        held = sum(storages.values())
        if held and not self.warned:
            self.warned = True
            warnings.warn(
                f"llmmem.auto_checkpoint: the model's output ({format_bytes(held)} in {len(alive)} tensor(s), e.g. "
                f"the logits) is still alive during the backward, but the plan was profiled on a batch, whose "
                f"step frees it before the backward: this step can peak up to {format_bytes(held)} above the "
                f"predicted {format_bytes(self.predicted_peak)} (budget {format_bytes(self.budget)}). Free it "
                f"before the backward (loss = model(**batch).loss; loss.backward()), or plan with sample= a "
                f"callable that runs your training step",
                stacklevel=user_stacklevel(),
            )
        self.outputs = []
        return grad
