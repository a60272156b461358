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
from llmmem.checkpointing import AutoCheckpointed, measure_saved_bytes
from llmmem.models.gpt import GPT, GPTConfig
from llmmem.units import format_bytes


def random_chain(L, K, rnd, identical=False):
    def block():
        fn = rnd.uniform(1, 5)
        full = rnd.randint(4, 16)
        return dict(
            f=[fn + 0.3 * k for k in range(K)],
            fn=fn,
            b=[2 * fn + k * rnd.uniform(0.5, 2) for k in range(K)],
            s=[full if k == 0 else full // (k + 1) for k in range(K)],
            ft=rnd.randint(0, 2),
            bt=[rnd.randint(0, 2) for _ in range(K)],
        )

    blocks = [block()] * L if identical else [block() for _ in range(L)]
    xs = [rnd.randint(1, 4)] * (L + 1) if identical else [rnd.randint(1, 4) for _ in range(L + 1)]
    return {
        "fwd_time": [b["f"] for b in blocks],
        "fwd_nostore_time": [b["fn"] for b in blocks],
        "bwd_time": [b["b"] for b in blocks],
        "input_bytes": xs,
        "saved_bytes": [b["s"] for b in blocks],
        "fwd_tmp_bytes": [b["ft"] for b in blocks],
        "bwd_tmp_bytes": [b["bt"] for b in blocks],
        "mode_nestable": [1] + [0] * (K - 1),
    }


def all_plans(L, K, nestable, offloadable=(), kept=None, cuts=None):
    """Every plan: properly nested regions (no region twice, none across a cut: ``cuts[i]`` set
    where block i's input is not block i - 1's output) and a mode per block; a top-level
    region starting at a block in ``offloadable`` comes both plain and offloaded ((s, q, 1)),
    unless the item before it is a top-level tape that keeps its output (``kept[i][k]``).

    Yields (modes, regions) tuples. The plans of each proper sub-segment are listed once and
    reused (millions of plans at L = 8: a generator per plan would take most of the time)."""
    memo = {}

    def first_items(s, e, nested, body, pinned):
        """(modes, regions, next start, whether the next input is kept alive, inner plans) for each
        choice of the item starting at s."""
        for k in range(K):
            if not (nested and not nestable[k]):
                yield (k,), (), s + 1, bool(kept and kept[s][k]), [((), ())]
        for q in range(s + 1, e + 1):
            if body and q == e:
                continue
            if cuts and any(cuts[s + 1 : q]):
                break
            inner = listed(s, q, True, True, False)
            kinds = ((s, q), (s, q, 1)) if not nested and not pinned and s in offloadable else ((s, q),)
            for region in kinds:
                yield (), (region,), q, False, inner

    def listed(s, e, nested, body, pinned):
        key = (s, e, nested, body, pinned)
        if key not in memo:
            memo[key] = list(sequences(s, e, nested, body, pinned))
        return memo[key]

    def sequences(s, e, nested, body, pinned=False):
        if s == e:
            yield (), ()
            return
        for modes, regions, q, next_pinned, inner in first_items(s, e, nested, body, pinned):
            rest = listed(q, e, nested, False, next_pinned and not nested)
            for inner_modes, inner_regions in inner:
                head_modes, head_regions = modes + inner_modes, regions + inner_regions
                for rest_modes, rest_regions in rest:
                    yield head_modes + rest_modes, head_regions + rest_regions

    yield from sequences(0, L, False, False)


def with_offload(chain, rnd):
    """Offloading on: a copy costs about a block's forward (more or less), and about one (block, mode)
    tape in four keeps the block's output (so the next input cannot be offloaded after it)."""
    L, K = len(chain["fwd_time"]), len(chain["fwd_time"][0])
    chain["host_bandwidth"] = rnd.choice([0.5, 1.0, 4.0])
    chain["output_kept"] = [[int(rnd.random() < 0.25) for _ in range(K)] for _ in range(L)]
    return set(range(1, L))


def brute_force(chain, budgets, offloadable=()):
    """(least time among the plans that fit each budget, least peak of all plans, plans seen)."""
    L, K = len(chain["fwd_time"]), len(chain["fwd_time"][0])
    best = dict.fromkeys(budgets, math.inf)
    least_peak, n_plans = math.inf, 0
    simulate = _C.plan_simulate
    plans = all_plans(L, K, chain["mode_nestable"], offloadable, chain.get("output_kept"), chain.get("cut_before"))
    for modes, regions in plans:
        n_plans += 1
        sim = simulate(chain, modes, regions)
        peak, t = sim["peak_bytes"], sim["time"]
        least_peak = min(least_peak, peak)
        for b in budgets:
            if peak <= b and t < best[b]:
                best[b] = t
    return best, least_peak, n_plans


def check_against_brute_force(chain, rnd, offloadable=(), expect_plans=None):
    least = _C.plan_min_budget(chain)
    budgets = sorted({least, least + rnd.randint(0, least), least + rnd.randint(0, 2 * least), 10 * least})
    best, least_peak, n_plans = brute_force(chain, budgets, offloadable)
    assert least == least_peak
    if expect_plans is not None:
        assert n_plans == expect_plans  # exhaustive
    offloaded = 0
    for b in budgets:
        got = _C.plan_solve(chain, b, b)  # one byte per slot: no rounding
        assert got["peak_bytes"] <= b
        assert got["time"] == pytest.approx(best[b], rel=1e-5)
        regions = [r + (1,) if r in got["offloaded"] else r for r in map(tuple, got["regions"])]
        again = _C.plan_simulate(chain, got["modes"], regions)
        assert again["time"] == pytest.approx(got["time"]) and again["peak_bytes"] == got["peak_bytes"]
        offloaded += len(got["offloaded"])
    return offloaded


def test_dp_is_optimal_against_brute_force():
    rnd = random.Random(4)
    for trial in range(8):
        L, K = (6, 2) if trial == 0 else (5, 2) if trial < 3 else (rnd.randint(1, 4), rnd.randint(1, 3))
        chain = random_chain(L, K, rnd)
        check_against_brute_force(chain, rnd, expect_plans={(6, 2): 35581, (5, 2): 4155}.get((L, K)))


def test_dp_with_offload_is_optimal_against_brute_force():
    """Offloaded regions are one more choice per top-level region: still optimal over every plan."""
    rnd = random.Random(21)
    offloaded = 0
    for trial in range(10):
        L, K = (6, 2) if trial == 0 else (5, 2) if trial < 3 else (rnd.randint(2, 5), rnd.randint(1, 3))
        chain = random_chain(L, K, rnd, identical=trial % 3 == 1)
        offloadable = with_offload(chain, rnd)
        offloaded += check_against_brute_force(chain, rnd, offloadable)
    assert offloaded > 0  # the optimum did use the option somewhere


def test_dp_with_own_forward_transients_is_optimal_against_brute_force():
    """A region's no-store forward and each mode's tape forward with transients of their own (above
    or below the one figure): the DP and the least budget still agree with every plan simulated."""
    rnd = random.Random(15)
    for trial in range(6):
        L, K = (5, 2) if trial < 2 else (rnd.randint(2, 4), rnd.randint(1, 3))
        chain = random_chain(L, K, rnd, identical=trial % 3 == 2)
        same = [rnd.randint(0, 9)] * L, [[rnd.randint(0, 6) for _ in range(K)]] * L
        chain["fwd_nostore_tmp_bytes"] = same[0] if trial % 3 == 2 else [rnd.randint(0, 9) for _ in range(L)]
        chain["fwd_tape_tmp_bytes"] = (
            same[1] if trial % 3 == 2 else [[rnd.randint(0, 6) for _ in range(K)] for _ in range(L)]
        )
        check_against_brute_force(chain, rnd)


def test_dp_with_cuts_is_optimal_against_brute_force():
    """Cuts (a second stack of blocks starts: the model changes the chain's input there) bound the
    regions: the DP, the least budget and the simulator agree with every plan that spans none, with
    and without offloading; a plan across a cut and a malformed cut are refused."""
    rnd = random.Random(33)
    seen_cut_regions = 0
    for trial in range(10):
        L, K = (6, 2) if trial < 2 else (rnd.randint(2, 5), rnd.randint(1, 3))
        chain = random_chain(L, K, rnd, identical=trial % 4 == 3)
        chain["cut_before"] = [0] + [int(rnd.random() < 0.35) for _ in range(L - 1)]
        if trial < 2:
            chain["cut_before"] = [0, 0, 0, 1, 0, 0]  # two stacks of three
        offloadable = with_offload(chain, rnd) if trial % 2 else ()
        check_against_brute_force(chain, rnd, offloadable)
        cuts = [i for i, c in enumerate(chain["cut_before"]) if c]
        for b in (_C.plan_min_budget(chain), 10**6):
            for start, end in _C.plan_solve(chain, b, min(b, 10000))["regions"]:
                assert not any(start < c < end for c in cuts)
                seen_cut_regions += end - start > 1
        without = dict(chain, cut_before=[0] * L)
        assert _C.plan_min_budget(without) <= _C.plan_min_budget(chain)  # cuts only take plans away
    assert seen_cut_regions > 0
    chain = random_chain(4, 1, rnd)
    chain["cut_before"] = [0, 0, 1, 0]
    with pytest.raises(ValueError, match=r"region \[1, 3\) spans a cut: block 2's input"):
        _C.plan_simulate(chain, [0] * 4, [(1, 3)])
    _C.plan_simulate(chain, [0] * 4, [(0, 2), (2, 4)])
    for bad, match in (([0, 2, 0, 0], r"cut_before'\]\[1\] must be 0 or 1"), ([0, 1], "cut_before")):
        with pytest.raises(ValueError, match=match):
            _C.plan_solve(dict(chain, cut_before=bad), 10**6, 100)


def test_forward_transients_absent_mean_the_one_figure():
    """Without the two optional keys every forward of a block is charged fwd_tmp_bytes, as before
    they existed: the same least budget and plans as giving that figure under both keys."""
    rnd = random.Random(5)
    for _ in range(4):
        chain = random_chain(6, 2, rnd)
        spelled = dict(chain)
        spelled["fwd_nostore_tmp_bytes"] = list(chain["fwd_tmp_bytes"])
        spelled["fwd_tape_tmp_bytes"] = [[t] * 2 for t in chain["fwd_tmp_bytes"]]
        assert _C.plan_min_budget(spelled) == _C.plan_min_budget(chain)
        for b in (_C.plan_min_budget(chain), 3 * _C.plan_min_budget(chain)):
            assert _C.plan_solve(spelled, b, b) == _C.plan_solve(chain, b, b)


@pytest.mark.slow
def test_dp_is_optimal_against_brute_force_7_and_8_blocks():
    """L = 7 and 8, exhaustively, with fewer modes so that it takes seconds (the C test does L <= 6
    under the sanitizers): L = 7 with 2 modes (321291 plans), L = 7 with 1 mode and offloading
    (every region start offloadable: 418454 plans), L = 8 with 1 mode (2190848 plans)."""
    rnd = random.Random(78)
    check_against_brute_force(random_chain(7, 2, rnd), rnd, expect_plans=321291)
    chain = random_chain(7, 1, rnd)
    chain["host_bandwidth"] = 1.0
    check_against_brute_force(chain, rnd, offloadable=set(range(1, 7)), expect_plans=418454)
    check_against_brute_force(random_chain(8, 1, rnd), rnd, expect_plans=2190848)


def test_more_budget_never_more_time():
    rnd = random.Random(7)
    for _ in range(3):
        chain = random_chain(12, 2, rnd)
        least = _C.plan_min_budget(chain)
        times = [_C.plan_solve(chain, b, b)["time"] for b in range(least, 4 * least, max(1, least // 10))]
        assert all(t2 <= t1 * (1 + 1e-6) for t1, t2 in zip(times, times[1:]))
        assert times[-1] < times[0]


def test_offload_lowers_the_least_budget_and_time_stays_monotone():
    rnd = random.Random(31)
    lowered = 0
    for trial in range(4):
        chain = random_chain(10, 2, rnd, identical=trial % 2 == 0)
        without = _C.plan_min_budget(chain)
        with_offload(chain, rnd)
        chain["output_kept"] = [[0, 0]] * 10
        least = _C.plan_min_budget(chain)
        assert least <= without
        lowered += least < without
        with pytest.raises(llmmem.InfeasibleError, match=f"smallest feasible budget is {least} bytes"):
            _C.plan_solve(chain, least - 1, 100)
        times = []
        for b in range(least, 4 * without, max(1, least // 10)):
            got = _C.plan_solve(chain, b, b)
            assert got["peak_bytes"] <= b
            assert 0 <= got["transfer_time"] <= got["overhead_time"] + 1e-9
            assert (got["host_bytes"] > 0) == bool(got["offloaded"])
            times.append(got["time"])
        assert all(t2 <= t1 * (1 + 1e-6) for t1, t2 in zip(times, times[1:]))
        # far above the least budget nothing is worth a transfer
        assert _C.plan_solve(chain, 10 * without, 1000)["offloaded"] == []
    assert lowered > 0


def test_offload_is_refused_where_the_model_does_not_allow_it():
    chain = random_chain(5, 1, random.Random(5))
    with pytest.raises(ValueError, match="host_bandwidth"):
        _C.plan_simulate(chain, [0] * 5, [(1, 2, 1)])  # offloading is off in this chain
    chain["host_bandwidth"] = 1.0
    assert _C.plan_simulate(chain, [0] * 5, [(1, 2, 1)])["host_bytes"] == chain["input_bytes"][1]
    with pytest.raises(ValueError, match="chain input"):
        _C.plan_simulate(chain, [0] * 5, [(0, 2, 1)])
    with pytest.raises(ValueError, match="top-level"):
        _C.plan_simulate(chain, [0] * 5, [(1, 4), (2, 3, 1)])
    chain["output_kept"] = [[0], [1], [0], [0], [0]]
    with pytest.raises(ValueError, match="output_kept"):  # block 1 as a tape keeps a_2 alive
        _C.plan_simulate(chain, [0] * 5, [(2, 3, 1)])
    assert _C.plan_simulate(chain, [0] * 5, [(1, 2), (2, 3, 1)])["host_bytes"] > 0  # inside a region it does not
    for key, value in (
        ("host_bandwidth", -1.0),
        ("host_bandwidth", float("inf")),
        ("host_bandwidth", "fast"),
        ("output_kept", [[0], [2], [0], [0], [0]]),
        ("output_kept", [[0], [0]]),
    ):
        bad = dict(chain, **{key: value})
        with pytest.raises(ValueError, match=key):
            _C.plan_solve(bad, 10**6, 100)


def test_identical_blocks_fast_path_equals_general_dp():
    rnd = random.Random(11)
    for trial in range(24):
        L = (3, 9, 20, 33)[trial % 4] + rnd.randint(0, 3)
        chain = random_chain(L, 1 + trial % 3, rnd, identical=True)
        least = _C.plan_min_budget(chain)
        full = _C.plan_simulate(chain, [0] * L, [])["peak_bytes"]
        slots = rnd.choice((50, 400, 1500))
        for b in sorted({least, least * 3 // 2, 2 * least, 5 * least, rnd.randint(least, max(least, full))}):
            fast = _C.plan_solve(chain, b, slots)
            general = _C.plan_solve(chain, b, slots, fast_path=False)
            assert fast["time"] == pytest.approx(general["time"], rel=1e-5), (trial, L, b, slots)
            assert fast["peak_bytes"] <= b and general["peak_bytes"] <= b


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("fwd_time", [[-1.0, 1.0]] + [[1.0, 1.0]] * 3, "fwd_time"),
        ("bwd_time", [[float("nan"), 1.0]] + [[1.0, 1.0]] * 3, "bwd_time"),
        ("saved_bytes", [[-5, 1]] + [[1, 1]] * 3, "saved_bytes"),
        ("input_bytes", [1, 1, 1], "input_bytes"),
        ("bwd_time", [[1.0]] * 4, r"bwd_time'\]\[0\]"),
        ("fwd_time", [[1.0, 1.0]] * 5, "saved_bytes|input_bytes|bwd_time"),
        ("input_bytes", [1.5] * 5, "input_bytes"),
        ("mode_nestable", [2, 0], "mode_nestable"),
        ("fwd_time", "fast", "fwd_time"),
        ("fwd_nostore_tmp_bytes", [1, 1, 1], "fwd_nostore_tmp_bytes"),
        ("fwd_nostore_tmp_bytes", [1, 1, 1, 2**51], "fwd_nostore_tmp_bytes"),
        ("fwd_tape_tmp_bytes", [[1]] * 4, r"fwd_tape_tmp_bytes'\]\[0\]"),
        ("fwd_tape_tmp_bytes", [[1, 1]] * 3 + [[1, -1]], "fwd_tape_tmp_bytes"),
    ],
)
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
    assert info.value.no_checkpoint_peak_bytes == plan.no_checkpoint_peak_bytes
    assert isinstance(info.value, ValueError)
    as_string = llmmem.plan_checkpoints(None, budget=f"{plan.min_budget_bytes * 2}B", profile=prof)
    assert as_string.budget_bytes == 2 * plan.min_budget_bytes
    for bad in (True, 1.5, 0.0, "lots", -3):
        with pytest.raises(ValueError, match="budget"):
            llmmem.plan_checkpoints(None, budget=bad, profile=prof)


def _every_layer_peak(prof):
    chain = prof.to_chain()
    return _C.plan_simulate(chain, [0] * prof.n_blocks, [(i, i + 1) for i in range(prof.n_blocks)])["peak_bytes"]


def test_offload_plan_fits_below_the_every_layer_minimum(gpt_profile, monkeypatch):
    """With offload=True the least budget drops below torch's every-layer checkpointing; the plan
    at that budget offloads, says so in describe(), and runs with the gradients of no checkpointing.
    On the CPU the "device" is host memory, so what is checked is where the bytes are accounted:
    everything kept (device + host) is within 10% of the predicted held + host bytes."""
    from llmmem import checkpointing

    model, idx, x0, prof = gpt_profile
    plain = llmmem.plan_checkpoints(None, budget=1.0, profile=prof)
    least = llmmem.plan_checkpoints(None, budget=1.0, profile=prof, offload=True).min_budget_bytes
    assert least < plain.min_budget_bytes < _every_layer_peak(prof)
    with pytest.warns(UserWarning, match="offload=True on the CPU") as caught:
        plan = llmmem.plan_checkpoints(None, budget=least, profile=prof, offload=True)
    assert plan.offloaded and set(plan.offloaded) <= set(plan.regions)
    assert all(s >= 1 for s, _ in plan.offloaded)
    # the warning gives the same plan's peak with its inputs kept where they are: above the budget
    modes = [prof.modes.index(m) for m in plan.modes] + ([0] if prof.head is not None else [])
    here = _C.plan_simulate(prof.to_chain(), modes, plan.regions)["peak_bytes"] + plan.static_bytes
    assert here > plan.predicted_peak_bytes
    assert f"on the CPU it peaks at about {format_bytes(here)}" in str(caught[0].message)
    assert caught[0].filename == __file__  # the caller's line, not llmmem's
    assert plan.predicted_peak_bytes <= plan.budget_bytes == least
    assert plan.host_bandwidth == llmmem.checkpointing.plan.DEFAULT_HOST_BANDWIDTH and not plan.host_bandwidth_measured
    assert plan.predicted_host_bytes == sum(prof.input_bytes[s] for s, _ in plan.offloaded)
    assert 0 < plan.predicted_transfer_time <= plan.predicted_overhead_time
    text = plan.describe()
    assert "offloaded to host" in text and "input on host" in text and "assumed, not measured" in text

    made = []
    original_init = checkpointing.offload.HostCopies.__init__

    def counting_init(self):
        original_init(self)
        made.append(self.previous)

    monkeypatch.setattr(checkpointing.offload.HostCopies, "__init__", counting_init)
    params = list(model.parameters()) + list(model.buffers())
    ref_model = copy.deepcopy(model)
    torch.manual_seed(42)
    x_ref = x0.clone().requires_grad_()
    y = x_ref
    for b in ref_model.blocks:
        y = b(y)
    y.square().sum().backward()
    ref_grads = [p.grad for p in ref_model.blocks.parameters()] + [x_ref.grad]

    runner = AutoCheckpointed(list(model.blocks), plan)
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    torch.manual_seed(42)
    with measure_saved_bytes(exclude=params) as measured:
        y = runner(x)
    expected = plan.predicted_held_bytes + plan.predicted_host_bytes
    assert abs(measured.bytes - expected) <= 0.10 * expected
    # one host-copy set per offloaded region, none chained for prefetch (the model has none)
    assert len(made) == len(plan.offloaded) and all(prev is None for prev in made)
    y.square().sum().backward()
    grads = [p.grad for p in model.blocks.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


@pytest.mark.filterwarnings("ignore:llmmem. offload=True on the CPU")
def test_offload_arguments_and_bandwidth(gpt_profile):
    _, _, _, prof = gpt_profile
    for kwargs, match in (
        ({"offload": "yes"}, "offload"),
        ({"offload": True, "host_bandwidth": 0}, "host_bandwidth"),
        ({"offload": True, "host_bandwidth": float("nan")}, "host_bandwidth"),
        ({"offload": True, "host_bandwidth": True}, "host_bandwidth"),
        ({"host_bandwidth": 1e9}, "host_bandwidth"),
    ):
        with pytest.raises(ValueError, match=match):
            llmmem.plan_checkpoints(None, budget=0.5, profile=prof, **kwargs)
    plain_least = llmmem.plan_checkpoints(None, budget=1.0, profile=prof).min_budget_bytes
    # At one byte per second every copy costs hours: used only where nothing else fits. (10% above
    # the least budget without offloading: exactly at it, slot rounding can lose the plans that do
    # not offload, and the fallback is then the least-memory plan, which does.)
    slow = llmmem.plan_checkpoints(None, budget=int(1.1 * plain_least), profile=prof, offload=True, host_bandwidth=1.0)
    assert slow.offloaded == [] and slow.predicted_transfer_time == 0.0
    assert "offloaded to host     none" in slow.describe()
    least = llmmem.plan_checkpoints(None, budget=1.0, profile=prof, offload=True, host_bandwidth=1.0).min_budget_bytes
    forced = llmmem.plan_checkpoints(None, budget=least, profile=prof, offload=True, host_bandwidth=1.0)
    assert forced.offloaded and forced.predicted_transfer_time >= prof.input_bytes[1]  # seconds at 1 B/s
    with pytest.raises(llmmem.InfeasibleError, match="offload=True may lower it"):
        llmmem.plan_checkpoints(None, budget=least, profile=prof)


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


@pytest.mark.filterwarnings("ignore:llmmem. offload=True on the CPU")
def test_checkpoint_sequential_auto_budgets_and_offload():
    """segments='auto' takes every budget form, states the least budget when it cannot fit, and runs
    offload=True plans (same gradients, bitwise on the CPU). Here nested regions already reach the
    one-block floor, so offloading does not lower the least budget; it lowers the time near it
    (fewer nested recomputes)."""
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(12)])
    x = torch.randn(64, 16)
    prof = llmmem.profile_blocks(list(seq), x, repeats=1, warmup=0)
    plain_least = llmmem.plan_checkpoints(None, budget=1.0, profile=prof).min_budget_bytes
    offload_least = llmmem.plan_checkpoints(None, budget=1.0, profile=prof, offload=True).min_budget_bytes
    assert offload_least <= plain_least
    near = int(1.2 * plain_least)
    with_offload = llmmem.plan_checkpoints(None, budget=near, profile=prof, offload=True)
    without = llmmem.plan_checkpoints(None, budget=near, profile=prof)
    assert with_offload.predicted_work <= without.predicted_work * (1 + 1e-6)

    def grads(**options):
        seq.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        if options:
            y = llmmem.checkpoint_sequential(seq, "auto", xi, **options)
        else:
            y = seq(xi)
        y.square().sum().backward()
        return [p.grad for p in seq.parameters()] + [xi.grad]

    ref = grads()
    for options in (
        {"budget": f"{2 * plain_least}B"},
        {"budget": plain_least},
        {"budget": 0.4},
        {"budget": offload_least, "offload": True},
        {"budget": near, "offload": True},
        {"budget": offload_least, "offload": True, "host_bandwidth": 1e9},
    ):
        assert all(torch.equal(a, b) for a, b in zip(grads(**options), ref)), options
    with pytest.raises(llmmem.InfeasibleError, match=f"{offload_least} bytes"):
        llmmem.checkpoint_sequential(seq, "auto", x, budget=offload_least - 1, offload=True)
    with pytest.raises(llmmem.InfeasibleError, match="offload=True may lower it"):
        llmmem.checkpoint_sequential(seq, "auto", x, budget=offload_least - 1)
    with pytest.raises(ValueError, match="segments"):
        llmmem.checkpoint_sequential(seq, "best", x, budget=0.5)
    with pytest.raises(ValueError, match="budget"):
        llmmem.checkpoint_sequential(seq, 2, x, budget=0.5)


def _mixed_chain():
    torch.manual_seed(1)
    widths = [24, 48, 16, 64, 32, 40, 24]
    blocks = [nn.Sequential(nn.Linear(24, w), nn.GELU(), nn.Dropout(0.1), nn.Linear(w, 24), nn.Tanh()) for w in widths]
    return blocks, torch.randn(6, 24)


@pytest.mark.parametrize("position", [0.5, 0.0])
def test_heterogeneous_chain_plan_is_honest(position):
    """Blocks of different widths: the general DP (no fast path) end to end, halfway between the
    least feasible budget and no checkpointing, and at the least one."""
    blocks, x0 = _mixed_chain()
    prof = llmmem.profile_blocks(blocks, x0, repeats=1, warmup=0)
    assert len({tuple(s) for s in prof.saved_bytes}) > 1  # really heterogeneous
    plain = llmmem.plan_checkpoints(None, budget=1.0, profile=prof)
    least, full = plain.min_budget_bytes, plain.no_checkpoint_peak_bytes
    plan = llmmem.plan_checkpoints(None, budget=int(least + position * (full - least)), profile=prof)
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
def test_offload_plan_is_honest_on_cuda():
    """Below the every-layer minimum, on a GPU: device bytes kept for backward (measured) stay under
    the budget and within 10% of the prediction; the offloaded inputs are in host memory."""
    model, idx = _small_gpt(layers=8)
    model, idx = model.cuda(), idx.cuda()
    x0 = model.embed(idx).detach()
    prof = llmmem.profile_blocks(model.blocks, x0, repeats=1, warmup=0)
    least = llmmem.plan_checkpoints(None, budget=1.0, profile=prof, offload=True).min_budget_bytes
    assert least < _every_layer_peak(prof)
    plan = llmmem.plan_checkpoints(None, budget=least, profile=prof, offload=True)
    assert plan.offloaded and plan.host_bandwidth_measured
    exclude = list(model.parameters()) + list(model.buffers())
    with measure_saved_bytes(exclude=exclude) as measured:
        y = AutoCheckpointed(list(model.blocks), plan)(x0.clone().requires_grad_())
    on_device = sum(v for (dev, _), v in measured.storages.items() if dev.type == "cuda")
    on_host = sum(v for (dev, _), v in measured.storages.items() if dev.type == "cpu")
    assert on_device <= plan.budget_bytes
    assert abs(on_device - plan.predicted_held_bytes) <= 0.10 * plan.predicted_held_bytes
    assert abs(on_host - plan.predicted_host_bytes) <= 0.10 * plan.predicted_host_bytes
    y.sum().backward()


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
