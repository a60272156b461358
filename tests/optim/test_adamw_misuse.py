"""Bad input to llmmem.optim: each a ValueError/TypeError naming the argument and what was
expected, raised before anything changes; and a step that fails half-way through its checks or
allocations (an out-of-memory error included) changes no parameter and no state."""

from __future__ import annotations

import pytest
import torch

import llmmem.optim as lo


def _p(n=10, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(n).to(dtype))


@pytest.mark.parametrize(
    "kwargs,exc,words",
    [
        (dict(lr=-1e-3), ValueError, "lr"),
        (dict(lr=float("nan")), ValueError, "lr"),
        (dict(lr="fast"), TypeError, "lr"),
        (dict(eps=-1e-8), ValueError, "eps"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(betas=(1.0, 0.999)), ValueError, "betas[0]"),
        (dict(betas=(0.9, -0.1)), ValueError, "betas[1]"),
        (dict(betas=0.9), TypeError, "betas"),
        (dict(state_dtype="int2"), ValueError, "state_dtype"),
        (dict(state_dtype=8), ValueError, "state_dtype"),
        (dict(state_dtype="int8", block_size=100), ValueError, "block_size"),
        (dict(state_dtype="int8", block_size=8192), ValueError, "block_size"),
        (dict(block_size=64.0), TypeError, "block_size"),
        (dict(stochastic_rounding="yes"), TypeError, "stochastic_rounding"),
        (dict(min_quantized_numel=-1), ValueError, "min_quantized_numel"),
        (dict(master_weights=1), TypeError, "master_weights"),
        (dict(amsgrad=True), ValueError, "amsgrad"),
        (dict(capturable=True), ValueError, "capturable"),
        (dict(differentiable=True), ValueError, "differentiable"),
        (dict(seed="x"), TypeError, "seed"),
    ],
)
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        lo.AdamW([_p()], **kwargs)


def test_bad_group_settings_are_refused_and_the_group_is_not_added():
    opt = lo.AdamW([_p()])
    with pytest.raises(ValueError, match="state_dtype"):
        opt.add_param_group({"params": [_p()], "state_dtype": "fp8"})
    assert len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]})
    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [_p(dtype=torch.float64)]})
    assert len(opt.param_groups) == 1


def test_fp16_parameters_need_a_master():
    with pytest.raises(ValueError, match="master_weights=True"):
        lo.AdamW([_p(dtype=torch.float16)])
    p = _p(100, torch.float16)
    opt = lo.AdamW([p], master_weights=True, lr=0.1)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    opt.step()
    assert opt.state[p]["master"].dtype == torch.float32
    assert torch.equal(p, opt.state[p]["master"].half()) and not torch.equal(p, before)


def test_a_bad_gradient_in_a_later_group_changes_nothing():
    # (torch itself refuses gradients of another dtype or shape when they are assigned)
    good, bad = _p(100), _p(3)
    opt = lo.AdamW([{"params": [good]}, {"params": [bad], "state_dtype": "int8"}], lr=0.1)
    good.grad = torch.ones_like(good)
    bad.grad = torch.randn(3).to_sparse()
    before = good.detach().clone()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    assert torch.equal(good, before) and good not in opt.state  # all-or-nothing


