"""The calls into the C core's loss-scaler kernels (llmmem._C.scaler_*), one per kernel family, on
the current stream of the tensors' device. The real path (:mod:`llmmem.amp.kernels`) and the
on-device self-check (:mod:`llmmem.amp.selfcheck`) both come here; nothing here checks arguments:
the addresses must have been checked by the caller."""

from __future__ import annotations

import torch

from llmmem._devices import cuda_index as _cuda_index
from llmmem._native import native

__all__ = ["DTYPE_CODES", "launch_unscale", "kernel_unscale", "launch_update"]

# dtype -> code of llmmem_scaler_dtype_t (csrc/include/llmmem/amp.h)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def launch_unscale(
    device: torch.device,
    ptrs,
    numels,
    codes,
    scale_ptr: int,
    scale_is_inverse: bool,
    found_ptr: int,
    flags_ptr: int,
    n_flags: int,
) -> None:
    """The one place the unscale + check kernel of ``device`` (CPU or CUDA) is called, on the
    current stream: the real path and the self-check (:mod:`llmmem.amp.selfcheck`) both come
    here. The addresses must have been checked (see :func:`unscale_check_`)."""
    if device.type == "cpu":
        native.scaler_unscale_check(
            ptrs, numels, codes, scale_ptr, scale_is_inverse, found_ptr, flags_ptr, n_flags, torch.get_num_threads()
        )
    else:
        index = _cuda_index(device)
        stream = torch.cuda.current_stream(index).cuda_stream
        native.scaler_unscale_check_cuda(
            ptrs, numels, codes, scale_ptr, scale_is_inverse, found_ptr, flags_ptr, n_flags, index, stream
        )


def kernel_unscale(grads, found_inf, flags, scale, scale_is_inverse=False) -> None:
    """llmmem's unscale + check kernel on ``grads``: plain, dense, element-aligned tensors of
    ``found_inf``'s device, which the caller made (no checks, no copies, no fallback). What the
    self-check drives by default."""
    launch_unscale(
        found_inf.device,
        [g.data_ptr() for g in grads],
        [g.numel() for g in grads],
        [DTYPE_CODES[g.dtype] for g in grads],
        scale.data_ptr() if scale is not None else 0,
        scale_is_inverse,
        found_inf.data_ptr(),
        flags.data_ptr() if flags is not None else 0,
        flags.numel() if flags is not None else 0,
    )


def launch_update(
    scale,
    growth,
    hyst,
    stats,
    found_infs,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    min_scale,
    hysteresis_on_growth=False,
) -> None:
    """llmmem's scale-update kernel of the scale's device, on the current stream (arguments as
    :func:`update_scale_`, already checked): the real path and the self-check both come here."""
    device = scale.device
    args = (
        scale.data_ptr(),
        growth.data_ptr(),
        hyst.data_ptr(),
        stats.data_ptr(),
        [f.data_ptr() for f in found_infs],
        float(growth_factor),
        float(backoff_factor),
        int(growth_interval),
        int(hysteresis),
        float(min_scale),
    )
    if device.type == "cpu":
        native.scaler_update(*args, -1, 0, bool(hysteresis_on_growth))
    else:
        index = _cuda_index(device)
        native.scaler_update(*args, index, torch.cuda.current_stream(index).cuda_stream, bool(hysteresis_on_growth))
