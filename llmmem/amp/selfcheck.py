"""Known-answer self-check of llmmem's loss-scaler kernels on one device.

llmmem's CUDA kernels (csrc/amp/scaler.cu) are checked against the C reference by
tests/test_amp_cuda.py, but only where a GPU runs the tests. A kernel that is wrong on some GPU
would silently corrupt every gradient it unscales, so before a GPU's gradients are trusted to
llmmem's kernels, :func:`self_check` runs them once on a small fixed set of gradients of that
device and compares the results bitwise with plain torch ops on the same device. Any mismatch
(or exception) yields a reason, and the caller (``llmmem.amp.kernels._cuda_unsupported_reason``)
sends that device's gradients to torch's ops with one warning.

The check is written over the device and the kernel entry points, so the CPU tests run it with
llmmem's CPU kernel (which must pass) and with deliberately broken kernels (which must not).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from llmmem._devices import cuda_index
from llmmem.amp import launch as _launch
from llmmem.amp.launch import DTYPE_CODES

_DTYPES = tuple(DTYPE_CODES)  # every dtype the kernels take
_SIZES = (0, 1, 7, 4097, 70001)  # odd sizes; 70001 spans two chunks of the CUDA kernel (65536)
# 3 * 2**14: its inverse is inexact (the kernel must round as torch does), and dividing by it
# takes the small fp16 values below into fp16's subnormals.
_SCALE = 49152.0
_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _values(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Finite values over a wide range of magnitudes (2**-24 .. 2**12, within fp16's range), made
    on the generator's device: a copy from host memory would synchronise."""
    x = torch.randn(n, dtype=torch.float64, generator=gen, device=gen.device)
    x = x * torch.exp2(torch.randint(-24, 11, (n,), generator=gen, device=gen.device).double())
    return x.to(dtype)


def _gradients(device: torch.device):
    """[(label, tensor on device)]: every dtype x size, non-finite values at the start, the middle
    and the end of tensors, and views one element past an aligned start (the kernel's unaligned
    path, which the real path hands over without a copy)."""
    gen = torch.Generator(device=device).manual_seed(1234)  # its own: the global RNG is left alone
    cases = []
    for dtype in _DTYPES:
        name = str(dtype).replace("torch.", "")
        for n in _SIZES:
            cases.append((f"{name} size {n}", _values(n, dtype, gen)))
    poisoned = [
        (torch.float32, 4097, 0, float("inf"), "+inf"),
        (torch.float16, 70001, 35000, float("nan"), "nan"),
        (torch.bfloat16, 70001, 70000, float("-inf"), "-inf"),
        (torch.float64, 7, 3, float("nan"), "nan"),
    ]
    for dtype, n, at, value, what in poisoned:
        g = _values(n, dtype, gen)
        g[at] = value
        cases.append((f"{str(dtype).replace('torch.', '')} size {n} with {what} at {at}", g))
    for dtype in (torch.float32, torch.float16):
        base = _values(4098, dtype, gen)
        name = str(dtype).replace("torch.", "")
        cases.append((f"{name} size 4097 at a 1-element offset", base[1:]))
    base = _values(70002, torch.bfloat16, gen)
    base[20001] = float("nan")
    cases.append(("bfloat16 size 70001 at a 1-element offset with nan at 20000", base[1:]))
    return cases


