"""Torch-facing glue of the optimizer's kernels: one call per (parameter group, state format,
device), tensors in, C core (``llmmem._C``) calls out.

- CPU tensors go to the threaded C step (the GIL is released while it runs; as many threads as
  ``torch.get_num_threads()`` allows).
- CUDA tensors go to the CUDA step when llmmem was built with CUDA and its kernels run on that
  GPU and pass their known-answer check there (:mod:`llmmem.optim.cuda`, once per GPU): queued
  on the current stream, no host synchronisation.
- Any other device, or CUDA without usable kernels, runs :mod:`llmmem.optim.reference` (the same
  arithmetic in torch ops, bit for bit; slower), with one warning per device type.

Tensors reach here checked by :mod:`llmmem.optim.adamw` (dtype, device, size) and as plain local
tensors (a DTensor's ``to_local()``): ``llmmem._C.optim_*`` trust the addresses they get.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from llmmem._devices import cuda_index as _cuda_index
from llmmem._native import native
from llmmem.optim import cuda, reference
from llmmem.optim.formats import Format

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass
class Item:
    """One parameter's step: its (local, plain) weight and gradient, fp32 master or None, state
    dict (``step``, the moments, their scales) and stochastic-rounding seed."""

    param: torch.Tensor
    grad: torch.Tensor
    master: Optional[torch.Tensor]
    state: dict
    seed: int


@dataclass(frozen=True)
class Hyper:
    """A group's hyper-parameters as the kernels take them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool
    stochastic_rounding: bool

    def as_dict(self) -> dict:
        return self.__dict__.copy()


_warned: set = set()


def _warn_fallback(device: torch.device, why: str) -> None:
    if device.type not in _warned:
        _warned.add(device.type)
        warnings.warn(
            f"llmmem.optim: {why}; stepping {device.type} parameters with torch ops (llmmem.optim.reference: "
            "the same results, several passes over memory instead of one)",
            RuntimeWarning,
            stacklevel=4,
        )


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def step(items: list[Item], fmt: Format, hp: Hyper, device: torch.device, reference_only: bool = False) -> None:
    """One AdamW step of every item (all on ``device``, all in ``fmt``), in place."""
    if not items:
        return
    if not reference_only:
        if device.type == "cpu":
            _step_native(items, fmt, hp, device)
            return
        why = cuda.unsupported_reason(device) if device.type == "cuda" else "llmmem's kernels do not cover this device"
        if why is None:
            _step_native(items, fmt, hp, device)
            return
        _warn_fallback(device, why)
    for it in items:
        _step_reference(it, fmt, hp)


def _contiguous_views(it: Item):
    """The item's param and grad as contiguous tensors (copies where they are strided), and
    whether the param is a copy to write back."""
    p = it.param if it.param.is_contiguous() else it.param.contiguous()
    g = it.grad if it.grad.is_contiguous() else it.grad.contiguous()
    return p, g, p is not it.param


def _step_native(items: list[Item], fmt: Format, hp: Hyper, device: torch.device) -> None:
    records, keep, write_back = [], [], []
    for it in items:
        p, g, copied = _contiguous_views(it)
        keep.append((p, g))
        if copied:
            write_back.append((it.param, p))
        s = it.state
        records.append(
            (
                p.data_ptr(),
                g.data_ptr(),
                _ptr(it.master),
                s["exp_avg"].data_ptr(),
                s["exp_avg_sq"].data_ptr(),
                _ptr(s.get("exp_avg_scale")),
                _ptr(s.get("exp_avg_sq_scale")),
                s["step"].data_ptr(),
                p.numel(),
                it.seed,
                DTYPE_CODES[p.dtype],
                DTYPE_CODES[g.dtype],
            )
        )
    native.optim_adamw_step(
        records,
        hp.lr,
        hp.beta1,
        hp.beta2,
        hp.eps,
        hp.weight_decay,
        hp.decoupled,
        hp.maximize,
        fmt.code,
        fmt.block or 256,
        hp.stochastic_rounding,
        torch.get_num_threads(),
        **cuda._launch_args(device, _cuda_index(device) if device.type == "cuda" else -1),
    )
    for dst, src in write_back:
        dst.copy_(src)


def _step_reference(it: Item, fmt: Format, hp: Hyper) -> None:
    p, g, copied = _contiguous_views(it)
    tensors = {"param": p, "grad": g, "master": it.master, "seed": it.seed, **it.state}
    reference.adamw_step(tensors, fmt, hp.as_dict())
    if copied:
        it.param.copy_(p)
