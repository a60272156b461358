"""offload="cpu": the state lives in host memory and the C kernel steps it there (on the CPU the
same path runs with plain copies): the results equal the step without offload bit for bit, a
weight changed outside the step is taken (a master keeps its precision where it still rounds to
the weight), and state dicts round-trip. The masters of a step without offload follow weights
changed outside it the same way."""

from __future__ import annotations

import pytest
import torch

import llmmem.optim as lo

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8)).to(dtype)


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def _bits(t):
    t = t.detach()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_offloaded_step_equals_the_step_without_offload(fmt, dtype, master):
    a, b = _model(dtype), _model(dtype)
    kw = dict(lr=1e-2, state_dtype=fmt, min_quantized_numel=256, master_weights=master, seed=4)
    oa, ob = lo.AdamW(a.parameters(), offload="cpu", **kw), lo.AdamW(b.parameters(), **kw)
    _train(a, oa, 4)
    _train(b, ob, 4)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(_bits(p), _bits(q))
        for key, t in oa.state[p].items():
            if isinstance(t, torch.Tensor):
                assert t.device.type == "cpu" and torch.equal(
                    t.reshape(-1).view(torch.uint8), ob.state[q][key].reshape(-1).view(torch.uint8)
                )


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_a_weight_loaded_into_the_model_is_taken_and_a_master_keeps_its_precision(offload):
    model = _model(torch.bfloat16)
    opt = lo.AdamW(model.parameters(), lr=1e-2, master_weights=True, offload=offload, seed=4)
    _train(model, opt, 2)
    w = model[0].weight
    master_before = opt.state[w]["master"].clone()
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["0.weight"][0] = 1.0  # one row changed outside the optimizer, the rest reloaded as it was
    model.load_state_dict(new)
    w.grad = torch.zeros_like(w)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()  # a step that changes nothing: what is left is what the refresh took
    m = opt.state[w]["master"]
    assert torch.equal(m[0], torch.ones_like(m[0]))  # the changed row is taken
    assert torch.equal(m[1:], master_before[1:])  # the others keep the master's extra bits
    assert torch.equal(_bits(w[0]), _bits(torch.ones_like(w[0])))


def test_offloaded_state_dict_round_trip_and_switching_offload():
    a = _model()
    oa = lo.AdamW(a.parameters(), lr=1e-2, state_dtype="int8", min_quantized_numel=256, offload="cpu", seed=2)
    _train(a, oa, 3)
    sd = oa.state_dict()
    b = _model(seed=7)
    b.load_state_dict(a.state_dict())
    ob = lo.AdamW(b.parameters(), lr=1e-2, state_dtype="int8", min_quantized_numel=256, seed=2)  # not offloaded
    ob.load_state_dict(sd)
    _train(a, oa, 2, seed=3)
    _train(b, ob, 2, seed=3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_bad_offload_argument():
    with pytest.raises(ValueError, match="offload"):
        lo.AdamW(_model().parameters(), offload="nvme")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_offloaded_cuda_parameters_step_on_the_host(fmt):
    a, b = _model(torch.bfloat16).cuda(), _model(torch.bfloat16)
    kw = dict(lr=1e-2, state_dtype=fmt, min_quantized_numel=256, seed=4)
    oa, ob = lo.AdamW(a.parameters(), offload="cpu", **kw), lo.AdamW(b.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 32, generator=g).bfloat16()
        for m, o, xx in ((a, oa, x.cuda()), (b, ob, x)):
            o.zero_grad()
            m(xx).float().square().mean().backward()
        # the same gradients on both sides (the GPU's matmuls round otherwise than the CPU's)
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = p.grad.cpu()
        oa.step()
        ob.step()
    torch.cuda.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(_bits(p.cpu()), _bits(q))
        assert all(t.device.type == "cpu" for t in oa.state[p].values() if isinstance(t, torch.Tensor))