def test_out_of_memory_while_making_state_changes_nothing(monkeypatch):
    a, b = _p(5000), _p(5000)
    opt = lo.AdamW([a, b], lr=0.1, state_dtype="int8")
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    c = _p(5000)
    opt.add_param_group({"params": [c]})
    c.grad = torch.ones_like(c)
    state_before = {k: v.clone() for k, v in opt.state[a].items() if isinstance(v, torch.Tensor)}
    weights_before = [t.detach().clone() for t in (a, b, c)]
    from llmmem.optim import formats

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: no memory for the new state")

    monkeypatch.setattr(formats, "new_moments", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert all(torch.equal(t, w) for t, w in zip((a, b, c), weights_before))
    assert all(torch.equal(opt.state[a][k], v) for k, v in state_before.items())
    assert c not in opt.state
    monkeypatch.undo()
    opt.step()  # and the next step works
    assert float(opt.state[a]["step"]) == 2.0 and float(opt.state[c]["step"]) == 1.0


def test_nan_and_inf_gradients_behave_as_in_torch():
    p, q = _p(50), _p(50)
    q.data.copy_(p.data)
    g = torch.randn(50)
    g[7], g[9] = float("nan"), float("inf")
    p.grad, q.grad = g.clone(), g.clone()
    lo.AdamW([p], lr=0.1).step()
    torch.optim.AdamW([q], lr=0.1, foreach=False).step()
    assert torch.equal(torch.isnan(p), torch.isnan(q))
    torch.testing.assert_close(p[torch.isfinite(q)], q[torch.isfinite(q)])


def test_adamw_refuses_coupled_decay():
    with pytest.raises(ValueError, match="Adam for L2"):
        lo.AdamW([_p()], decoupled_weight_decay=False)


def _stepped(fmt="fp32", n=5000):
    p = _p(n)
    opt = lo.AdamW([p], lr=0.1, state_dtype=fmt, min_quantized_numel=64)
    p.grad = torch.ones_like(p)
    opt.step()
    return p, opt


@pytest.mark.parametrize(
    "fmt,key,make,words",
    [
        # a view into a larger buffer: the kernel would write past its end into the buffer
        ("fp32", "exp_avg", lambda t, buf: buf[:10], "exp_avg has 10 elements"),
        ("int8", "exp_avg_scale", lambda t, buf: buf[:3], "exp_avg_scale"),
        ("fp32", "exp_avg_sq", lambda t, buf: t.double(), "exp_avg_sq is torch.float64"),
        ("fp32", "exp_avg", lambda t, buf: t.reshape(50, 100).t().contiguous().t(), "exp_avg is not contiguous"),
        ("fp32", "step", lambda t, buf: torch.tensor(1, dtype=torch.int64), "step"),
        ("fp32", "step", lambda t, buf: torch.zeros(2), "step"),
    ],
)
def test_a_state_tensor_put_in_by_hand_that_the_kernel_cannot_read_is_refused(fmt, key, make, words):
    p, opt = _stepped(fmt)
    buf = torch.zeros(10000, dtype=opt.state[p][key].dtype)
    opt.state[p][key] = make(opt.state[p][key], buf)
    before = p.detach().clone()
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=words):
        opt.step()
    assert torch.equal(p, before) and not buf.any()


def test_a_bad_hyper_parameter_in_a_later_group_changes_nothing():
    # a scheduler or a hand edit can put a value in a group after it was checked
    a, b = _p(5000), _p(5000)
    opt = lo.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
    for bad in (float("nan"), -1.0):
        for _ in range(2):  # the second step takes the cached (C walk) path
            a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
            opt.param_groups[1]["lr"] = 1e-2
            opt.step()
        opt.param_groups[1]["lr"] = bad
        before, step = a.detach().clone(), float(opt.state[a]["step"])
        with pytest.raises(ValueError, match="lr of group 1"):
            opt.step()
        assert torch.equal(a, before) and float(opt.state[a]["step"]) == step


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_a_parameter_listed_twice_in_a_group_is_refused():
    # torch only warns ("in future, this will cause an error"); stepped twice in one call, the
    # first step made two states of it and the kernel's threads would write it at once
    p = _p(100)
    with pytest.raises(ValueError, match="parameter 1 of group 0 is parameter 0 again"):
        lo.AdamW([p, p])
    opt = lo.AdamW([_p()])
    with pytest.raises(ValueError, match="of group 1"):
        opt.add_param_group({"params": [p, _p(), p]})
    assert len(opt.param_groups) == 1


def test_a_step_inside_a_cuda_graph_capture_is_refused(monkeypatch):
    # the step counters and bias corrections are host values computed at each call: a captured
    # step would replay with the captured step's; torch's AdamW (capturable=False) refuses too.
    # (The capture is simulated: the check is what is tested, not CUDA.)
    p = _p(100)
    opt = lo.AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        opt.step()
    assert torch.equal(p, before) and p not in opt.state
