"""linear_cross_entropy under torch.compile: traced whole (fullgraph=True) through its custom ops,
with the eager results; the ops pass torch.library.opcheck (schemas, fake tensors, autograd)."""

from __future__ import annotations

import pytest
import torch

import llmmem
from llmmem.head import ops
from llmmem.head.loss import _linear_cross_entropy


def _inputs(reduction_none=False):
    torch.manual_seed(0)
    h = torch.randn(48, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    b = torch.randn(300, requires_grad=True)
    y = torch.randint(0, 300, (48,))
    y[::7] = -100
    return h, w, b, y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fullgraph_compile_equals_eager(reduction):
    h, w, b, y = _inputs()

    def f(h, w, b, y):
        return llmmem.linear_cross_entropy(h, w, y, bias=b, reduction=reduction, label_smoothing=0.1, softcap=30.0)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    up = torch.linspace(0.5, 1.5, 48) if reduction == "none" else torch.tensor(1.0)
    got = compiled(h, w, b, y)
    g1 = torch.autograd.grad(got, (h, w, b), up)
    ref = f(h, w, b, y)
    g2 = torch.autograd.grad(ref, (h, w, b), up)
    torch.testing.assert_close(got, ref)
    for a, r in zip(g1, g2):
        torch.testing.assert_close(a, r)


def test_the_custom_ops_pass_opcheck():
    h, w, b, y = _inputs()
    torch.library.opcheck(ops.lce_grads, (h, w, b, y, -100, True, 0.0, 0.0, 16, True, True, True, torch.float32))
    torch.library.opcheck(ops.lce_rows, (h, w, b, y, -100, 0.1, 0.0, 16))
    lse = ops.lce_rows(h, w, b, y, -100, 0.1, 0.0, 16)[1].detach()
    torch.library.opcheck(
        ops.lce_rows_backward,
        (h.detach(), w.detach(), b.detach(), y, lse, torch.ones(48), -100, 0.1, 0.0, 16, True, True, True),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_half_precision_keeps_the_loss_dtype_and_an_fp32_upstream_gradient(dtype):
    # patch_lm_loss's call (an fp32 loss from half inputs) under a loss scale of 2**16, inf in fp16
    torch.manual_seed(0)
    h0, w0 = torch.randn(64, 16).to(dtype), (torch.randn(300, 16) * 0.1).to(dtype)
    y = torch.randint(0, 300, (64,))

    def f(h, w):
        return _linear_cross_entropy(h, w, y, None, -100, "mean", 0.0, None, 16, None, torch.float32)

    def run(fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w)
        (loss * 2.0**16).backward()
        return loss.detach(), h.grad, w.grad

    torch._dynamo.reset()
    got = run(torch.compile(f, backend="aot_eager", fullgraph=True))
    want = run(f)
    assert got[0].dtype == torch.float32
    for a, r in zip(got, want):
        assert torch.equal(a, r)
