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
from llmmem.optim.records import head_of, record


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


def native_route(device: torch.device) -> Optional[str]:
    """None when ``device``'s parameters go to llmmem's own kernels, else why not."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return cuda.unsupported_reason(device)
    return "llmmem's kernels do not cover this device"


class Batch:
    """The records of one native step call (one group, format and device): what the C core
    reads, and the tensors that must stay alive and be written back around the call."""

    __slots__ = ("records", "keep", "write_back")

    def __init__(self) -> None:
        self.records: list = []
        self.keep: list = []
        self.write_back: list = []

    def add(self, it: Item) -> None:
        """An item, made contiguous where it is strided (its weight written back after)."""
        p, g, copied = _contiguous_views(it)
        self.keep.append((p, g, it.master, it.state))
        if copied:
            self.write_back.append((it.param, p))
        self.records.append(record(head_of(p, it.master, it.state, it.seed), g))


def run(batch: Batch, fmt: Format, hp: Hyper, device: torch.device) -> None:
    """One native step of a batch's records (each a :func:`head_of` tuple + the gradient's
    address and dtype code), then the write-backs."""
    if not batch.records:
        return
    native.optim_adamw_step(
        batch.records,
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
    for dst, src in batch.write_back:
        dst.copy_(src)


def step(items: list[Item], fmt: Format, hp: Hyper, device: torch.device, reference_only: bool = False) -> None:
    """One AdamW step of every item (all on ``device``, all in ``fmt``), in place."""
    if not items:
        return
    if not reference_only:
        why = native_route(device)
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
    batch = Batch()
    for it in items:
        batch.add(it)
    run(batch, fmt, hp, device)


def _step_reference(it: Item, fmt: Format, hp: Hyper) -> None:
    p, g, copied = _contiguous_views(it)
    tensors = {"param": p, "grad": g, "master": it.master, "seed": it.seed, **it.state}
    reference.adamw_step(tensors, fmt, hp.as_dict())
    if copied:
        it.param.copy_(p)


def feature_status() -> tuple:
    """(usable, detail) for ``python -m llmmem info``."""
    from llmmem._cuda_build import cuda_kernels_built
    from llmmem._native import available, load_error

    if not available():
        return False, f"C core not loaded: {load_error!r}"
    formats = "AdamW over fp32/bf16/int8/int4 state"
    if not cuda_kernels_built():
        return True, f"CPU kernel ({formats}); CUDA kernels not built: the torch-ops reference on GPUs"
    try:
        gpu = torch.cuda.is_available()
    except Exception:
        gpu = False
    if not gpu:
        return True, f"CPU kernel ({formats}); CUDA kernels built, but no usable GPU here"
    return True, f"CPU + CUDA kernels ({formats}); each GPU's are checked against the C reference on first use"
