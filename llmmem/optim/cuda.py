"""Whether the optimizer's CUDA step may run on a GPU: the build covers it
(:mod:`llmmem._cuda_build`), and the kernels give the reference's answers there — a known-answer
check run once per GPU (one host synchronisation), so that kernels that misbehave on a GPU they
have never run on fall back to the reference in torch ops instead of corrupting a model."""

from __future__ import annotations

from typing import Optional

import torch

from llmmem._cuda_build import build_problem
from llmmem._devices import cuda_index
from llmmem._native import native
from llmmem.optim.records import head_of, record

_support: dict = {}  # GPU index -> None (usable) or why not


def unsupported_reason(device: torch.device) -> Optional[str]:
    """None when the CUDA step runs on ``device``, else why not (cached per GPU)."""
    index = cuda_index(device)
    if index in _support:
        return _support[index]
    why = build_problem(index)
    if why is None:
        if _capturing():
            # the check reads its results on the host, which a capture forbids: not cached
            return "the optimizer's CUDA kernels are not self-checked yet and the first use is inside a CUDA graph capture"
        why = self_check(torch.device("cuda", index))
    _support[index] = why
    return why


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _records(ts: list, master: bool) -> list:
    """Native step records of a case's tensors."""
    out = []
    for t in ts:
        state = {"exp_avg": t["m"], "exp_avg_sq": t["v"], "step": t["step"]}
        if "ms" in t:
            state["exp_avg_scale"], state["exp_avg_sq_scale"] = t["ms"], t["vs"]
        out.append(record(head_of(t["p"], t["master"] if master else None, state, t["seed"]), t["g"]))
    return out


def _case(state: int, pdtype: torch.dtype, master: bool, device, block: int = 128) -> list:
    """Tensors of one known-answer case, on ``device`` (built on the CPU from a fixed generator)."""
    gen = torch.Generator().manual_seed(1234 + state)
    ts = []
    for n in (1, 33, 4097, 9000):
        w = torch.randn(n, generator=gen) * 2
        t = {"p": w.to(pdtype), "g": (torch.randn(n, generator=gen) * torch.logspace(-5, 1, n)).to(pdtype)}
        t["g"][n // 2] = float("nan") if n > 100 else t["g"][n // 2]
        t["master"] = w.clone()
        if state in (0, 1):
            dt = torch.float32 if state == 0 else torch.bfloat16
            t["m"], t["v"] = torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)
        else:
            nb = -(-n // block)
            size = n if state == 2 else (n + 1) // 2
            t["m"] = torch.zeros(size, dtype=torch.int8 if state == 2 else torch.uint8)
            t["v"] = torch.zeros(size, dtype=torch.uint8)
            t["ms"], t["vs"] = torch.zeros(nb), torch.zeros(nb)
        t["seed"] = 99 + n
        t = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
        t["step"] = torch.zeros((), dtype=torch.float32)  # host memory on every path
        ts.append(t)
    return ts


def _launch_args(device: torch.device, index: int) -> dict:
    """The device arguments of a native step call on ``device`` (none on the CPU)."""
    if index < 0:
        return {}
    return dict(device=index, stream=torch.cuda.current_stream(device).cuda_stream)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that a NaN equals any NaN: a GPU writes the canonical NaN where a
    CPU propagates its operand's (NaN bit patterns are not part of any promise, as in half.h)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    ints = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(na, nb) and torch.equal(a.view(ints)[~na], b.view(ints)[~nb])


def self_check(device: torch.device, step=None) -> Optional[str]:
    """None when two steps of the kernels on ``device`` equal the C reference's bit for bit on
    every state format, weight kind (fp32, bf16 rounded stochastically, bf16 and fp16 with a
    master) and, quantized, block size below, at and above the CUDA kernel's thread block (32,
    256, 1024: a quantization block then spans one warp, the whole thread block, or several
    elements a thread), NaN gradients included; else what differed. On a CPU device it checks the
    vector CPU step (how the tests exercise this check without a GPU); ``step`` replaces the
    native step call (tests give it a broken kernel)."""
    device = torch.device(device)
    index = cuda_index(device) if device.type == "cuda" else -1
    step = step or native.optim_adamw_step
    where = f"cuda:{index}" if index >= 0 else "the CPU"
    kinds = ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True))
    cases = [
        (state, pdtype, master, block)
        for state in range(4)
        for pdtype, master in kinds
        for block in ((32, 256, 1024) if state >= 2 else (128,))
    ]
    try:
        for state, pdtype, master, block in cases:
            ref, gpu = _case(state, pdtype, master, "cpu", block), _case(state, pdtype, master, device, block)
            for _ in range(2):
                for r, kw in ((ref, dict(reference=True)), (gpu, _launch_args(device, index))):
                    f = native.optim_adamw_step if kw.get("reference") else step
                    f(_records(r, master), 1e-2, 0.9, 0.999, 1e-8, 0.01, True, False, state, block, True, 2, **kw)
            if index >= 0:
                torch.cuda.synchronize(device)
            for r, g in zip(ref, gpu):
                for key in ("p", "m", "v", "ms", "vs") + (("master",) if master else ()):
                    if key in r and not same_bits(r[key], g[key].cpu()):
                        kind = f"{pdtype}{' with a master' if master else ''}"
                        return (
                            f"the optimizer's CUDA kernels failed their known-answer check on {where} (state "
                            f"format {state}, block {block}, {kind}: {key} of {r['p'].numel()} elements differs "
                            "from the C reference)"
                        )
    except Exception as e:  # a kernel that cannot run is a reason to fall back, not a crash
        return f"the optimizer's CUDA kernels could not run on {where} ({type(e).__name__}: {e})"
    return None
