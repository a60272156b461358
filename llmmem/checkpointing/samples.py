"""Samples and steps: what ``sample=`` may be, and the training step made from it.

A sample is a batch (a tensor, a tuple or list of the model's positional arguments, a mapping of
its keyword arguments) or a callable running one training step (:func:`is_step`).
:func:`sample_step` makes the step of a batch (the forward, :func:`loss_of` its output, the
backward), :func:`forward_of` its forward alone; :func:`describe_value` says what a sample holds,
for the errors about it.

Not here: running the step with its blocks recorded (:mod:`llmmem.checkpointing.recording`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["loss_of", "is_step", "forward_of", "sample_step", "describe_value", "SAMPLE_FORMS"]


def loss_of(out) -> torch.Tensor:
    """The loss of a model's output: a scalar tensor itself; ``.loss`` or ``["loss"]`` (Hugging
    Face outputs); the first scalar floating-point tensor of a tuple; else the sum of the first
    floating-point tensor (give ``sample`` as a callable to measure a real loss instead)."""
    if isinstance(out, torch.Tensor):
        return out if out.numel() == 1 else out.sum()
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for t in leaves:
        if t.numel() == 1 and t.requires_grad:
            return t
    for t in leaves:
        if t.requires_grad:
            return t.sum()
    raise TypeError(
        f"sample: the model returned {type(out).__name__} with no floating-point tensor to take a loss from"
    )


def is_step(sample) -> bool:
    """Is ``sample`` a callable running a training step (rather than a batch)?"""
    return callable(sample) and not isinstance(sample, (torch.Tensor, nn.Module))


def forward_of(model, sample) -> Callable[[], object]:
    """The model's forward on a batch ``sample`` (a tensor, a tuple/list or a mapping), as a callable."""
    if isinstance(sample, torch.Tensor):
        return lambda: model(sample)
    if isinstance(sample, (tuple, list)):
        return lambda: model(*sample)
    if isinstance(sample, Mapping):
        return lambda: model(**dict(sample))
    raise TypeError(f"sample: expected {SAMPLE_FORMS}, got {type(sample).__name__}")


def sample_step(model, sample) -> Callable[[], None]:
    """One training step on ``sample``: a callable is the step itself; a tensor, a tuple/list or a
    mapping are the model's inputs (``model(x)``, ``model(*sample)``, ``model(**sample)``), and the
    step is that forward, :func:`loss_of` its output, and the backward. Such a step carries
    ``called_as`` (how the model is called, with the sample's types), which :func:`record_step`
    puts in the ``TypeError`` it raises when the model refuses the sample before any block ran."""
    if is_step(sample):
        return sample
    call = forward_of(model, sample)
    how = (
        "model(sample)"
        if isinstance(sample, torch.Tensor)
        else "model(*sample)"
        if isinstance(sample, (tuple, list))
        else "model(**sample)"
    )

    def step() -> None:
        out = call()
        loss = loss_of(out)
        del out  # nothing but the loss outlives the forward, as in a training loop
        loss.backward()

    # what record_step says when the model refuses the sample before any block ran
    step.called_as = f"{how} with sample = {describe_value(sample)}"
    step.hint = ""
    if isinstance(sample, (tuple, list)) and len(sample) == 1 and isinstance(sample[0], Mapping):
        step.hint = "; sample holds one dict: for model(**batch), give the dict itself (sample=batch)"
    return step


SAMPLE_FORMS = (
    "a batch (a tensor: model(sample); a tuple or list of the model's positional arguments: model(*sample); a "
    "dict of its keyword arguments: model(**sample)) or a callable running one training step"
)


def describe_value(v, depth: int = 0) -> str:
    """A short description of a sample's types: tensors by shape and dtype, containers by their items."""
    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
    if depth >= 2:
        return type(v).__name__
    if isinstance(v, Mapping):
        items = ", ".join(f"{k!r}: {describe_value(x, depth + 1)}" for k, x in list(v.items())[:6])
        more = ", ..." if len(v) > 6 else ""
        return f"{type(v).__name__} {{{items}{more}}}"
    if isinstance(v, (tuple, list)):
        items = ", ".join(describe_value(x, depth + 1) for x in v[:6])
        more = ", ..." if len(v) > 6 else ""
        return f"{type(v).__name__} of {len(v)} [{items}{more}]"
    return type(v).__name__
