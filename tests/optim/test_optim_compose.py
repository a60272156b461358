"""llmmem.optim.AdamW with the loss scalers (torch's and llmmem's: a step with inf/NaN gradients
is skipped, counters included; a finite one equals the unscaled step) and under torch.compile (a
compiled model trains as the eager one; a compiled function calling the step runs it eagerly,
and fullgraph=True says why it cannot)."""

from __future__ import annotations

import pytest
import torch

import llmmem
import llmmem.optim as lo

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _scalers():
    return {
        "torch": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8),
        "llmmem": lambda: llmmem.GradScaler("cpu", init_scale=2.0**8),
    }


@pytest.mark.parametrize("which", ["torch", "llmmem"])
@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_grad_scaler_skips_a_non_finite_step_and_takes_a_finite_one(which, fmt):
    a, b = _model(), _model()
    kw = dict(lr=1e-2, state_dtype=fmt, min_quantized_numel=256, seed=1)
    oa, ob = lo.AdamW(a.parameters(), **kw), lo.AdamW(b.parameters(), **kw)
    scaler = _scalers()[which]()
    x = torch.randn(8, 16)
    for step in range(3):
        oa.zero_grad()
        scaler.scale(a(x).square().mean()).backward()
        if step == 1:
            a[0].weight.grad[0, 0] = float("inf")
            before = {p: (p.detach().clone(), float(oa.state[p]["step"])) for p in a.parameters()}
        scaler.step(oa)
        scaler.update()
        if step == 1:
            for p, (w, n) in before.items():
                assert torch.equal(p, w) and float(oa.state[p]["step"]) == n  # skipped, counters too
            continue
        ob.zero_grad()
        b(x).square().mean().backward()
        ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        # the scale is a power of two: unscaling is exact, the updates are the unscaled ones
        assert torch.equal(p, q)


def test_a_compiled_model_trains_as_the_eager_one():
    a, b = _model(), _model()
    oa, ob = lo.AdamW(a.parameters(), lr=1e-2), lo.AdamW(b.parameters(), lr=1e-2)
    ca = torch.compile(a, backend="aot_eager")
    x = torch.randn(8, 16)
    for _ in range(3):
        for m, o in ((ca, oa), (b, ob)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_compiled_step_runs_eagerly_and_fullgraph_says_why():
    m = _model()
    opt = lo.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 16)).sum().backward()
    torch.compile(opt.step, backend="eager")()
    assert float(opt.state[m[0].weight]["step"]) == 1.0
    torch._dynamo.reset()
    with pytest.raises(Exception, match="native fused kernel"):
        torch.compile(opt.step, backend="eager", fullgraph=True)()
