"""Torch-facing glue of the loss-scaler kernels: tensors in, C core (llmmem._C) calls out.

Everything here works on lists of gradient tensors of one device; :mod:`llmmem.amp.grad_scaler` does the
bookkeeping. The C core sees only ``data_ptr()`` ints, element counts and dtype codes.

- CPU tensors go to the threaded C kernel (the GIL is released while it runs).
- CUDA tensors go to the CUDA kernels when llmmem was built with CUDA: queued on the current
  stream, no host synchronisation.
- Any other device, CUDA with a CPU-only build of llmmem, or a GPU the build's kernels cannot run
  on (no usable driver for llmmem's CUDA runtime, an architecture missing from the build, or
  kernels that fail the known-answer self-check of :mod:`llmmem.amp.selfcheck`; probed once
  per device), falls back to torch's own ops
  (``torch._amp_foreach_non_finite_check_and_unscale_``), with one warning.
- Gradients that are tensor subclasses (DTensor) always go to torch's op, which handles them.
  (``GradScaler`` hands DTensors' local shards instead, and agrees on their flags over the mesh
  itself: :mod:`llmmem.amp.sharded`.)

Tensors are checked (dtype, element count, device) before any ``data_ptr()`` reaches the C core:
``llmmem._C.scaler_*`` trust the addresses they get. (``GradScaler.unscale_`` on the CPU first
tries :mod:`llmmem.amp.cpu_unscale`, which walks the param_groups in C and comes here for the rest.)
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from llmmem._cuda_build import archs_cover, build_problem
from llmmem._cuda_build import cuda_kernels_built as _built
from llmmem._devices import cuda_index as _cuda_index
from llmmem._native import available
from llmmem.amp import launch as _launch
from llmmem.amp.launch import DTYPE_CODES
from llmmem.amp.selfcheck import self_check

_warned_fallback: set = set()


def cuda_kernels_built() -> bool:
    """True when this llmmem was compiled with its CUDA kernels (no GPU needed to answer)."""
    return _built()


_archs_cover = archs_cover


_cuda_support: dict = {}  # device index -> None (usable) or why not, probed once per device


def _cuda_unsupported_reason(index: int) -> Optional[str]:
    """None when llmmem's CUDA kernels can run on GPU ``index``, else why not. A build with CUDA can
    still be unable to: its static CUDA runtime may not talk to the installed driver, or the GPU's
    architecture may be missing from the build (a kernel launch would then fail on every step).
    Last, the kernels must pass a known-answer self-check on that GPU (:func:`_self_check`: one
    host synchronisation, once per device per process), so that kernels that misbehave on a GPU
    they have never been run on fall back to torch's ops instead of corrupting gradients."""
    if index in _cuda_support:
        return _cuda_support[index]
    why = build_problem(index)
    if why is None:
        if _capturing():
            # The self-check must read its results on the host, which a stream capture forbids;
            # this call (captured into the graph) uses torch's ops, and the verdict stays open
            # (not cached) for the first call outside a capture.
            return "llmmem's CUDA kernels are not self-checked yet and the first use is inside a CUDA graph capture"
        why = _self_check(torch.device("cuda", index))
    _cuda_support[index] = why
    return why


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False when torch cannot say: the
    self-check then meets the same error and reports it)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _self_check(device: torch.device) -> Optional[str]:
    """None when llmmem's kernels give the known answers on ``device``, else what differed: see
    :func:`llmmem.amp.selfcheck.self_check`. Run once per GPU (the verdict is cached with the
    rest of the probe); it synchronises with that GPU once."""
    return self_check(device)


def _kernel_unsupported_reason(device: torch.device) -> Optional[str]:
    """None when gradients on ``device`` go to llmmem's own kernels, else why they go to torch's ops."""
    if not available():
        return "llmmem's C core is not loaded"
    if device.type == "cpu":
        return None
    if device.type != "cuda" or not cuda_kernels_built():
        return "llmmem's kernels do not cover this device"
    return _cuda_unsupported_reason(_cuda_index(device))


def uses_llmmem_kernels(device: torch.device) -> bool:
    """Whether gradients on ``device`` are handled by llmmem's own kernels (else torch's ops)."""
    return _kernel_unsupported_reason(device) is None


