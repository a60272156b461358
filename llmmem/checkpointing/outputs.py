"""Says when a training loop keeps the model's output through the backward that a plan assumed freed.

A plan profiled on a batch (``auto_checkpoint(model, sample=batch)``) runs the step as
``model(**batch).loss.backward()``: the output (the logits, mostly) is gone before the backward.
A loop written ``out = model(**batch); out.loss.backward()`` (keeping ``out`` to log the logits,
say) holds it through the backward, above the budget the plan was made for. This watches, by weak
references, the output tensors made after the chain's last block (the head's: hidden states of
earlier blocks or attention probabilities returned with the output are held by autograd anyway,
and the plan counts them). When the gradient reaches the end of the chain (the head and loss are
differentiated by then, so autograd holds none of those any more), it warns once if some are still
alive, with their size and the two ways out.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.utils import _pytree as pytree

from llmmem.checkpointing.calls import hidden_of
from llmmem.errors import user_frame
from llmmem.units import format_bytes

__all__ = ["OutputWatch"]


def _order(t: torch.Tensor) -> int:
    """Where ``t`` was made in the forward (autograd's sequence number of its node); -1 if no node."""
    node = t.grad_fn
    return node._sequence_nr() if node is not None else -1


class OutputWatch:
    """Installed on ``model`` and its chain's last block for a plan whose profile freed the output;
    :meth:`remove` takes the hooks away. Costs a weak reference per output tensor and a gradient
    hook per step; keeps nothing alive."""

    def __init__(self, model: torch.nn.Module, last_block: torch.nn.Module, predicted_peak: int, budget: int) -> None:
        self.predicted_peak, self.budget = predicted_peak, budget
        self.outputs: list = []  # weak references to the last forward's head outputs
        self.where = None  # (file, line) of the user's call of the model
        self.chain_end = -1  # sequence number of the last block's output node in this forward
        self.warned = False
        self._handles = [
            last_block.register_forward_hook(self._on_chain_output),
            model.register_forward_hook(self._on_model_output),
        ]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["outputs"] = []  # weak references (of a forward under way) are not kept by a copy
        return state

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.outputs = []

    def _on_chain_output(self, module, args, out) -> None:
        # under torch.compile the graph's own autograd nodes are not the eager ones this reads
        if self.warned or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        try:
            h = hidden_of(out)
        except TypeError:  # not a chain block's output: the runner's own call says so
            return
        if h.requires_grad:
            self.chain_end = _order(h)
            h.register_hook(self._on_chain_backward)

    def _on_model_output(self, module, args, out) -> None:
        if self.warned or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        # made after the chain's end: the head's (the loss, a scalar, is what the backward starts from)
        tensors = [
            t
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.numel() > 1 and _order(t) > self.chain_end
        ]
        self.outputs = [weakref.ref(t) for t in tensors]
        # the line that holds the output: the backward may run on a thread with no user frame
        frame = user_frame()
        self.where = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None

    def _on_chain_backward(self, grad):
        alive = [t for t in (r() for r in self.outputs) if t is not None]
        self.outputs = []
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
        held = sum(storages.values())
        if not held or self.warned:
            return grad
        self.warned = True
        largest = max(alive, key=lambda t: t.untyped_storage().nbytes())
        message = (
            f"llmmem.auto_checkpoint: {format_bytes(held)} of the model's output ({len(alive)} tensor(s), the "
            f"largest of shape {tuple(largest.shape)}) is still alive during the backward, but the plan was "
            f"profiled on a batch, whose step frees the output before the backward: this step can peak up to "
            f"{format_bytes(held)} above the predicted {format_bytes(self.predicted_peak)} (budget "
            f"{format_bytes(self.budget)}). Keep only the loss through the backward, or plan with sample= a "
            f"callable that runs your training step"
        )
        if self.where is not None:
            warnings.warn_explicit(message, UserWarning, *self.where)
        else:
            warnings.warn(message, UserWarning, stacklevel=2)
        return grad
