"""The C step against the torch-ops reference (llmmem.optim.reference), bit for bit: every state
format, parameter dtype, master or not, sizes around tiles, blocks and pieces, NaN/inf
gradients, strided parameters and gradients, one and several threads; and the bytes of state
each format keeps a parameter."""

from __future__ import annotations

import pytest
import torch

import llmmem.optim as lo
from llmmem.optim import kernels

SIZES = (0, 1, 7, 33, 256, 257, 4097, 40000)
CASES = [
    (fmt, dtype, master)
    for fmt in ("fp32", "bf16", "int8", "int4")
    for dtype, master in (
        (torch.float32, False),
        (torch.bfloat16, False),
        (torch.bfloat16, True),
        (torch.float16, True),
    )
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that NaNs compare equal to themselves."""
    t = t.detach().contiguous()
    if not t.is_floating_point():
        return t
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_state(a: dict, b: dict) -> bool:
    return all(torch.equal(_bits(a[k]), _bits(b[k])) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _run(monkeypatch, fmt, dtype, master, *, sizes=SIZES, steps=3, specials=False, strided=False, threads=None, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter((torch.randn(n) * 3).to(dtype)) for n in sizes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    args = dict(lr=1e-2, weight_decay=0.05, state_dtype=fmt, min_quantized_numel=32, master_weights=master, seed=7)
    args.update(kw)
    a, b = lo.AdamW(ps, **args), lo.AdamW(qs, **args)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for step in range(steps):
            for p, q in zip(ps, qs):
                g = torch.randn(p.shape) * torch.logspace(-6, 2, max(p.numel(), 1))[: p.numel()]
                if specials and p.numel() > 10:
                    g[3], g[-2] = float("nan"), float("inf") if step == 0 else 1.0
                g = g.to(dtype)
                if strided:
                    g = torch.stack((g, g)).t()[:, 0]  # a strided view of the same values
                p.grad, q.grad = g, g.clone()
            a.step()
            with monkeypatch.context() as m:
                # b steps by the reference alone: no C walk of its groups, no native route
                b._group_caches.clear()
                m.setattr(kernels, "native_route", lambda device: "the reference, for the test")
                m.setattr(kernels, "_warn_fallback", lambda device, why: None)
                m.setattr(kernels, "_step_native", None)  # fails loudly if anything still routes there
                b.step()
    finally:
        torch.set_num_threads(before)
    for p, q in zip(ps, qs):
        assert torch.equal(_bits(p), _bits(q)), (fmt, dtype, master, p.numel())
        assert _same_state(a.state[p], b.state[q]), (fmt, dtype, master, p.numel())
    return a, ps


@pytest.mark.parametrize("fmt,dtype,master", CASES)
def test_c_equals_reference(monkeypatch, fmt, dtype, master):
    _run(monkeypatch, fmt, dtype, master)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_nan_and_inf_gradients_and_options(monkeypatch, fmt):
    a, ps = _run(monkeypatch, fmt, torch.float32, False, sizes=(5000, 300), specials=True)
    p = ps[0]
    assert torch.isnan(p[3]) and torch.isnan(p[-2]) and torch.isfinite(p[10:-10]).all()
    _run(monkeypatch, fmt, torch.bfloat16, False, sizes=(3000,), stochastic_rounding=False)
    _run(monkeypatch, fmt, torch.float32, False, sizes=(3000,), maximize=True, betas=(0.4, 0.95))
    _run(monkeypatch, fmt, torch.float32, False, sizes=(70000,), block_size=32 if fmt in ("int8", "int4") else None)


def test_strided_gradients_and_threads(monkeypatch):
    _run(monkeypatch, "int8", torch.float32, False, sizes=(3000, 999), strided=True)
    _run(monkeypatch, "fp32", torch.bfloat16, False, sizes=(1 << 19, 5), threads=2, steps=2)
    _run(monkeypatch, "int4", torch.float32, False, sizes=(1 << 19,), threads=2, steps=2)


def test_strided_parameter():
    torch.manual_seed(0)
    base = torch.randn(64, 48)
    p = torch.nn.Parameter(base.t())  # a transposed, non-contiguous weight
    q = torch.nn.Parameter(base.t().contiguous())
    g = torch.randn(48, 64)
    p.grad, q.grad = g.clone(), g.clone()
    lo.AdamW([p], lr=0.1).step()
    lo.AdamW([q], lr=0.1).step()
    assert torch.equal(p, q) and p.stride() == (1, 48)


@pytest.mark.parametrize(
    "fmt,bound",
    [("fp32", 8.0), ("bf16", 4.05), ("int8", 2.05), ("int4", 1.1)],
)
def test_state_bytes_per_parameter(fmt, bound):
    p = torch.nn.Parameter(torch.randn(1 << 16))
    p.grad = torch.randn_like(p)
    opt = lo.AdamW([p], state_dtype=fmt)
    opt.step()
    state_bytes = sum(
        t.numel() * t.element_size() for k, t in opt.state[p].items() if isinstance(t, torch.Tensor) and k != "step"
    )
    assert state_bytes / p.numel() <= bound
    assert state_bytes / p.numel() >= bound - 0.1  # and it is the format asked for


def test_small_tensors_keep_fp32_moments_in_quantized_formats():
    small, big = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(5000))
    for p in (small, big):
        p.grad = torch.randn_like(p)
    opt = lo.AdamW([small, big], state_dtype="int8")
    opt.step()
    assert opt.state[small]["exp_avg"].dtype == torch.float32
    assert opt.state[big]["exp_avg"].dtype == torch.int8 and opt.state[big]["exp_avg_sq"].dtype == torch.uint8


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_finite_gradient_whose_square_overflows_behaves_as_in_torch(fmt):
    # (c2 * g) * g overflows float32 from |g| ~ 6e20 at beta2 = 0.999; the gradient itself is finite
    torch.manual_seed(0)
    w = torch.randn(5000)
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = lo.AdamW([p], lr=1e-2, state_dtype=fmt, min_quantized_numel=64)
    theirs = torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for step in range(3):
        g = torch.randn(5000)
        if step == 0:
            g[7] = 1e22
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.isfinite(q).all()
    assert torch.isfinite(p).all()
