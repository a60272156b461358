"""The CPU fast path of ``GradScaler.unscale_``: one C call (``llmmem._C.scaler_unscale_param_groups``,
csrc/python/amp_params.c) walks an optimizer's param_groups, reads and checks every gradient and
runs the unscale + non-finite check on all of them. On lists of thousands of small gradients the
per-gradient Python work of the general path costs as much as the kernel.

This module owns the whole protocol around that call, so that the scaler makes one dispatch:

- **hand-over**: the walk takes only the plain case (exact ``torch.Tensor``/``nn.Parameter``
  parameters, gradients None or plain contiguous aligned CPU tensors of a supported dtype, fp16
  only when allowed). Otherwise it changes nothing and :func:`unscale_` returns None: the caller's
  general path does the whole step and raises its usual errors.
- **resume**: from 256 parameters on, with more than one torch thread, worker threads unscale what
  the walk has read while it reads on, so the walk cannot take its work back. At a gradient that is
  not the plain case it finishes the ones before and stops; :func:`unscale_` runs the caller's
  general path from that parameter on and merges the two records.
- **partial failure**: an exception after some gradients were unscaled (raised in the walk, by a
  signal handled as it returns, or by the general path after a resume) cannot undo them. So that
  nothing is unscaled twice nor stepped on half-unscaled, ``found_inf`` is set, the caller records
  the step as unscaled with an overflow (``on_partial_failure``), and the exception gets a note.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from llmmem._native import available, native
from llmmem.amp.launch import DTYPE_CODES

__all__ = ["Checked", "Walk", "walk", "unscale_"]


@dataclass(frozen=True)
class Checked:
    """What one unscale + check of an optimizer's gradients found; the general path of
    ``GradScaler`` returns one too.

    ``slots[i]``: the flat position in ``param_groups`` of the i-th checked gradient (positions,
    not parameters, so the record keeps no tensor alive). ``flags_per_device``: ``{device: (flags,
    positions)}``, ``flags[j]`` nonzero when gradient ``slots[positions[j]]`` held inf/NaN.
    ``found_inf_per_device``: ``{device: found_inf}`` for each device with checked gradients."""

    slots: Sequence[int]
    flags_per_device: dict
    found_inf_per_device: dict


@dataclass(frozen=True)
class Walk:
    """One C walk that did something: its first ``n_grads`` gradients are unscaled.

    ``slots``: their flat positions in ``param_groups``; ``flags[i]`` is 1 when the i-th held
    inf/NaN; ``resume``: None when every parameter was walked, else the flat position of the first
    parameter left to the general path."""

    n_grads: int
    slots: Sequence[int]
    flags: array
    resume: Optional[int]


# What the C walk compares parameters and gradients against: the tensor types, then the gradient
# dtypes in the order of their codes.
_KINDS = (torch.Tensor, torch.nn.Parameter) + tuple(sorted(DTYPE_CODES, key=DTYPE_CODES.get))


def _cpu_scalar(t) -> bool:
    """A plain 1-element fp32 CPU tensor, whose data_ptr() the C walk may read and write."""
    # is_cpu rather than device.type: no torch.device object is made (tens of microseconds on a
    # cold cache, right after backward)
    return type(t) is torch.Tensor and t.dtype is torch.float32 and t.is_cpu and t.numel() == 1


def walk(
    param_groups,
    allow_fp16: bool,
    found_inf: torch.Tensor,
    scale: Optional[torch.Tensor],
    scale_is_inverse: bool = False,
    progress: Optional[array] = None,
) -> Optional[Walk]:
    """The C walk over ``param_groups``: unscale by ``scale`` (None: check only; the inverse
    itself when ``scale_is_inverse``) and set ``found_inf`` to 1 on inf/NaN. None when it did
    nothing: a parameter or gradient is not the plain case (see the module docstring), the C core
    is not loaded, or ``found_inf``/``scale`` are not plain fp32 CPU scalars. ``progress``
    (``array("q", [0])``) gets the number of gradients unscaled before the call returns or raises.
    Nothing is cached: addresses are read on every call."""
    if not available() or not _cpu_scalar(found_inf) or (scale is not None and not _cpu_scalar(scale)):
        return None
    result = native.scaler_unscale_param_groups(
        param_groups,
        _KINDS,
        allow_fp16,
        scale.data_ptr() if scale is not None else 0,
        scale_is_inverse,
        found_inf.data_ptr(),
        torch.get_num_threads(),
        progress,
    )
    if result is None:
        return None
    n_grads, slots, resume, flags = result
    return Walk(n_grads, range(n_grads) if slots is None else slots, array("B", flags), resume)


def _checked(walked: Walk, found_inf: torch.Tensor) -> Checked:
    if walked.n_grads == 0:  # no gradients: nothing checked, nothing recorded (as the general path)
        return Checked(walked.slots, {}, {})
    cpu = found_inf.device
    return Checked(walked.slots, {cpu: (walked.flags, range(walked.n_grads))}, {cpu: found_inf})


def _merge(first: Checked, then: Checked) -> Checked:
    """One record out of the walk's and the general path's over the parameters after it: the
    second's positions shift past the first's; the CPU's flags are concatenated."""
    shift = len(first.slots)
    flags = dict(first.flags_per_device)
    for device, (dev_flags, pos) in then.flags_per_device.items():
        pos = [shift + k for k in pos]
        if device in flags:  # the CPU: the walk's flags (an array), then the general path's (a tensor)
            flags0, pos0 = flags[device]
            flags[device] = (array("B", flags0.tolist() + dev_flags.tolist()), list(pos0) + pos)
        else:
            flags[device] = (dev_flags, pos)
    found = {**first.found_inf_per_device, **then.found_inf_per_device}
    return Checked(list(first.slots) + list(then.slots), flags, found)


def unscale_(
    param_groups,
    scale: torch.Tensor,
    scale_is_inverse: bool,
    found_inf: torch.Tensor,
    allow_fp16: bool,
    general: Callable[[int], Checked],
    on_partial_failure: Callable[[Checked], None],
) -> Optional[Checked]:
    """Unscales and checks the gradients of ``param_groups`` on the CPU fast path.

    Returns None having changed nothing when the walk does not take the case: the caller then runs
    ``general(0)``. Else the record of the whole step: the walk's, merged with ``general(resume)``
    when the walk stopped at parameter ``resume``. When an exception comes after gradients were
    unscaled, ``found_inf`` is set to 1, ``on_partial_failure`` gets the record of what the walk
    did (empty when the walk itself raised), and the exception is re-raised with a note.
    """
    progress = array("q", (0,))
    walked = None
    try:
        walked = walk(param_groups, allow_fp16, found_inf, scale, scale_is_inverse, progress)
        if walked is None:
            return None
        checked = _checked(walked, found_inf)
        if walked.resume is None:
            return checked
        return _merge(checked, general(walked.resume))
    except BaseException as exc:
        if progress[0]:
            _fail_partly_unscaled(exc, progress[0], found_inf, walked, on_partial_failure)
        raise


def _fail_partly_unscaled(exc, n_done, found_inf, walked, on_partial_failure) -> None:
    found_inf.fill_(1.0)
    checked = _checked(walked, found_inf) if walked is not None else Checked((), {}, {})
    cpu = found_inf.device
    on_partial_failure(Checked(checked.slots, checked.flags_per_device, {cpu: found_inf}))
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(
            f"llmmem.GradScaler: {n_done} gradients were already unscaled when this was raised (the "
            "C walk cannot take that back); this step is recorded as overflowed, so step() skips it "
            "and update() takes it as an overflow."
        )