def _expected(orig: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """The kernel's specification: multiply in fp32 (fp64 for fp64 gradients, by the fp32 inverse
    widened) and round back to the gradient's dtype, to nearest even."""
    if orig.dtype == torch.float64:
        return orig * inv.double()
    return (orig.float() * inv).to(orig.dtype)


def _agree(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: bitwise equal, or NaN in both (NaN payloads of conversions differ)."""
    ints = _INTS[a.element_size()]
    return (a.view(ints) == b.view(ints)) | (torch.isnan(a) & torch.isnan(b))


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A device bool: every element agrees (see :func:`_agree`)."""
    return _agree(a, b).all()


def _first_difference(label: str, got: torch.Tensor, want: torch.Tensor) -> str:
    got, want = got.cpu(), want.cpu()
    ints = _INTS[got.element_size()]
    bad = ~_agree(got, want)
    i = int(bad.nonzero()[0, 0])
    width = 2 * got.element_size()
    g_bits, w_bits = int(got.view(ints)[i]) & ((1 << 4 * width) - 1), int(want.view(ints)[i]) & ((1 << 4 * width) - 1)
    return (
        f"{label}: element {i} expected {float(want[i])!r} (0x{w_bits:0{width}x}), "
        f"got {float(got[i])!r} (0x{g_bits:0{width}x}); {int(bad.sum())} element(s) differ"
    )


def _flags_difference(what: str, got: torch.Tensor, want: torch.Tensor, labels) -> str:
    got, want = got.cpu().tolist(), want.cpu().tolist()
    wrong = [f"{labels[i]}: expected {w}, got {g}" for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return f"{what} of " + "; ".join(wrong)


def _check_unscale(device: torch.device, unscale: Callable, checks: list) -> None:
    """Queues the unscale runs on ``device`` and appends (what, ok device bool, detail) to ``checks``."""
    cases = _gradients(device)
    grads = [g for _, g in cases]
    origs = [g.clone() for g in grads]
    want_flags = torch.stack([~torch.isfinite(o).all() for o in origs]).to(torch.uint8)
    want_found = want_flags.max().float()

    # 1. scale given (the kernel inverts it on the device), every case in one call (mixed dtypes)
    scale = torch.full((), _SCALE, dtype=torch.float32, device=device)
    inv = scale.double().reciprocal().float()
    found = torch.zeros((), dtype=torch.float32, device=device)
    flags = torch.zeros(len(grads), dtype=torch.uint8, device=device)
    unscale(grads, found, flags, scale, False)
    for (label, g), o in zip(cases, origs):
        want = _expected(o, inv)
        checks.append(
            (
                f"unscale {label}",
                _same(g, want),
                lambda label=label, g=g, w=want: _first_difference(f"unscale {label}", g, w),
            )
        )
    labels = [label for label, _ in cases]
    checks.append(
        (
            "per-tensor overflow flags",
            (flags == want_flags).all(),
            lambda f=flags: _flags_difference("overflow flag", f, want_flags, labels),
        )
    )
    checks.append(
        ("found_inf", found == want_found, lambda f=found: f"found_inf: expected {float(want_found)}, got {float(f)}")
    )

    # 2. the inverse given, as GradScaler.unscale_ passes it
    picks = [k for k, (label, _) in enumerate(cases) if label in ("float32 size 70001", "bfloat16 size 4097")]
    grads2 = [origs[k].clone() for k in picks]
    inv2 = torch.full((), 1.0 / 3.0, dtype=torch.float32, device=device)
    found2 = torch.zeros((), dtype=torch.float32, device=device)
    unscale(grads2, found2, None, inv2, True)
    for k, g in zip(picks, grads2):
        label = f"unscale by a given inverse, {cases[k][0]}"
        want = _expected(origs[k], inv2)
        checks.append((label, _same(g, want), lambda label=label, g=g, w=want: _first_difference(label, g, w)))
    checks.append(
        (
            "found_inf of finite gradients",
            found2 == 0,
            lambda f=found2: f"found_inf of finite gradients: expected 0.0, got {float(f)}",
        )
    )

    # 3. check only (no scale): values untouched, flags still right
    grads3 = [o.clone() for o in origs]
    found3 = torch.zeros((), dtype=torch.float32, device=device)
    flags3 = torch.zeros(len(grads3), dtype=torch.uint8, device=device)
    unscale(grads3, found3, flags3, None, False)
    for (label, _), g, o in zip(cases, grads3, origs):
        label = f"check-only {label}"
        checks.append((label, _same(g, o), lambda label=label, g=g, o=o: _first_difference(label, g, o)))
    checks.append(
        (
            "check-only overflow flags",
            (flags3 == want_flags).all(),
            lambda f=flags3: _flags_difference("check-only overflow flag", f, want_flags, labels),
        )
    )
    checks.append(
        (
            "check-only found_inf",
            found3 == want_found,
            lambda f=found3: f"check-only found_inf: expected {float(want_found)}, got {float(f)}",
        )
    )


# (what, scale, growth tracker, found_inf values, growth factor, backoff factor, growth interval)
_UPDATES = (
    ("growth", 1024.0, 1, (0.0,), 2.0, 0.5, 2),
    ("growth by an inexact factor", 3.0, 4, (0.0, 0.0), 1.7, 0.5, 5),
    ("backoff by an inexact factor", 65535.0, 3, (0.0, 1.0), 2.0, 0.37, 2000),  # fp32 factor would differ
    ("no change", 1024.0, 0, (0.0,), 2.0, 0.5, 3),
    ("growth to inf refused", 3.0e38, 0, (0.0,), 2.0, 0.5, 1),
)


def _check_update(device: torch.device, update: Callable, checks: list) -> None:
    """Queues llmmem's update and torch's ``_amp_update_scale_`` (hysteresis off, no floor) for each
    case of ``_UPDATES`` and appends the comparisons to ``checks``."""
    for what, s, g, founds, gf, bf, interval in _UPDATES:
        scale = torch.full((), s, dtype=torch.float32, device=device)
        growth = torch.full((), g, dtype=torch.int32, device=device)
        hyst = torch.ones((), dtype=torch.int32, device=device)
        stats = torch.zeros(4, dtype=torch.int64, device=device)
        found_infs = [torch.full((), f, dtype=torch.float32, device=device) for f in founds]
        want_scale, want_growth = scale.clone(), growth.clone()
        update(scale, growth, hyst, stats, found_infs, gf, bf, interval, 1, 0.0, False)
        torch._amp_update_scale_(want_scale, want_growth, torch.stack(found_infs).sum(), gf, bf, interval)
        skipped = int(any(founds))
        want_stats = torch.zeros(4, dtype=torch.int64, device=device)  # fills: torch.tensor(list) would sync
        want_stats[0] = 1
        want_stats[1] = want_stats[2] = skipped
        want_hyst = 1 - skipped  # hysteresis 1: an overflow spends the budget, a clean step refills it
        ok = (
            (scale.view(torch.int32) == want_scale.view(torch.int32))
            & (growth == want_growth)
            & (hyst == want_hyst)
            & (stats == want_stats).all()
        )
        label = f"scale update ({what}: scale {s!r}, tracker {g}, found_inf {list(founds)})"
        got, want = (scale, growth, hyst, stats), (want_scale, want_growth, want_hyst, want_stats)
        checks.append((label, ok, lambda label=label, got=got, want=want: _update_difference(label, got, want)))


def _update_difference(label: str, got: tuple, want: tuple) -> str:
    def show(scale, growth, hyst, stats):
        return f"{float(scale)!r}, {int(growth)}, {int(hyst)}, {stats.tolist()}"

    return f"{label}: expected scale, tracker, hysteresis, stats {show(*want)}, got {show(*got)}"


def self_check(
    device: torch.device, unscale: Optional[Callable] = None, update: Optional[Callable] = None
) -> Optional[str]:
    """Runs llmmem's loss-scaler kernels on ``device`` on known inputs; None when every result is
    bitwise what plain torch ops give on the same device, else a reason naming the first mismatch
    (dtype, size, element, expected vs got) or the exception raised.

    ``unscale(grads, found_inf, flags, scale, scale_is_inverse)`` and ``update(scale, growth,
    hyst, stats, found_infs, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
    on_growth)`` default to the entry points the real path uses
    (``llmmem.amp.launch.kernel_unscale`` and ``launch_update``); tests pass others.

    Works on tensors of its own only (a few MB on the device, freed on return), on the current
    stream of ``device``, and restores the current CUDA device. Everything is queued first and the
    verdicts are read back in one copy: it synchronises with the device once (a failed check reads
    a little more to describe the mismatch); that read is exempt from torch's sync debug mode, and
    nothing else in the check synchronises. Call it outside CUDA graph capture.
    """
    unscale = unscale or _launch.kernel_unscale
    update = update or _launch.launch_update
    checks: list = []
    try:
        if device.type == "cuda":
            index = cuda_index(device)
            device = torch.device("cuda", index)
            with torch.cuda.device(index):  # the current device is restored on exit
                return _run(device, unscale, update, checks)
        return _run(device, unscale, update, checks)
    except Exception as e:
        return f"llmmem's kernels failed their self-check on {device} ({type(e).__name__}: {e})"


def _run(device, unscale, update, checks) -> Optional[str]:
    _check_unscale(device, unscale, checks)
    _check_update(device, update, checks)
    verdicts = torch.stack([ok.reshape(()) for _, ok, _ in checks])
    if device.type != "cuda":
        return _verdict(device, verdicts, checks)
    # The one synchronisation, documented (GradScaler's docstring), plus the reads that describe a
    # failure. Kept out of torch's sync debug mode: under "error" it would raise and fail the
    # check, so a process that polices its training loop's syncs would lose llmmem's kernels.
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return _verdict(device, verdicts, checks)
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _verdict(device, verdicts, checks) -> Optional[str]:
    for (_, _, detail), ok in zip(checks, verdicts.cpu().tolist()):
        if not ok:
            return f"llmmem's kernels failed their self-check on {device} ({detail()})"
    return None
