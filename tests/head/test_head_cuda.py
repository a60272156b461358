"""The head's CUDA passes: their known-answer check (run on the CPU here, where it checks the C
passes, and with broken passes, which it must catch), the fallback to the torch reference where
the kernels do not run, and on a GPU the fused loss against torch's and its peak against the
plain head's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmmem
from llmmem.head import cuda, kernels, passes


def test_self_check_passes_on_the_cpu_passes():
    assert cuda.self_check(torch.device("cpu")) is None


def test_self_check_catches_a_pass_that_is_slightly_off():
    def off_stats(logits, labels, s):
        st = kernels.stats_native(logits, labels, s)
        st.sum.mul_(1.001)
        return st

    why = cuda.self_check(torch.device("cpu"), stats=off_stats)
    assert why is not None and "known-answer check" in why and "row sum" in why, why

    def off_grad(logits, labels, s, lse, scale):
        kernels.grad_native_(logits, labels, s, lse, scale * 1.001)

    why = cuda.self_check(torch.device("cpu"), grad=off_grad)
    assert why is not None and "the gradient" in why, why


def test_self_check_reports_a_kernel_that_raises():
    def failing(*args):
        raise RuntimeError("no kernel image for this GPU")

    why = cuda.self_check(torch.device("cpu"), stats=failing)
    assert why is not None and "could not run" in why and "no kernel image" in why


def test_where_the_kernels_do_not_run_the_torch_reference_gives_the_same_loss(monkeypatch):
    # what a GPU whose kernels fail their check runs (the CPU stands in for it)
    monkeypatch.setattr(passes, "_native_fits", lambda logits, labels: False)
    torch.manual_seed(0)
    h, w = torch.randn(40, 16, requires_grad=True), torch.randn(900, 16, requires_grad=True)
    y = torch.randint(0, 900, (40,))
    got = llmmem.linear_cross_entropy(h, w, y, label_smoothing=0.1, softcap=20.0)
    ref = F.cross_entropy(20.0 * torch.tanh(F.linear(h, w) / 20.0), y, label_smoothing=0.1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, r in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cuda_loss_and_gradients_equal_torchs(dtype, softcap):
    assert cuda.unsupported_reason(torch.device("cuda")) is None
    torch.manual_seed(0)
    h = torch.randn(2, 300, 256, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(32000, 256, device="cuda") * 0.05).to(dtype).requires_grad_()
    y = torch.randint(0, 32000, (2, 300), device="cuda")
    y[:, ::7] = -100
    for reduction in ("mean", "none"):
        got = llmmem.linear_cross_entropy(h, w, y, softcap=softcap, reduction=reduction)
        logits = F.linear(h, w).float()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        ref = F.cross_entropy(logits.reshape(-1, 32000), y.reshape(-1), reduction=reduction)
        ref = ref.reshape(got.shape)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), ref, **tol)
        up = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.0, device="cuda")
        ga = torch.autograd.grad(got, (h, w), up.to(got.dtype))
        gr = torch.autograd.grad(ref, (h, w), up)
        for a, r in zip(ga, gr):
            scale = float(r.abs().max())
            torch.testing.assert_close(a.float(), r.float(), rtol=tol["rtol"] * 10, atol=tol["atol"] * scale)


@pytest.mark.cuda
def test_cuda_peak_is_a_fraction_of_the_plain_heads():
    torch.manual_seed(0)
    n, hid, v = 8192, 1024, 128256
    h = torch.randn(n, hid, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, hid, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")

    def peak(fn):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain = peak(lambda: F.cross_entropy(F.linear(h, w).float(), y))
    fused = peak(lambda: llmmem.linear_cross_entropy(h, w, y))
    assert fused <= 0.1 * plain, (fused, plain)