def _dense_span(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill exactly ``numel`` consecutive slots from ``data_ptr()``
    (contiguous in some order, e.g. channels_last or a transposed weight), so it can be treated
    as a flat array: the unscale is elementwise, the order does not matter."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _warn_fallback(device: torch.device, why: str) -> None:
    if device.type not in _warned_fallback:
        _warned_fallback.add(device.type)
        warnings.warn(
            f"llmmem.GradScaler: {why}; using torch's unscale and update ops on {device.type} "
            "(no per-parameter overflow flags there)",
            RuntimeWarning,
            stacklevel=4,
        )


def _check_scalar(
    t: torch.Tensor, name: str, dtype: torch.dtype, kind: str, device: torch.device, numel: int = 1
) -> None:
    """The checks torch's ops make (same exception types; messages name llmmem.GradScaler), done
    before the C core gets a raw pointer:
    it would read a float64 scale as float32, or write past a tensor that is too small."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"llmmem.GradScaler: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise RuntimeError(f"llmmem.GradScaler: {name} must be {kind} tensor.")
    if t.numel() != numel:
        raise RuntimeError(f"llmmem.GradScaler: {name} must be a {numel}-element tensor.")
    if t.device != device:
        raise RuntimeError(f"llmmem.GradScaler: {name} must be on {device} (where the work runs), got {t.device}.")
    if numel > 1 and not t.is_contiguous():
        raise RuntimeError(f"llmmem.GradScaler: {name} must be contiguous.")


def _address(t: torch.Tensor) -> int:
    """``t.data_ptr()``, or 0 where there is no address to hand the C core: tensor subclasses
    (``type(t) is torch.Tensor`` is false for DTensor & co., whose data_ptr() is 0 or not their
    data's) and tensors without storage (functional or fake tensors, whose data_ptr() raises)."""
    if type(t) is not torch.Tensor:
        return 0
    try:
        return t.data_ptr()
    except RuntimeError:
        return 0


def unscale_check_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    flags: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    scale_is_inverse: bool = False,
    codes: Optional[Sequence[int]] = None,
) -> None:
    """In place on ``grads`` (all on one device): multiply by the inverse scale and set
    ``found_inf`` (a 1-element float32 tensor on that device) to 1 if any element is inf/NaN.

    ``scale`` None means check only. ``flags`` (uint8, one per grad, same device) gets a 1 for
    each grad holding a non-finite value. Gradients must be strided tensors of a supported dtype;
    strided views that are not dense, and views not aligned to their element size, are copied,
    processed and copied back. Tensor subclasses (DTensor of FSDP2 or tensor parallelism) and
    tensors without storage go to torch's op, one call per dtype (as torch's scaler): it handles
    them, including DTensor's reduction of ``found_inf`` over the mesh; their flags are set per
    dtype group (every such gradient of a group that overflowed is flagged). ``codes``: the dtype
    codes of ``grads`` when the caller already has them.
    """
    if not grads:
        return
    device = grads[0].device
    if scale is not None and not scale_is_inverse and scale.dtype != torch.float32:
        # torch inverts any floating scale in fp64 (scale.double().reciprocal().float()); the kernels
        # read fp32, so hand them that inverse instead of a pointer to a wider value.
        scale, scale_is_inverse = scale.double().reciprocal().float(), True
    _check_scalar(found_inf, "found_inf", torch.float32, "a float", device)
    if scale is not None:
        _check_scalar(scale, "inv_scale", torch.float32, "a float", device)
    if flags is not None:
        _check_scalar(flags, "flags", torch.uint8, "a uint8", device, numel=len(grads))
    why_not = _kernel_unsupported_reason(device)
    special = []  # positions that go to torch's op
    if why_not is None:
        ptrs = [_address(t) for t in grads]
        numels = [t.numel() for t in grads]
        to_copy = []
        for k, t in enumerate(grads):
            p = ptrs[k]
            if numels[k] == 0:
                continue
            if p == 0:  # a subclass, or a tensor without storage (functional, fake): no address
                numels[k] = 0  # the kernel skips it; its flag slot stays aligned with `grads`
                special.append(k)
                continue
            # Not dense, or not aligned to its elements (torch.frombuffer(..., offset=1)): the kernels
            # need a flat, aligned array, so work on an aligned copy and copy back. (`p & 7` first:
            # most addresses are 8-aligned, which settles alignment without element_size().)
            if not (t.is_contiguous() or _dense_span(t)) or (p & 7 and p % t.element_size()):
                to_copy.append(k)
        if codes is None:
            codes = [DTYPE_CODES[t.dtype] for t in grads]
        flags_ptr = flags.data_ptr() if flags is not None else 0
        n_flags = flags.numel() if flags is not None else 0
        scale_ptr = scale.data_ptr() if scale is not None else 0
        if _must_go_in_order(grads, ptrs, numels, to_copy, device):
            _unscale_in_order(
                grads,
                ptrs,
                numels,
                codes,
                set(to_copy),
                device,
                scale_ptr,
                scale_is_inverse,
                found_inf.data_ptr(),
                flags_ptr,
            )
        else:
            copies = []
            for k in to_copy:
                tmp = grads[k].clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
                ptrs[k] = tmp.data_ptr()
                copies.append((grads[k], tmp))
            _launch.launch_unscale(
                device, ptrs, numels, codes, scale_ptr, scale_is_inverse, found_inf.data_ptr(), flags_ptr, n_flags
            )
            for g, tmp in copies:
                g.copy_(tmp)
    else:
        _warn_fallback(device, why_not)
        special = [k for k, g in enumerate(grads) if type(g) is not torch.Tensor]
        plain = [None if type(g) is not torch.Tensor else g for g in grads]
        _torch_unscale_check_(plain, found_inf, flags, scale, scale_is_inverse)
    if special:
        _torch_group_unscale_check_(grads, special, found_inf, flags, scale, scale_is_inverse)


def _must_go_in_order(grads, ptrs, numels, to_copy, device) -> bool:
    """Whether one kernel launch over the list could lose an update torch makes: a tensor listed
    twice (the same parameter twice, or parameters sharing one .grad), which torch's CPU op
    unscales twice, one after the other. On the CPU the C kernel itself keeps the listings in
    order (threads up to the first repeat, the rest on the calling thread after them); on a GPU
    the two listings would be read and written by concurrent blocks.
    A gradient that goes through a copy loses the writes of any other listing of its memory
    (its copy back comes last), so it must not share storage with another gradient either."""
    if device.type != "cpu":
        seen = set()
        for p, n in zip(ptrs, numels):
            if n and p:
                if p in seen:
                    return True
                seen.add(p)
    if not to_copy:
        return False
    storages: dict = {}
    for p, n, g in zip(ptrs, numels, grads):
        if n and p:
            key = g.untyped_storage().data_ptr()
            storages[key] = storages.get(key, 0) + 1
    return any(storages[grads[k].untyped_storage().data_ptr()] > 1 for k in to_copy)


def _unscale_in_order(
    grads, ptrs, numels, codes, to_copy, device, scale_ptr, scale_is_inverse, found_ptr, flags_ptr
) -> None:
    """One launch per gradient, in list order, each copy taken after the listings before it were
    unscaled (see _must_go_in_order): torch's result for lists that repeat memory. Slow, and rare."""
    for k, g in enumerate(grads):
        if numels[k] == 0:
            continue
        tmp = g.clone(memory_format=torch.contiguous_format) if k in to_copy else None
        _launch.launch_unscale(
            device,
            [tmp.data_ptr() if tmp is not None else ptrs[k]],
            [numels[k]],
            [codes[k]],
            scale_ptr,
            scale_is_inverse,
            found_ptr,
            flags_ptr + k if flags_ptr else 0,
            1 if flags_ptr else 0,
        )
        if tmp is not None:
            g.copy_(tmp)


def _inverse(scale, scale_is_inverse, device):
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return scale if scale_is_inverse else scale.double().reciprocal().float()


def _torch_unscale_check_(grads, found_inf, flags, scale, scale_is_inverse):
    """The same operation with torch's ops (per tensor, so flags can be filled). ``None`` entries
    of ``grads`` are skipped (their flags stay 0)."""
    inv = _inverse(scale, scale_is_inverse, found_inf.device)
    per_tensor = torch.zeros(len(grads), dtype=torch.float32, device=found_inf.device)
    for i, g in enumerate(grads):
        if g is None:
            continue
        target = g
        if not (g.is_contiguous() or _dense_span(g)):
            target = g.contiguous()
        if g.dtype == torch.bfloat16 and g.device.type == "cuda":  # torch's CUDA op rejects bf16
            target = g.float()
        torch._amp_foreach_non_finite_check_and_unscale_([target], per_tensor[i], inv)
        if target is not g:
            g.copy_(target)
    if flags is not None:
        flags.copy_((per_tensor > 0).to(flags.dtype))
    found_inf.copy_(torch.maximum(found_inf, per_tensor.max()))


def _torch_group_unscale_check_(grads, positions, found_inf, flags, scale, scale_is_inverse):
    """``grads[k]`` for ``k`` in ``positions`` (tensor subclasses such as DTensor) through torch's
    op, one call per dtype as torch's scaler makes them: per-tensor calls would cost DTensor one
    found_inf all-reduce per gradient. Each group's result goes to the flags of all its members."""
    inv = _inverse(scale, scale_is_inverse, found_inf.device)
    by_dtype: dict = {}
    for k in positions:
        by_dtype.setdefault(grads[k].dtype, []).append(k)
    for dtype, ks in by_dtype.items():
        group = [grads[k] for k in ks]
        targets = group
        if dtype == torch.bfloat16 and found_inf.device.type == "cuda":  # torch's CUDA op rejects bf16
            targets = [g.float() for g in group]
        group_found = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(targets, group_found, inv)
        if targets is not group:
            for g, t in zip(group, targets):
                g.copy_(t)
        found_inf.copy_(torch.maximum(found_inf, group_found))
        if flags is not None:
            index = torch.tensor(ks, dtype=torch.long).to(flags.device, non_blocking=True)
            flags.index_put_((index,), (group_found > 0).to(flags.dtype))


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    stats: torch.Tensor,
    found_infs: Sequence[torch.Tensor],
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    hysteresis_on_growth: bool = False,
) -> None:
    """One scale update in place (torch's rule when hysteresis == 1 and min_scale == 0); all
    tensors on the scale's device. No host synchronisation on CUDA. ``hysteresis_on_growth``: only
    a growth of the scale refills the hysteresis budget (else any clean step does)."""
    device = scale.device
    # torch's _amp_update_scale_ checks (same exception types), before the C core gets raw pointers.
    _check_scalar(scale, "current_scale", torch.float32, "a float", device)
    _check_scalar(growth_tracker, "growth_tracker", torch.int32, "an int", device)
    _check_scalar(hysteresis_tracker, "hysteresis_tracker", torch.int32, "an int", device)
    _check_scalar(stats, "stats", torch.int64, "an int64", device, numel=4)
    for f in found_infs:
        _check_scalar(f, "found_inf", torch.float32, "a float", device)
    if len(found_infs) > 16:  # the C entry takes at most 16 flags: fold the rest first
        found_infs = [torch.stack(list(found_infs)).sum()]
    why_not = _kernel_unsupported_reason(device)
    if why_not is not None:
        _warn_fallback(device, why_not)
    update = _launch.launch_update if why_not is None else _torch_update_
    update(
        scale,
        growth_tracker,
        hysteresis_tracker,
        stats,
        found_infs,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        hysteresis_on_growth,
    )


