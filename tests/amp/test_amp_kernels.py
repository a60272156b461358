"""The CPU unscale + check kernel against torch's own op and against llmmem's scalar reference
(every dtype, sizes 0..10^6+3, 1..1000 tensors, inf/NaN at the first/middle/last element,
non-contiguous tensors, several thread counts), the scale update against torch's, the
torch-ops fallback against the C rule, the visibility extras, and the binding's argument checks."""

from __future__ import annotations

import pickle
import random
import warnings

import pytest
import torch
from support.amp import assert_same

import llmmem
from llmmem._native import native
from llmmem.amp import kernels as K

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [0, 1, 7, 4097, 10**6 + 3]
SPECIALS = [float("inf"), float("-inf"), float("nan")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny torch ops: its threads only spin


def rand_grad(n, dtype, gen):
    # magnitudes spread over many binades, as scaled gradients are
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-12, 12, (n,), generator=gen))
    return x.to(dtype)


def torch_unscale(grads, scale):
    found = torch.zeros(())
    inv = torch.full((), scale, dtype=torch.float32).double().reciprocal().float()
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
    return found.item()


def llmmem_unscale(grads, scale, num_threads=None, reference=False):
    found = torch.zeros(())
    flags = torch.zeros(len(grads), dtype=torch.uint8)
    s = torch.full((), scale, dtype=torch.float32)
    if num_threads is None and not reference:
        K.unscale_check_(grads, found, flags, s)
    else:
        native.scaler_unscale_check(
            [g.data_ptr() for g in grads],
            [g.numel() for g in grads],
            [K.DTYPE_CODES[g.dtype] for g in grads],
            s.data_ptr(),
            False,
            found.data_ptr(),
            flags.data_ptr(),
            len(grads),
            num_threads or 1,
            reference=reference,
        )
    return found.item(), flags


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "n,where", [(n, w) for n in SIZES for w in ("none", "first", "middle", "last") if n > 0 or w == "none"]
)
def test_single_tensor_matches_torch(dtype, n, where):
    gen = torch.Generator().manual_seed(n + 17 * DTYPES.index(dtype))
    g = rand_grad(n, dtype, gen)
    if where != "none":
        idx = {"first": 0, "middle": n // 2, "last": n - 1}[where]
        g[idx] = SPECIALS[(n + idx) % 3]
    ours, ref = g.clone(), g.clone()
    found_t = torch_unscale([ref], 2.0**13)
    found_l, flags = llmmem_unscale([ours], 2.0**13)
    assert found_l == found_t == (0.0 if where == "none" else 1.0)
    assert flags.tolist() == ([0] if where == "none" else [1])
    assert_same(ours, ref)


@pytest.mark.parametrize("scale", [65536.0, 3.0, 0.375, 1.0, 1e-30])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scales_including_inverse_above_one(dtype, scale):
    """inv_scale > 1 can overflow fp16 to inf; scale 1 must leave values untouched; 1e-30 overflows fp32."""
    g = rand_grad(5000, dtype, torch.Generator().manual_seed(3))
    ours, ref = g.clone(), g.clone()
    assert llmmem_unscale([ours], scale)[0] == torch_unscale([ref], scale)
    assert_same(ours, ref)


@pytest.mark.parametrize("count", [1, 2, 10, 150, 1000])
def test_many_tensors_mixed_dtypes_match_torch(count):
    rng = random.Random(count)
    gen = torch.Generator().manual_seed(count)
    grads = [rand_grad(rng.choice([0, 1, 7, 64, rng.randint(1, 9000)]), rng.choice(DTYPES), gen) for _ in range(count)]
    poisoned = set()
    for _ in range(max(1, count // 20)):
        i = rng.randrange(count)
        if grads[i].numel():
            grads[i][rng.randrange(grads[i].numel())] = rng.choice(SPECIALS)
            poisoned.add(i)
    ours = [g.clone() for g in grads]
    ref = [g.clone() for g in grads]
    found_t = torch_unscale(ref, 1024.0)
    found_l, flags = llmmem_unscale(ours, 1024.0)
    assert found_l == found_t
    assert {i for i, f in enumerate(flags.tolist()) if f} == poisoned
    for a, b in zip(ours, ref):
        assert_same(a, b)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_thread_counts_match_the_scalar_reference(threads):
    gen = torch.Generator().manual_seed(threads)
    grads = [
        rand_grad(n, dt, gen)
        for n, dt in [
            (3_000_007, torch.float32),
            (300_001, torch.bfloat16),
            (4097, torch.float16),
            (250_000, torch.float64),
            (0, torch.float32),
        ]
    ]
    grads[1][-1] = float("nan")
    ours = [g.clone() for g in grads]
    ref = [g.clone() for g in grads]
    f1, fl1 = llmmem_unscale(ours, 4096.0, num_threads=threads)
    f2, fl2 = llmmem_unscale(ref, 4096.0, reference=True)
    assert f1 == f2 == 1.0 and torch.equal(fl1, fl2) and fl1.tolist() == [0, 1, 0, 0, 0]
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bitwise, NaN payloads included


def test_non_contiguous_tensors():
    gen = torch.Generator().manual_seed(5)
    base = rand_grad(64 * 48, torch.float32, gen).view(64, 48)
    dense_t = base.clone().t()  # transposed: dense, treated as flat memory
    strided = base.clone()[:, ::3]  # a real strided view: copied, unscaled, copied back
    channels_last = (
        rand_grad(2 * 3 * 5 * 7, torch.bfloat16, gen).view(2, 3, 5, 7).to(memory_format=torch.channels_last)
    )
    strided[5, 7] = float("inf")
    grads = [dense_t, strided, channels_last]
    ref = [g.contiguous().clone() for g in grads]  # torch's op on the same values, laid out flat
    found_t = torch_unscale(ref, 8.0)
    found_l, flags = llmmem_unscale(grads, 8.0)
    assert found_l == found_t == 1.0 and flags.tolist() == [0, 1, 0]
    for a, b in zip(grads, ref):
        assert_same(a.contiguous(), b)
    assert not strided.is_contiguous() and strided.stride() == (48, 3)


def test_dense_span_detection():
    x = torch.zeros(4, 6)
    assert K._dense_span(x) and K._dense_span(x.t())
    assert K._dense_span(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert K._dense_span(torch.zeros(1, 5).as_strided((1, 5), (99, 1)))  # size-1 dims' strides do not matter
    assert not K._dense_span(x[:, ::2]) and not K._dense_span(x[1:3, 1:3])
    assert not K._dense_span(torch.zeros(3).expand(4, 3))  # overlapping


def test_sparse_gradients_same_as_torch():
    results = []
    for impl in (torch.amp.GradScaler, llmmem.GradScaler):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        s = impl("cpu", init_scale=256.0, growth_interval=3)
        for step in range(12):
            opt.zero_grad()
            s.scale(emb(torch.tensor([[1, 2, 2, 7 + step]])).pow(2).sum()).backward()
            if step == 4:
                emb.weight.grad._values()[0, 0] = float("inf")
            s.step(opt)
            s.update()
        results.append((s.get_scale(), emb.weight.detach().clone()))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


def test_update_matches_torch_with_awkward_factors():
    rng = random.Random(7)
    st = torch.full((), 1000.0)
    gt = torch.zeros((), dtype=torch.int32)
    sl, gl = st.clone(), gt.clone()
    hyst = torch.ones((), dtype=torch.int32)
    stats = torch.zeros(4, dtype=torch.int64)
    skipped = 0
    for _ in range(3000):
        found = torch.full((), float(rng.random() < 0.3))
        skipped += int(found.item())
        torch._amp_update_scale_(st, gt, found, 1.7, 0.37, 3)
        K.update_scale_(sl, gl, hyst, stats, [found], 1.7, 0.37, 3, 1, 0.0)
        assert torch.equal(st, sl) and torch.equal(gt, gl)
    assert stats.tolist()[:2] == [3000, skipped]


@pytest.mark.parametrize("on_growth", [False, True])
@pytest.mark.parametrize("hysteresis,min_scale", [(1, 0.0), (3, 0.0), (2, 4.0), (1, 1e-3)])
def test_torch_ops_fallback_update_follows_the_c_rule(hysteresis, min_scale, on_growth):
    rng = random.Random(hysteresis)
    a = [
        torch.full((), 64.0),
        torch.zeros((), dtype=torch.int32),
        torch.full((), hysteresis, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int64),
    ]
    b = [t.clone() for t in a]
    for _ in range(400):
        found = [torch.full((), float(rng.random() < 0.45)), torch.zeros(())]
        K.update_scale_(*a, found, 2.0, 0.5, 4, hysteresis, min_scale, on_growth)
        K._torch_update_(*b, found, 2.0, 0.5, 4, hysteresis, min_scale, on_growth)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _megatron_rule(found_seq, scale, growth_interval, hysteresis, on_growth):
    """Megatron-LM's DynamicGradScaler.update (on_growth) / apex's consecutive rule, in Python:
    the reference the C rule is checked against (scales stay powers of two, so floats are exact)."""
    growth, hyst, out = 0, hysteresis, []
    for found in found_seq:
        if found:
            growth = 0
            hyst -= 1
            if hyst <= 0:
                hyst = 0
                scale *= 0.5
        else:
            if not on_growth:
                hyst = hysteresis
            growth += 1
            if growth == growth_interval:
                growth = 0
                scale *= 2.0
                if on_growth:
                    hyst = hysteresis
        out.append((scale, growth, hyst))
    return out


@pytest.mark.parametrize("on_growth", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_update_rule_matches_megatron_and_apex(hysteresis, on_growth):
    rng = random.Random(hysteresis * 2 + on_growth)
    seq = [rng.random() < 0.4 for _ in range(500)]
    want = _megatron_rule(seq, 2.0**20, 4, hysteresis, on_growth)
    st = [
        torch.full((), 2.0**20),
        torch.zeros((), dtype=torch.int32),
        torch.full((), hysteresis, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int64),
    ]
    for found, (scale, growth, hyst) in zip(seq, want):
        K.update_scale_(*st, [torch.full((), float(found))], 2.0, 0.5, 4, hysteresis, 0.0, on_growth)
        assert (st[0].item(), st[1].item(), st[2].item()) == (scale, growth, hyst)


@pytest.mark.parametrize("mode,backed_off", [("consecutive", False), ("on_growth", True)])
def test_hysteresis_mode_overflow_clean_overflow(mode, backed_off):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = llmmem.GradScaler("cpu", init_scale=64.0, hysteresis=2, growth_interval=100, hysteresis_mode=mode)
    train(s, model, opt, 1, poison_at=(0,))
    train(s, model, opt, 1)
    train(s, model, opt, 1, poison_at=(0,))
    assert s.get_scale() == (32.0 if backed_off else 64.0)
    sd = s.state_dict()
    assert sd["hysteresis_mode"] == mode
    s2 = llmmem.GradScaler("cpu")
    s2.load_state_dict(sd)
    assert s2.state_dict() == sd


def test_torch_ops_fallback_unscale_matches():
    gen = torch.Generator().manual_seed(9)
    grads = [rand_grad(n, dt, gen) for n, dt in [(100, torch.float32), (33, torch.bfloat16), (7, torch.float64)]]
    grads[2][3] = float("nan")
    ours, fb = [g.clone() for g in grads], [g.clone() for g in grads]
    f1, fl1 = torch.zeros(()), torch.zeros(3, dtype=torch.uint8)
    f2, fl2 = torch.zeros(()), torch.zeros(3, dtype=torch.uint8)
    K.unscale_check_(ours, f1, fl1, torch.full((), 512.0))
    K._torch_unscale_check_(fb, f2, fl2, torch.full((), 512.0), False)
    assert f1.item() == f2.item() == 1.0 and torch.equal(fl1, fl2)
    for a, b in zip(ours, fb):
        assert_same(a, b)


def test_check_only_path_leaves_gradients_untouched():
    g = rand_grad(1000, torch.float32, torch.Generator().manual_seed(1))
    g[10] = float("-inf")
    before = g.clone()
    found, flags = torch.zeros(()), torch.zeros(1, dtype=torch.uint8)
    K.unscale_check_([g], found, flags, None)
    assert found.item() == 1.0 and flags.item() == 1 and torch.equal(g.view(torch.int32), before.view(torch.int32))


# ---------------------------------------------------------------------- visibility extras


def train(scaler, model, opt, steps, poison_at=(), poison_param="weight"):
    params = dict(model.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if step in poison_at:
            params[poison_param].grad.view(-1)[-1] = float("nan")
        scaler.step(opt)
        scaler.update()


def test_overflowed_params_names_and_indices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = llmmem.GradScaler("cpu", init_scale=8.0)
    train(s, model, opt, 3, poison_at=(2,), poison_param="2.bias")
    assert s.overflowed_params(model) == ["2.bias"]
    assert s.overflowed_params() == [(0, 3)]
    assert s.overflowed_params(optimizer=opt) == [(0, 3)]
    assert s.last_step_skipped() and s.skipped_steps() == 1
    train(s, model, opt, 1)
    assert s.overflowed_params(model) == [] and not s.last_step_skipped()
    assert s.stats() == {"updates": 4, "skipped_steps": 1, "last_step_skipped": 0, "min_scale_hits": 0}
    s2 = pickle.loads(pickle.dumps(s))  # counters survive pickling, and keep counting
    train(s2, model, opt, 1, poison_at=(0,), poison_param="0.weight")
    assert s2.stats() == {"updates": 5, "skipped_steps": 2, "last_step_skipped": 1, "min_scale_hits": 0}


def test_unpickling_a_scaler_saved_before_hysteresis_mode_uses_the_consecutive_rule():
    s = llmmem.GradScaler("cpu", init_scale=8.0, hysteresis=2)
    state = s.__getstate__()
    del state["_hysteresis_mode"]  # what a pickle from before the option holds
    old = llmmem.GradScaler.__new__(llmmem.GradScaler)
    old.__setstate__(state)
    assert old.state_dict()["hysteresis_mode"] == "consecutive"
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train(old, model, opt, 1)
    assert old.stats()["updates"] == 1


def test_visibility_readers_on_a_disabled_scaler():
    s = llmmem.GradScaler("cpu", enabled=False)
    assert s.stats() == {"updates": 0, "skipped_steps": 0, "last_step_skipped": 0, "min_scale_hits": 0}
    assert s.overflowed_params() == [] and not s.last_step_skipped() and s.skipped_steps() == 0


def test_hysteresis_holds_the_scale_for_n_overflows():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = llmmem.GradScaler("cpu", init_scale=64.0, hysteresis=3, growth_interval=100)
    train(s, model, opt, 2, poison_at=(0, 1))
    assert s.get_scale() == 64.0 and s.skipped_steps() == 2
    train(s, model, opt, 1, poison_at=(0,))
    assert s.get_scale() == 32.0
    sd = s.state_dict()
    assert sd["hysteresis"] == 3 and sd["_hysteresis_tracker"] == 0
    s2 = llmmem.GradScaler("cpu")
    s2.load_state_dict(sd)
    assert s2.state_dict() == sd


def test_min_scale_floors_and_warns_once():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = llmmem.GradScaler("cpu", init_scale=8.0, min_scale=2.0)
    with pytest.warns(RuntimeWarning, match="min_scale=2.0") as rec:
        train(s, model, opt, 5, poison_at=range(5))
    assert len([w for w in rec if "min_scale" in str(w.message)]) == 1
    assert s.get_scale() == 2.0 and s.stats()["min_scale_hits"] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(s, model, opt, 1, poison_at=(0,))


def test_feature_status_and_binding_argument_checks():
    from llmmem import amp

    usable, detail = amp.feature_status()
    assert usable and "CPU kernel" in detail
    found = torch.zeros(())
    with pytest.raises(ValueError, match="same length"):
        native.scaler_unscale_check([0], [], [], 0, False, found.data_ptr(), 0, 0, 1)
    with pytest.raises(llmmem.InvalidArgumentError, match=r"tensors\[0\].dtype 9"):
        native.scaler_unscale_check([found.data_ptr()], [1], [9], 0, False, found.data_ptr(), 0, 0, 1)
    with pytest.raises(llmmem.InvalidArgumentError, match="found_inf"):
        native.scaler_unscale_check([], [], [], 0, False, 0, 0, 0, 1)
    # A code past int32 must not wrap to a valid one (2**32 + 1 would become 1, fp16).
    g = torch.ones(4)
    for code in (2**32 + 1, -(2**32) + 1, 2**40):
        with pytest.raises(ValueError, match=r"dtypes\[0\] = -?\d+ is not a dtype code"):
            native.scaler_unscale_check([g.data_ptr()], [4], [code], 0, False, found.data_ptr(), 0, 0, 1)
    assert g.tolist() == [1.0] * 4 and found.item() == 0.0
    with pytest.raises(ValueError, match="n_flags"):
        native.scaler_unscale_check([], [], [], 0, False, found.data_ptr(), 0, -1, 1)
    with pytest.raises(llmmem.InvalidArgumentError, match="growth_interval"):
        native.scaler_check_config(2.0, 0.5, 0, 1, 0.0)
    if not K.cuda_kernels_built():
        with pytest.raises(llmmem.NotBuiltError, match="without CUDA"):
            native.scaler_unscale_check_cuda([], [], [], 0, False, found.data_ptr(), 0, 0, 0, 0)
