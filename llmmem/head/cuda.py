"""Whether the head's CUDA passes may run on a GPU: the build covers it (:mod:`llmmem._cuda_build`)
and the kernels agree with the torch reference there — a known-answer check run once per GPU (one
host synchronisation), so that kernels that misbehave on a GPU they have never run on fall back to
the reference in torch ops instead of training on a wrong loss."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from llmmem._cuda_build import build_problem
from llmmem._devices import cuda_index
from llmmem.head import kernels

_support: dict = {}  # GPU index -> None (usable) or why not


def unsupported_reason(device: torch.device) -> Optional[str]:
    """None when the CUDA passes run on ``device``, else why not (cached per GPU)."""
    index = cuda_index(device)
    if index in _support:
        return _support[index]
    why = build_problem(index)
    if why is None:
        try:
            capturing = bool(torch.cuda.is_current_stream_capturing())
        except Exception:
            capturing = False
        if capturing:  # the check reads its results on the host, which a capture forbids: not cached
            return "the head's CUDA kernels are not self-checked yet and the first use is inside a CUDA graph capture"
        why = self_check(torch.device("cuda", index))
    _support[index] = why
    return why


def self_check(
    device: torch.device, stats: Optional[Callable] = None, grad: Optional[Callable] = None
) -> Optional[str]:
    """None when both passes on ``device`` agree with the torch reference (rtol 1e-5 on the
    statistics and 2e-5 on the gradient in fp32; 1e-2 in bf16), over softcap, label smoothing,
    ignored rows, a vocabulary shard and -inf logits; else what differed. On the CPU it checks the
    C passes (how the tests exercise it without a GPU); ``stats`` and ``grad`` replace the passes
    (tests give it broken ones)."""
    stats = stats or kernels.stats_native
    grad = grad or kernels.grad_native_
    where = f"cuda:{cuda_index(device)}" if device.type == "cuda" else "the CPU"
    gen = torch.Generator().manual_seed(4321)
    try:
        for dtype, softcap, eps, start, total in (
            (torch.float32, 0.0, 0.0, 0, 3001),
            (torch.float32, 30.0, 0.1, 0, 3001),
            (torch.bfloat16, 0.0, 0.0, 1000, 7001),
            (torch.float16, 15.0, 0.2, 0, 3001),
        ):
            logits = (torch.randn(37, 3001, generator=gen) * 6).to(dtype)
            logits[3, 2000:] = float("-inf")
            labels = torch.randint(start, start + 3001, (37,), generator=gen)
            labels[::5] = -100
            s = kernels.Settings(start, total, -100, eps, softcap)
            ref = kernels.stats_reference(logits, labels, s)
            got = stats(logits.to(device), labels.to(device), s)
            rel = 1e-5 if dtype == torch.float32 else 1e-2
            for name in ("max", "sum", "target", "zsum"):
                if not torch.allclose(getattr(got, name).cpu(), getattr(ref, name), rtol=rel, atol=1e-4):
                    return f"the head's CUDA kernels failed their known-answer check on {where} ({dtype}: row {name})"
            lse, scale = ref.max + ref.sum.log() + 0.25, torch.rand(37, generator=gen) + 0.5
            want, have = logits.clone(), logits.to(device)
            kernels.grad_reference_(want, labels, s, lse, scale)
            grad(have, labels.to(device), s, lse.to(device), scale.to(device))
            rel = 2e-5 if dtype == torch.float32 else 1e-2
            if not torch.allclose(have.cpu().float(), want.float(), rtol=rel, atol=1e-7):
                return f"the head's CUDA kernels failed their known-answer check on {where} ({dtype}: the gradient)"
    except Exception as e:  # a kernel that cannot run is a reason to fall back, not a crash
        return f"the head's CUDA kernels could not run on {where} ({type(e).__name__}: {e})"
    return None
