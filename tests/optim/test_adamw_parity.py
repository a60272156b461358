"""llmmem.optim.AdamW/Adam in fp32 state against torch's single-tensor AdamW/Adam: the same
parameters after 100 steps with two parameter groups, weight decay and a scheduler; the same
behaviour of the Optimizer API (groups, hooks, closure, zero_grad, tensor lr)."""

from __future__ import annotations

import pytest
import torch

import llmmem.optim as lo

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


def _train(model, opt, steps=100, sched=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 40, generator=g)
        y = torch.randint(0, 7, (16,), generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("cls", ["AdamW", "Adam"])
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_torch_after_100_steps(cls, maximize):
    a, b = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.85, 0.99), eps=1e-7, maximize=maximize)
    ours = getattr(lo, cls)(_groups(a), **kw)
    theirs = getattr(torch.optim, cls)(_groups(b), foreach=False, **kw)
    s1 = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=100)
    s2 = torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=100)
    _train(a, ours, sched=s1)
    _train(b, theirs, sched=s2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)
        sa, sb = ours.state[pa], theirs.state[pb]
        assert float(sa["step"]) == float(sb["step"]) == 100.0
        # the moments agree to the same relative precision of their largest elements (an m that
        # cancels to about 0 differs in its relative error where the weights differ at 1e-8)
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(sb[key].abs().max())
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-5 * scale)


def test_lerp_weight_above_half_and_zero_decay():
    a, b = _model(), _model()
    kw = dict(lr=5e-3, betas=(0.3, 0.9), weight_decay=0.0)
    ours, theirs = lo.AdamW(a.parameters(), **kw), torch.optim.AdamW(b.parameters(), foreach=False, **kw)
    _train(a, ours, steps=30)
    _train(b, theirs, steps=30)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)


def test_tensor_lr_closure_and_hooks():
    model = _model()
    opt = lo.AdamW(model.parameters(), lr=torch.tensor(1e-2))
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    x = torch.randn(4, 40)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and seen == ["pre", "post"]
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    h1.remove(), h2.remove()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_parameters_without_grad_are_skipped_and_groups_added_later():
    model = _model()
    first, second = model[0], model[2]
    opt = lo.AdamW(first.parameters(), lr=1e-2)
    opt.add_param_group({"params": second.parameters(), "state_dtype": "int8", "min_quantized_numel": 0})
    x = torch.randn(4, 40)
    model(x).sum().backward()
    second.weight.grad = None
    w = second.weight.detach().clone()
    opt.step()
    assert torch.equal(second.weight, w) and second.weight not in opt.state
    assert opt.state[second.bias]["state_dtype"] == "int8"
    assert float(opt.state[first.weight]["step"]) == 1.0


def test_empty_and_one_element_parameters():
    ps = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.ones(1))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    lo.AdamW(ps, lr=0.1).step()
    torch.optim.AdamW(qs, lr=0.1, foreach=False).step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q)
