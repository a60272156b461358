"""The records the native step reads, one tuple of ints per parameter (csrc/python/optim.c):
(param, master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, step, numel, seed,
param_dtype, grad, grad_dtype), addresses as ints, 0 for none. Everything but the gradient is
the same from step to step, so the optimizer keeps a parameter's :func:`head_of` and adds the
gradient's two fields each step."""

from __future__ import annotations

from typing import Optional

import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def head_of(p: torch.Tensor, master: Optional[torch.Tensor], state: dict, seed: int) -> tuple:
    """The gradient-independent fields of a parameter's record (``state`` holds its ``step``,
    ``exp_avg``, ``exp_avg_sq`` and, quantized, their scales), all plain local tensors."""
    return (
        p.data_ptr(),
        _ptr(master),
        state["exp_avg"].data_ptr(),
        state["exp_avg_sq"].data_ptr(),
        _ptr(state.get("exp_avg_scale")),
        _ptr(state.get("exp_avg_sq_scale")),
        state["step"].data_ptr(),
        p.numel(),
        seed,
        DTYPE_CODES[p.dtype],
    )


def record(head: tuple, grad: torch.Tensor) -> tuple:
    return head + (grad.data_ptr(), DTYPE_CODES[grad.dtype])
