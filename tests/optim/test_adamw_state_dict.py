"""State dicts of llmmem.optim.AdamW: save -> new optimizer -> training continues bit-identically
(every format, and from the earlier key layout of quantized codes); torch's AdamW state loads
(quantized on load) and our fp32 state loads into torch's AdamW, while a quantized one cannot be
trained on by torch's AdamW (its codes are under keys of their own); a saved run can switch
state_dtype; a state dict that does not fit (other groups, sizes, dtypes, damaged scales) is
refused before anything changes."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import llmmem.optim as lo

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FORMATS = ("fp32", "bf16", "int8", "int4")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 10))


def _steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        x = torch.randn(8, 64, generator=g)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_is_bit_identical(fmt):
    kw = dict(lr=1e-2, state_dtype=fmt, min_quantized_numel=64)
    a = _model()
    opt = lo.AdamW(a.parameters(), **kw)
    _steps(a, opt, 5, seed=1)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), _roundtrip(opt.state_dict())
    tail = _steps(a, opt, 5, seed=2)
    b = _model(seed=99)
    b.load_state_dict(saved_model)
    opt_b = lo.AdamW(b.parameters(), **kw)
    opt_b.load_state_dict(saved_opt)
    assert _steps(b, opt_b, 5, seed=2) == tail
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_torch_adamw_state_loads_and_is_converted(fmt):
    a = _model()
    theirs = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _steps(a, theirs, 3, seed=1)
    ours = lo.AdamW(a.parameters(), lr=5.0, state_dtype=fmt, min_quantized_numel=64)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["lr"] == 1e-2  # hyper-parameters come from the saved groups
    w = a[0].weight
    st = ours.state[w]
    assert st["state_dtype"] == fmt and float(st["step"]) == 3.0
    m, v = lo.formats.moments_as_float(lo.formats.infer_format(st, w.numel()), st, w.numel())
    ref_m, ref_v = theirs.state[w]["exp_avg"].reshape(-1), theirs.state[w]["exp_avg_sq"].reshape(-1)
    tol = {"bf16": 1e-2, "int8": 0.08, "int4": 0.35}[fmt]
    assert (m - ref_m).abs().max() <= tol * ref_m.abs().max()
    assert (v.sqrt() - ref_v.sqrt()).abs().max() <= tol * ref_v.sqrt().max()
    _steps(a, ours, 2, seed=2)  # and it trains on


def test_our_fp32_state_loads_into_torch_adamw_and_back():
    a, b = _model(), _model()
    ours = lo.AdamW(a.parameters(), lr=1e-2)
    _steps(a, ours, 4, seed=1)
    b.load_state_dict(a.state_dict())
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    theirs.load_state_dict(_roundtrip(ours.state_dict()))
    la, lb = _steps(a, ours, 3, seed=2), _steps(b, theirs, 3, seed=2)
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-5, atol=0)


def test_full_precision_state_dict_of_a_quantized_run_loads_into_torch():
    a = _model()
    ours = lo.AdamW(a.parameters(), lr=1e-2, state_dtype="int8", min_quantized_numel=64)
    _steps(a, ours, 3, seed=1)
    sd = ours.full_precision_state_dict()
    w = a[0].weight
    assert sd["state"][0]["exp_avg"].dtype == torch.float32 and sd["state"][0]["exp_avg"].shape == w.shape
    theirs = torch.optim.AdamW(a.parameters(), lr=1e-2)
    theirs.load_state_dict(sd)
    _steps(a, theirs, 1, seed=2)


@pytest.mark.parametrize("src,dst", [("int8", "fp32"), ("fp32", "int4"), ("int4", "int8"), ("bf16", "int8")])
def test_switching_state_dtype_of_a_saved_run(src, dst):
    a = _model()
    opt = lo.AdamW(a.parameters(), lr=1e-2, state_dtype=src, min_quantized_numel=64)
    _steps(a, opt, 3, seed=1)
    w = a[0].weight
    m0, v0 = lo.formats.moments_as_float(lo.formats.infer_format(opt.state[w], w.numel()), opt.state[w], w.numel())
    new = lo.AdamW(a.parameters(), lr=1e-2, state_dtype=dst, min_quantized_numel=64)
    new.load_state_dict(opt.state_dict())
    assert new.state[w]["state_dtype"] == dst
    m1, v1 = lo.formats.moments_as_float(lo.formats.infer_format(new.state[w], w.numel()), new.state[w], w.numel())
    assert (m1 - m0).abs().max() <= 0.35 * m0.abs().max()
    assert (v1.sqrt() - v0.sqrt()).abs().max() <= 0.35 * v0.sqrt().max()
    _steps(a, new, 2, seed=2)


def _trained(fmt="int8"):
    a = _model()
    opt = lo.AdamW(a.parameters(), lr=1e-2, state_dtype=fmt, min_quantized_numel=64)
    _steps(a, opt, 2, seed=1)
    return a, opt


def _damage(sd, what):
    sd = copy.deepcopy(sd)
    st = sd["state"][0]
    if what == "groups":
        sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))
    elif what == "group size":
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    elif what == "unknown id":
        sd["state"][99] = st
    elif what == "moment size":
        st["exp_avg_codes"] = st["exp_avg_codes"].reshape(-1)[:-5]
    elif what == "moment dtype":
        st["exp_avg_codes"] = st["exp_avg_codes"].float()
    elif what == "old layout moment dtype":  # the earlier layout: codes under torch's keys
        st["exp_avg"] = st.pop("exp_avg_codes").float()
        st["exp_avg_sq"] = st.pop("exp_avg_sq_codes")
    elif what == "codes without a quantized state_dtype":
        st["state_dtype"] = "fp32"
    elif what == "nan scale":
        st["exp_avg_scale"][1] = float("nan")
    elif what == "negative scale":
        st["exp_avg_sq_scale"][0] = -1.0
    elif what == "scale count":
        st["exp_avg_scale"] = st["exp_avg_scale"][:-1]
    elif what == "missing moment":
        del st["exp_avg_sq_codes"]
    elif what == "step":
        st["step"] = torch.tensor(float("nan"))
    elif what == "bad state_dtype":
        st["state_dtype"] = "int3"
    elif what == "not a dict":
        sd["state"][0] = [1, 2]
    return sd


@pytest.mark.parametrize(
    "what",
    [
        "groups",
        "group size",
        "unknown id",
        "moment size",
        "moment dtype",
        "old layout moment dtype",
        "codes without a quantized state_dtype",
        "nan scale",
        "negative scale",
        "scale count",
        "missing moment",
        "step",
        "bad state_dtype",
        "not a dict",
    ],
)
def test_a_state_dict_that_does_not_fit_is_refused_before_anything_changes(what):
    a, opt = _trained()
    sd = opt.state_dict()
    before = copy.deepcopy(opt.state_dict())
    groups_before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError):
        opt.load_state_dict(_damage(sd, what))
    after = opt.state_dict()
    for k, st in before["state"].items():
        for key, t in st.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, after["state"][k][key]), (what, key)
    assert [dict(g) for g in opt.param_groups] == groups_before


def test_adamw_stays_decoupled_when_it_loads_an_adam_state():
    # torch's AdamW forces decoupled_weight_decay=True on every load (its __setstate__); a state
    # saved by an Adam (L2 decay) must not turn llmmem's AdamW into an Adam
    m = _model()
    src = torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(m, src, 2, seed=1)
    sd = src.state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    a, b = _model(), _model()
    a.load_state_dict(m.state_dict())
    b.load_state_dict(m.state_dict())
    ours, theirs = lo.AdamW(a.parameters()), torch.optim.AdamW(b.parameters(), foreach=False)
    ours.load_state_dict(copy.deepcopy(sd))
    theirs.load_state_dict(copy.deepcopy(sd))
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    assert theirs.param_groups[0]["decoupled_weight_decay"] is True
    _steps(a, ours, 3, seed=2)
    _steps(b, theirs, 3, seed=2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)


def test_a_state_dict_without_state_and_params_without_state():
    # an optimizer that never stepped, and one whose second group has no gradient yet
    m = _model()
    opt = lo.AdamW([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}], lr=1e-2)
    empty = opt.state_dict()
    assert empty["state"] == {}
    fresh = lo.AdamW([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}], lr=1e-2)
    fresh.load_state_dict(_roundtrip(empty))
    assert len(fresh.state) == 0
    m(torch.randn(2, 64)).sum().backward()
    for p in m[2].parameters():
        p.grad = None
    opt.step()
    sd = _roundtrip(opt.state_dict())
    assert sorted(sd["state"]) == [0, 1]
    fresh.load_state_dict(sd)
    assert all(p in fresh.state for p in m[0].parameters()) and not any(p in fresh.state for p in m[2].parameters())


def _old_layout(sd):
    """A state dict as llmmem saved it before quantized codes had keys of their own."""
    sd = copy.deepcopy(sd)
    back = {"exp_avg_codes": "exp_avg", "exp_avg_sq_codes": "exp_avg_sq"}
    sd["state"] = {k: {back.get(key, key): v for key, v in st.items()} for k, st in sd["state"].items()}
    return sd


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_codes_are_saved_under_keys_of_their_own(fmt):
    a, opt = _trained(fmt)
    sd = opt.state_dict()
    w, bias = sd["state"][0], sd["state"][3]  # a quantized weight, a 10-element bias (fp32 moments)
    assert w["state_dtype"] == fmt and "exp_avg" not in w and "exp_avg_sq" not in w
    assert w["exp_avg_codes"] is opt.state[a[0].weight]["exp_avg"]  # not copies, as torch's state_dict
    assert bias["state_dtype"] == "fp32" and {"exp_avg", "exp_avg_sq"} <= set(bias)
    assert "exp_avg" in opt.state[a[0].weight]  # the live state keeps the kernels' keys


def test_torch_adamw_cannot_train_on_quantized_codes():
    # torch's load_state_dict takes any keys; without exp_avg its first step fails rather than
    # reading the codes as moments. full_precision_state_dict() is what it can use.
    a, opt = _trained("int8")
    theirs = torch.optim.AdamW(a.parameters(), lr=1e-2)
    theirs.load_state_dict(_roundtrip(opt.state_dict()))
    a(torch.randn(2, 64)).sum().backward()
    before = [p.detach().clone() for p in a.parameters()]
    with pytest.raises(KeyError, match="exp_avg"):
        theirs.step()
    assert all(torch.equal(b, p) for b, p in zip(before, a.parameters()))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_earlier_key_layout_resumes_bit_identically(fmt):
    kw = dict(lr=1e-2, state_dtype=fmt, min_quantized_numel=64)
    a = _model()
    opt = lo.AdamW(a.parameters(), **kw)
    _steps(a, opt, 3, seed=1)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), _old_layout(_roundtrip(opt.state_dict()))
    assert "exp_avg" in saved_opt["state"][0] and "exp_avg_codes" not in saved_opt["state"][0]
    tail = _steps(a, opt, 3, seed=2)
    b = _model(seed=99)
    b.load_state_dict(saved_model)
    opt_b = lo.AdamW(b.parameters(), **kw)
    opt_b.load_state_dict(saved_opt)
    assert _steps(b, opt_b, 3, seed=2) == tail


def test_a_saved_state_put_in_directly_is_stepped():
    # ZeroRedundancyOptimizer.load_state_dict writes each saved state into its local optimizer's
    # state as it was saved, codes keys included, without the optimizer's load_state_dict
    kw = dict(lr=1e-2, state_dtype="int8", min_quantized_numel=64)
    a = _model()
    opt = lo.AdamW(a.parameters(), **kw)
    _steps(a, opt, 2, seed=1)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), _roundtrip(opt.state_dict())
    tail = _steps(a, opt, 2, seed=2)
    b = _model(seed=99)
    b.load_state_dict(saved_model)
    opt_b = lo.AdamW(b.parameters(), **kw)
    for i, p in enumerate(b.parameters()):
        opt_b.state[p] = saved_opt["state"][i]
    assert opt_b.full_precision_state_dict()["state"][0]["exp_avg"].dtype == torch.float32
    assert _steps(b, opt_b, 2, seed=2) == tail
