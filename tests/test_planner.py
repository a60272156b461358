"""The recompute planner: optimality against brute force, monotonicity, the fast path, input checks,
infeasible budgets, profiling, and the honesty test (measured bytes against the prediction)."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn as nn

import llmmem
from llmmem import _C
from llmmem.models.gpt import GPT, GPTConfig
from llmmem.planner import AutoCheckpointed, measure_saved_bytes


def random_chain(L, K, rnd, identical=False):
    def block():
        fn = rnd.uniform(1, 5)
        full = rnd.randint(4, 16)
        return dict(
            f=[fn + 0.3 * k for k in range(K)], fn=fn, b=[2 * fn + k * rnd.uniform(0.5, 2) for k in range(K)],
            s=[full if k == 0 else full // (k + 1) for k in range(K)], ft=rnd.randint(0, 2),
            bt=[rnd.randint(0, 2) for _ in range(K)])

    blocks = [block()] * L if identical else [block() for _ in range(L)]
    xs = [rnd.randint(1, 4)] * (L + 1) if identical else [rnd.randint(1, 4) for _ in range(L + 1)]
    return {"fwd_time": [b["f"] for b in blocks], "fwd_nostore_time": [b["fn"] for b in blocks],
            "bwd_time": [b["b"] for b in blocks], "input_bytes": xs, "saved_bytes": [b["s"] for b in blocks],
            "fwd_tmp_bytes": [b["ft"] for b in blocks], "bwd_tmp_bytes": [b["bt"] for b in blocks],
            "mode_nestable": [1] + [0] * (K - 1)}


def all_plans(L, K, nestable):
    """Every plan: properly nested regions (no region twice) and a mode per block."""

    def sequences(s, e, depth, is_body):
        if s == e:
            yield [], []
            return
        for k in range(K):
            if depth > 0 and not nestable[k]:
                continue
            for modes, regions in sequences(s + 1, e, depth, False):
                yield [k] + modes, regions
        for q in range(s + 1, e + 1):
            if is_body and q == e:
                continue
            for inner_modes, inner_regions in sequences(s, q, depth + 1, True):
                for modes, regions in sequences(q, e, depth, False):
                    yield inner_modes + modes, [(s, q)] + inner_regions + regions

    yield from sequences(0, L, 0, False)


def test_dp_is_optimal_against_brute_force():
    rnd = random.Random(4)
    for trial in range(8):
        L, K = (6, 2) if trial == 0 else (5, 2) if trial < 3 else (rnd.randint(1, 4), rnd.randint(1, 3))
        chain = random_chain(L, K, rnd)
        least = _C.plan_min_budget(chain)
        budgets = sorted({least, least + rnd.randint(0, least), least + rnd.randint(0, 2 * least), 10 * least})
        best = {b: math.inf for b in budgets}
        least_peak = math.inf
        n_plans = 0
        for modes, regions in all_plans(L, K, chain["mode_nestable"]):
            n_plans += 1
            sim = _C.plan_simulate(chain, modes, regions)
            least_peak = min(least_peak, sim["peak_bytes"])
            for b in budgets:
                if sim["peak_bytes"] <= b:
                    best[b] = min(best[b], sim["time"])
        assert least == least_peak
        assert n_plans >= {6: 35000, 5: 4000}.get(L, 1)  # exhaustive: all 35581 resp. 4155 plans
        for b in budgets:
            got = _C.plan_solve(chain, b, b)  # one byte per slot: no rounding
            assert got["peak_bytes"] <= b
            assert got["time"] == pytest.approx(best[b], rel=1e-5)
            again = _C.plan_simulate(chain, got["modes"], got["regions"])
            assert again["time"] == pytest.approx(got["time"]) and again["peak_bytes"] == got["peak_bytes"]


def test_more_budget_never_more_time():
    rnd = random.Random(7)
    for _ in range(3):
        chain = random_chain(12, 2, rnd)
        least = _C.plan_min_budget(chain)
        times = [_C.plan_solve(chain, b, b)["time"] for b in range(least, 4 * least, max(1, least // 10))]
        assert all(t2 <= t1 * (1 + 1e-6) for t1, t2 in zip(times, times[1:]))
        assert times[-1] < times[0]


def test_identical_blocks_fast_path_equals_general_dp():
    rnd = random.Random(11)
    for L in (3, 9, 20):
        chain = random_chain(L, 2, rnd, identical=True)
        least = _C.plan_min_budget(chain)
        for b in (least, least * 3 // 2, 2 * least, 5 * least):
            fast = _C.plan_solve(chain, b, 400)
            general = _C.plan_solve(chain, b, 400, fast_path=False)
            assert fast["time"] == pytest.approx(general["time"], rel=1e-5)
            assert fast["peak_bytes"] <= b and general["peak_bytes"] <= b


@pytest.mark.parametrize("key,value,match", [
    ("fwd_time", [[-1.0, 1.0]] + [[1.0, 1.0]] * 3, "fwd_time"),
    ("bwd_time", [[float("nan"), 1.0]] + [[1.0, 1.0]] * 3, "bwd_time"),
    ("saved_bytes", [[-5, 1]] + [[1, 1]] * 3, "saved_bytes"),
    ("input_bytes", [1, 1, 1], "input_bytes"),
    ("bwd_time", [[1.0]] * 4, r"bwd_time'\]\[0\]"),
    ("fwd_time", [[1.0, 1.0]] * 5, "saved_bytes|input_bytes|bwd_time"),
    ("input_bytes", [1.5] * 5, "input_bytes"),
    ("mode_nestable", [2, 0], "mode_nestable"),
    ("fwd_time", "fast", "fwd_time"),
])
def test_malformed_costs_raise_value_error(key, value, match):
    chain = random_chain(4, 2, random.Random(0))
    chain[key] = value
    with pytest.raises(ValueError, match=match):
        _C.plan_solve(chain, 10**6, 100)


def test_bad_solver_arguments():
    chain = random_chain(4, 2, random.Random(0))
    with pytest.raises(ValueError, match="budget_bytes"):
        _C.plan_solve(chain, -1, 100)
    with pytest.raises(ValueError, match="slots"):
        _C.plan_solve(chain, 1000, 0)
    with pytest.raises(ValueError, match="regions"):
        _C.plan_simulate(chain, [0] * 4, [(0, 3), (2, 4)])
    with pytest.raises(ValueError, match="nested"):
        _C.plan_simulate(chain, [0, 1, 0, 0], [(0, 3)])
    with pytest.raises(TypeError, match="dict"):
        _C.plan_min_budget([1, 2])


def test_infeasible_budget_states_the_minimum():
    chain = random_chain(6, 2, random.Random(3))
    least = _C.plan_min_budget(chain)
    with pytest.raises(llmmem.InfeasibleError, match=f"smallest feasible budget is {least} bytes"):
        _C.plan_solve(chain, least - 1, 100)
    assert _C.plan_solve(chain, least, 100)["peak_bytes"] <= least
    assert issubclass(llmmem.InfeasibleError, ValueError)


def _small_gpt(layers=12, dropout=0.1):
    torch.manual_seed(0)
    cfg = GPTConfig(layers=layers, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=dropout)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    return model, idx


def test_profile_counts_each_storage_once_without_parameters():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(4, 16)
    prof = llmmem.profile_blocks([block], x, repeats=1, warmup=0)
    # ReLU keeps its output (4 x 32 float32) and the second Linear keeps the same tensor as its
    # input; the first Linear keeps the block input (not counted: it is input_bytes); weights are
    # parameters (not counted).
    assert prof.saved_bytes[0][0] == 4 * 32 * 4
    assert prof.input_bytes == [4 * 16 * 4, 4 * 16 * 4]
    assert all(t >= 0 for t in prof.fwd_time[0] + prof.bwd_time[0])
    with pytest.raises(ValueError, match="modes"):
        llmmem.profile_blocks([block], x, modes=("selective",))
    with pytest.raises(TypeError, match="blocks"):
        llmmem.profile_blocks([lambda t: t], x)


@pytest.fixture(scope="module")
def gpt_profile():
    model, idx = _small_gpt()
    x0 = model.embed(idx).detach()
    return model, idx, x0, llmmem.profile_blocks(model.blocks, x0, repeats=1, warmup=0)


def test_plan_is_honest_on_a_12_layer_gpt(gpt_profile):
    """Bytes really held for backward (whole forward, measured) stay under the budget and within
    10% of the prediction; gradients stay bitwise identical to running without checkpointing."""
    model, idx, x0, prof = gpt_profile
    params = list(model.parameters()) + list(model.buffers())
    ref_model = copy.deepcopy(model)
    torch.manual_seed(42)
    x_ref = x0.clone().requires_grad_()
    y = x_ref
    for b in ref_model.blocks:
        y = b(y)
    y.square().sum().backward()
    ref_grads = [p.grad for p in ref_model.blocks.parameters()] + [x_ref.grad]

    plain = llmmem.plan_checkpoints(None, budget=1.0, profile=prof)
    budgets = {"100%": 1.0, "50%": 0.5, "25%": 0.25, "minimum": plain.min_budget_bytes}
    seen_regions = []
    for name, budget in budgets.items():
        plan = llmmem.plan_checkpoints(None, budget=budget, profile=prof)
        runner = AutoCheckpointed(list(model.blocks), plan)
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.manual_seed(42)
        with measure_saved_bytes(exclude=params) as measured:
            y = runner(x)
        assert measured.bytes <= plan.budget_bytes, name
        assert abs(measured.bytes - plan.predicted_held_bytes) <= 0.10 * plan.predicted_held_bytes, name
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        y.square().sum().backward()
        grads = [p.grad for p in model.blocks.parameters()] + [x.grad]
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), name
        seen_regions.append(plan.regions)
    assert seen_regions[-1], "the minimum budget must checkpoint something"
    assert plan.min_budget_bytes < 0.5 * plain.no_checkpoint_peak_bytes


def test_plan_object_describe_and_infeasible_message(gpt_profile):
    _, _, _, prof = gpt_profile
    plan = llmmem.plan_checkpoints(None, budget=0.3, profile=prof)
    text = plan.describe()
    assert "predicted peak" in text and "budget" in text and str(len(plan.modes) - 1) in text
    assert plan.predicted_peak_bytes <= plan.budget_bytes == int(0.3 * plan.no_checkpoint_peak_bytes)
    with pytest.raises(llmmem.InfeasibleError) as info:
        llmmem.plan_checkpoints(None, budget=plan.min_budget_bytes - 1, profile=prof)
    assert f"{plan.min_budget_bytes} bytes" in str(info.value)
    assert info.value.min_budget_bytes == plan.min_budget_bytes
    assert isinstance(info.value, ValueError)
    as_string = llmmem.plan_checkpoints(None, budget=f"{plan.min_budget_bytes * 2}B", profile=prof)
    assert as_string.budget_bytes == 2 * plan.min_budget_bytes
    for bad in (True, 1.5, 0.0, "lots", -3):
        with pytest.raises(ValueError, match="budget"):
            llmmem.plan_checkpoints(None, budget=bad, profile=prof)


def test_auto_checkpoint_drops_into_a_model_loop():
    model, idx = _small_gpt(layers=4)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    x0 = model.embed(idx).detach()
    model.blocks = llmmem.auto_checkpoint(model.blocks, x0, budget=0.4)
    assert list(model.state_dict()) == keys and len(model.blocks) == 4
    assert model.blocks.plan.predicted_peak_bytes <= model.blocks.plan.budget_bytes
    for m in (model, ref):
        torch.manual_seed(9)
        _, loss = m(idx, idx)
        loss.backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_checkpoint_sequential_auto_segments():
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(6)])
    x = torch.randn(8, 16, requires_grad=True)
    y = llmmem.checkpoint_sequential(seq, "auto", x, budget=0.5)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    seq(x).sum().backward()
    assert torch.allclose(g, x.grad)
    with pytest.raises(ValueError, match="budget"):
        llmmem.checkpoint_sequential(seq, "auto", x)


def _mixed_chain():
    torch.manual_seed(1)
    widths = [24, 48, 16, 64, 32, 40, 24]
    blocks = [nn.Sequential(nn.Linear(24, w), nn.GELU(), nn.Dropout(0.1), nn.Linear(w, 24), nn.Tanh()) for w in widths]
    return blocks, torch.randn(6, 24)


@pytest.mark.parametrize("fraction", [0.6, 0.4])
def test_heterogeneous_chain_plan_is_honest(fraction):
    """Blocks of different widths: the general DP (no fast path) end to end."""
    blocks, x0 = _mixed_chain()
    prof = llmmem.profile_blocks(blocks, x0, repeats=1, warmup=0)
    assert len({tuple(s) for s in prof.saved_bytes}) > 1  # really heterogeneous
    plan = llmmem.plan_checkpoints(None, budget=fraction, profile=prof)
    assert plan.regions  # something had to be checkpointed
    runner = AutoCheckpointed(blocks, plan)
    params = [p for b in blocks for p in b.parameters()]
    x = x0.clone().requires_grad_()
    torch.manual_seed(5)
    with measure_saved_bytes(exclude=params) as measured:
        y = runner(x)
    assert measured.bytes <= plan.budget_bytes
    assert abs(measured.bytes - plan.predicted_held_bytes) <= 0.10 * plan.predicted_held_bytes
    y.sum().backward()
    got = [p.grad.clone() for p in params] + [x.grad.clone()]
    for p in params:
        p.grad = None
    x2 = x0.clone().requires_grad_()
    torch.manual_seed(5)
    t = x2
    for b in blocks:
        t = b(t)
    t.sum().backward()
    ref = [p.grad for p in params] + [x2.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.cuda
def test_plan_is_honest_on_cuda():
    model, idx = _small_gpt(layers=6)
    model, idx = model.cuda(), idx.cuda()
    x0 = model.embed(idx).detach()
    prof = llmmem.profile_blocks(model.blocks, x0, repeats=1, warmup=0)
    exclude = list(model.parameters()) + list(model.buffers())
    for fraction in (1.0, 0.5, 0.25):
        plan = llmmem.plan_checkpoints(None, budget=fraction, profile=prof)
        runner = AutoCheckpointed(list(model.blocks), plan)
        with measure_saved_bytes(exclude=exclude) as measured:
            y = runner(x0.clone().requires_grad_())
        assert measured.bytes <= plan.budget_bytes
        assert abs(measured.bytes - plan.predicted_held_bytes) <= 0.10 * plan.predicted_held_bytes
        y.sum().backward()


def test_oversized_problems_are_refused_not_run_for_minutes():
    rnd = random.Random(2)
    chain = random_chain(1000, 2, rnd)
    least = _C.plan_min_budget(chain)
    with pytest.raises(ValueError, match="DP steps"):
        _C.plan_solve(chain, 2 * least, 2000)