def _torch_update_(
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
):
    """update_scale_ with torch ops only (devices without llmmem kernels); same rule, no sync."""
    found = torch.stack([f.reshape(()) for f in found_infs]).ne(0).any()
    left = torch.clamp(hyst - 1, min=0)
    back = found & left.eq(0)
    backed = (scale.double() * backoff_factor).float()
    hit = torch.zeros((), dtype=torch.bool, device=scale.device)
    if min_scale > 0:
        hit = back & ~(backed >= min_scale)
        backed = torch.where(backed >= min_scale, backed, torch.full_like(backed, min_scale))
    successful = growth + 1
    grow = ~found & successful.eq(growth_interval)
    grown = (scale.double() * growth_factor).float()
    new_scale = torch.where(back, backed, torch.where(grow & torch.isfinite(grown), grown, scale))
    new_growth = torch.where(found | grow, torch.zeros_like(growth), successful)
    refill = grow if hysteresis_on_growth else ~found
    new_hyst = torch.where(found, left, torch.where(refill, torch.full_like(hyst, hysteresis), hyst))
    scale.copy_(new_scale)
    growth.copy_(new_growth)
    hyst.copy_(new_hyst)
    f64 = found.long()
    stats.add_(torch.stack([torch.ones_like(f64), f64, torch.zeros_like(f64), hit.long()]))
    stats[2] = f64
