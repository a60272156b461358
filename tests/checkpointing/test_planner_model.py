"""auto_checkpoint on a whole model: blocks found and wrapped in place, any call signature, regions
spanning blocks the model calls one by one, the budget on the measured peak, undo, and misuse."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.planner import grads, lm_batch, same_grads, step_memory, tiny_llama

import llmmem
from llmmem import _C
from llmmem.checkpointing import AutoCheckpointed, AutoCheckpointPlan
from llmmem.checkpointing.inplace import ChainRunner
from llmmem.models.gpt import GPT, GPTConfig


class KwBlock(nn.Module):
    """Called as ``block(x, bias, mask=..., scale=0.5, use_cache=True, cache=...)``: a positional
    parameter of the model, a tensor keyword, a float, a flag and a cache; returns ``(x, aux)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, bias, *, mask, scale=1.0, use_cache=False, cache=None):
        if use_cache and cache is not None:
            cache.append(x.detach())  # a recompute must not write here a second time
        h = self.fc2(self.drop(F.gelu(self.fc1(self.norm(x) * mask))))
        return x + scale * h + bias, h.mean()


class KwModel(nn.Module):
    def __init__(self, d: int = 32, n: int = 8, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(KwBlock(d) for _ in range(n))
        self.bias = nn.Parameter(torch.zeros(d))
        self.head = nn.Linear(d, vocab)
        self.transform = False  # feed each block something else than the previous output
        self.cache = None

    def forward(self, idx, upto=None):
        x = self.embed(idx)
        mask = (idx > 0).float().unsqueeze(-1)
        for layer in self.layers[: upto or len(self.layers)]:
            x, _ = layer(x, self.bias, mask=mask, scale=0.5, use_cache=True, cache=self.cache)
            if self.transform:
                x = x * 1.0
        return F.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())


def _kw_model():
    torch.manual_seed(0)
    return KwModel().train(), torch.randint(0, 64, (4, 24))


def _seeded(fn, seed=7):
    def step():
        torch.manual_seed(seed)
        fn()

    return step


def _check_plan(model, plan, step, ref_grads):
    """Gradients bitwise those of no checkpointing, measured peak within the budget, held bytes
    within 5% of the prediction."""
    peak, held = step_memory(model, step)
    assert same_grads(grads(model), ref_grads)
    assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)
    assert abs(held - plan.predicted_held_bytes) <= 0.05 * plan.predicted_held_bytes, (held, plan.predicted_held_bytes)
    return peak, held


def test_gpt_in_place_keeps_the_model_as_it_was():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=8, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.1)).train()
    idx = torch.randint(0, 64, (2, 32))
    ref = copy.deepcopy(model)
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    block_type = type(model.blocks[0])

    def step_of(m):
        return _seeded(lambda: m(idx, idx)[1].backward())

    step_memory(ref, step_of(ref))
    ref_grads = grads(ref)
    plan = llmmem.auto_checkpoint(model, budget=0.4, sample=(idx, idx))
    assert isinstance(plan, AutoCheckpointPlan) and plan.active and plan.blocks_name == "blocks"
    assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == names
    assert type(model.blocks[0]) is block_type and isinstance(model.blocks, nn.ModuleList)
    _check_plan(model, plan, step_of(model), ref_grads)
    text = plan.describe()
    for needle in ("budget", "predicted peak", "held after forward", "recompute time", "blocks", "kept (plan)"):
        assert needle in text
    recomputed = sum(1 for i in range(len(model.blocks)) if plan.plan.depth(i))
    assert f"{recomputed} of {len(model.blocks)} blocks recomputed in {len(plan.regions)} region(s)" in text
    assert text.count("recomputed ") >= recomputed  # each such row says so, alone or in its region
    assert str(plan) == text and "AutoCheckpointPlan" in repr(plan)
    assert llmmem.AutoCheckpointPlan is AutoCheckpointPlan and llmmem.CheckpointPlan is type(plan.plan)
    model.to(torch.float32)  # .to() keeps working (the plan holds no tensors)
    plan.remove()
    assert not plan.active and "removed" in repr(plan)
    assert all("forward" not in b.__dict__ and "_llmmem_chain" not in b.__dict__ for b in model.blocks)
    step_memory(model, step_of(model))
    assert same_grads(grads(model), ref_grads)
    plan.remove()  # idempotent


def test_any_signature_and_regions_spanning_blocks():
    """Positional parameter, tensor keyword, float and flag arguments, a cache, tuple outputs; at the
    least feasible budget the plan nests regions over several blocks, each called separately."""
    model, idx = _kw_model()
    ref = copy.deepcopy(model)
    step_memory(ref, _seeded(lambda: ref(idx).backward()))
    ref_grads = grads(ref)
    step = _seeded(lambda: model(idx).backward())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache keywords
        plan = llmmem.auto_checkpoint(model, budget=0.5, sample=lambda: model(idx).backward())
        assert plan.profile.chainable and plan.profile.hidden == [0] * 8
        _check_plan(model, plan, step, ref_grads)
        least = plan.min_budget_bytes
        plan.remove()
        plan = llmmem.auto_checkpoint(model, budget=least, sample=lambda: model(idx).backward())
        assert any(e - s >= 2 for s, e in plan.regions), plan.regions
        _check_plan(model, plan, step, ref_grads)
        model.cache = []
        model(idx).backward()
        assert model.cache == []  # while gradients are on, planned blocks get no cache
        with torch.no_grad():
            model(idx)
        assert len(model.cache) == 8  # generation: blocks run as they are
        model.cache = None
    plan.remove()


def test_a_model_that_changes_the_input_between_blocks():
    """The profile sees it: regions hold one block each (store-input-only), and the budget holds."""
    model, idx = _kw_model()
    model.transform = True
    ref = copy.deepcopy(model)
    step_memory(ref, _seeded(lambda: ref(idx).backward()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = llmmem.auto_checkpoint(model, budget=0.35, sample=lambda: model(idx).backward())
        assert not plan.profile.chainable
        assert plan.regions == [] and "store-input-only" in plan.modes
        text = plan.describe()
        assert "regions hold one block each" in text
        alone = plan.modes.count("store-input-only")
        assert f"{alone} of {len(plan.modes)} blocks recomputed ({alone} alone)" in text
        assert text.count("recomputed alone") == alone and "store-input-only " not in text.split("\n", 2)[2]
        _check_plan(model, plan, _seeded(lambda: model(idx).backward()), grads(ref))
    plan.remove()


def test_chain_broken_after_planning_stays_exact():
    """A plan with regions over several blocks, then the model starts changing the input between
    blocks: a warning, blocks checkpointed one by one, gradients still exact."""
    model, idx = _kw_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        least = llmmem.auto_checkpoint(model, budget=1.0, sample=lambda: model(idx).backward())
        budget = least.min_budget_bytes
        least.remove()
        plan = llmmem.auto_checkpoint(model, budget=budget, sample=lambda: model(idx).backward())
    assert any(e - s >= 2 for s, e in plan.regions)
    model.transform = True
    ref = copy.deepcopy(model)
    plan_ref = ref.layers[0].__dict__["_llmmem_chain"][0]  # deepcopy: the copy runs its own plan
    assert plan_ref is not plan.runner
    plan_ref.remove()
    step_memory(ref, _seeded(lambda: ref(idx).backward()))
    with pytest.warns(UserWarning, match="one by one"):
        step_memory(model, _seeded(lambda: model(idx).backward()))
    assert same_grads(grads(model), grads(ref))
    plan.remove()


def test_the_model_runs_part_of_the_chain():
    """The loop slices the block list (``self.layers[:n]``): the pass ends early, the next starts over."""
    model, idx = _kw_model()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = llmmem.auto_checkpoint(model, budget=0.4, sample=lambda: model(idx).backward())
        for upto in (3, 8, 5):
            step_memory(ref, _seeded(lambda: ref(idx, upto).backward()))
            step_memory(model, _seeded(lambda: model(idx, upto).backward()))
            assert same_grads(grads(model), grads(ref)), upto
    plan.remove()


def test_sample_forms_and_the_same_plan_every_time():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.1)).train()
    idx = torch.randint(0, 64, (2, 32))
    plans = []
    for sample in (
        (idx, idx),
        {"idx": idx, "targets": idx},
        lambda: model(idx, idx)[1].backward(),
        (idx, idx),
    ):
        plan = llmmem.auto_checkpoint(model, budget=0.5, sample=sample)
        plans.append((plan.modes, plan.regions, plan.predicted_peak_bytes, plan.predicted_held_bytes))
        plan.remove()
    assert all(p == plans[0] for p in plans), plans
    # a tensor: model(idx) returns (logits, None), the loss is the logits' sum (another head)
    plan = llmmem.auto_checkpoint(model, idx, budget=0.5)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    plan.remove()


def test_replanning_from_a_profile_and_the_chain_form_still_works():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0)).train()
    idx = torch.randint(0, 64, (2, 32))
    plan = llmmem.auto_checkpoint(model, budget=0.6, sample=(idx, idx))
    profile = plan.profile
    plan.remove()
    tighter = llmmem.auto_checkpoint(model, budget=0.3, profile=profile)
    assert tighter.budget_bytes < plan.budget_bytes and tighter.predicted_peak_bytes <= tighter.budget_bytes
    tighter.remove()
    x0 = model.embed(idx).detach()
    chain = llmmem.auto_checkpoint(model.blocks, x0, budget=0.5)
    assert isinstance(chain, AutoCheckpointed) and len(chain) == 6


def test_misuse_is_a_clear_error():
    model, idx = _kw_model()
    sample = lambda: model(idx).backward()  # noqa: E731
    with pytest.raises(TypeError, match="profile must be a ChainProfile"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=sample, profile="x")
    with pytest.raises(TypeError, match="profile must be a ChainProfile"):
        llmmem.auto_checkpoint(model.layers, idx, profile="x")
    with pytest.raises(TypeError, match="profile must be a ChainProfile"):
        llmmem.plan_checkpoints(None, profile="x")
    with pytest.raises(ValueError, match="not a submodule"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=sample, blocks="nope")
    with pytest.raises(ValueError, match="expected a non-empty nn.ModuleList"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=sample, blocks="head")
    with pytest.raises(ValueError, match="not a submodule"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=sample, blocks=[nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="blocks must be"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=sample, blocks=3)
    with pytest.raises(TypeError, match="sample= is needed"):
        llmmem.auto_checkpoint(model, budget=0.5)
    with pytest.raises(TypeError, match="sample: expected a batch"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=3)
    with pytest.raises(TypeError, match="unexpected keyword"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=sample, context_fn=None)
    with pytest.raises(ValueError, match="repeats"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=sample, repeats=-1)
    with pytest.raises(ValueError, match="found no nn.ModuleList"):
        llmmem.auto_checkpoint(nn.Linear(4, 4), budget=0.5, sample=torch.randn(2, 4))
    with pytest.raises(ValueError, match="budget"):
        llmmem.auto_checkpoint(model, budget=1.5, sample=sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(llmmem.InfeasibleError, match="smallest feasible budget") as info:
            llmmem.auto_checkpoint(model, budget=1000, sample=sample)
        assert info.value.min_budget_bytes > 1000
        assert all("forward" not in b.__dict__ for b in model.layers)  # nothing left behind
        with llmmem.auto_checkpoint(model, budget=0.5, sample=sample, repeats=0) as plan:
            with pytest.raises(ValueError, match="already runs a plan"):
                llmmem.auto_checkpoint(model, budget=0.5, sample=sample)
        assert not plan.active


def test_overhead_is_predicted_as_a_fraction_of_the_whole_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0)).train()
    idx = torch.randint(0, 64, (2, 32))
    plan = llmmem.auto_checkpoint(model, budget=0.3, sample=(idx, idx), repeats=2)
    p = plan.profile
    # the embeddings, head and loss ran as work outside the blocks; the step adds them to the blocks' time
    assert p.outside_work > 0 and p.measured_step_time > 0 and p.outside_time > 0
    assert plan.predicted_step_time == pytest.approx(p.measured_step_time + p.outside_time)
    assert plan.predicted_overhead == pytest.approx(plan.predicted_overhead_time / plan.predicted_step_time)
    assert plan.regions and plan.predicted_overhead > 0
    assert "ms step: blocks" in plan.describe() and "from its work" in plan.describe()
    plan.remove()
    untimed = llmmem.auto_checkpoint(model, budget=0.3, sample=(idx, idx), repeats=0)
    assert untimed.predicted_step_time == 0 and math.isnan(untimed.predicted_overhead)
    # counted work only: no figure passes for seconds
    assert math.isnan(untimed.profile.time_unit) and math.isnan(untimed.predicted_overhead_time)
    assert math.isnan(untimed.predicted_time) and untimed.predicted_overhead_work > 0
    text = untimed.describe()
    assert "ms" not in text and "Gwork" in text and "work units" in text and "not timed (repeats=0)" in text
    untimed.remove()
    with pytest.raises(ValueError, match="offload=True needs timed blocks"):
        llmmem.plan_checkpoints(None, budget=0.3, profile=untimed.profile, offload=True)


def test_overhead_prices_work_and_python_bookkeeping():
    """What checkpointing and recompute-cheap add is their counted work at the blocks' store-all
    forward seconds per work unit, plus their Python timed apart (a checkpoint's on a null block,
    recompute-cheap's hooks less the operators they run): the blocks' own timings in those modes,
    which swing between runs, do not move it. Without those timings (an accelerator's profile) a
    mode keeps its timed cost."""
    import copy

    from llmmem._native import native

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0)).train()
    idx = torch.randint(0, 64, (2, 32))
    plan = llmmem.auto_checkpoint(model, budget=0.3, sample=(idx, idx), repeats=2)
    plan.remove()
    p = plan.profile
    assert plan.regions
    books = p.seconds["bookkeeping"]
    assert len(books) == p.n_blocks
    for book in books:
        assert book["checkpoint"] > 0
        pack, unpack, operators = book["recompute-cheap"]
        assert pack > 0 and unpack > 0 and operators > 0  # the GPT block rebuilds its GELU output

    # by hand: regions at work + the null block's bookkeeping, recompute-cheap at store-all's
    # seconds + its extra work + its hooks' Python
    chain = p.to_chain(seconds=True)
    unit, k = p.time_unit, p.modes.index("recompute-cheap")
    for i, book in enumerate(books):
        chain["fwd_nostore_time"][i] = p.fwd_nostore_time[i] * unit + book["checkpoint"]
        pack, unpack, operators = book["recompute-cheap"]
        extra = [max(0.0, getattr(p, key)[i][k] - getattr(p, key)[i][0]) * unit for key in ("fwd_time", "bwd_time")]
        chain["fwd_time"][i][k] = p.seconds["fwd_time"][i][0] + extra[0] + pack
        chain["bwd_time"][i][k] = p.seconds["bwd_time"][i][0] + extra[1] + max(0.0, unpack - operators)
    modes = [p.modes.index(m) for m in plan.modes] + [0]  # the head keeps its tape
    expected = native.plan_simulate(chain, modes, [tuple(r) for r in plan.regions])["overhead_time"]
    assert plan.predicted_overhead_time == pytest.approx(expected) and expected > 0
    assert plan.predicted_time == pytest.approx(p.measured_step_time + plan.predicted_overhead_time)

    def replanned(budget, change):
        first = llmmem.plan_checkpoints(None, budget=budget, profile=p)
        other = copy.deepcopy(p)
        change(other)
        again = llmmem.plan_checkpoints(None, budget=budget, profile=other)
        assert (again.modes, again.regions) == (first.modes, first.regions)  # chosen on work
        return first.predicted_overhead_time, again.predicted_overhead_time

    def slower_modes(q):  # every mode but store-all, and the checkpointed forward, three times slower
        q.seconds["fwd_nostore_time"] = [3 * t for t in q.seconds["fwd_nostore_time"]]
        for key in ("fwd_time", "bwd_time"):
            q.seconds[key] = [[row[0]] + [3 * t for t in row[1:]] for row in q.seconds[key]]

    # at 50% this model has recompute-cheap blocks outside any region
    first = llmmem.plan_checkpoints(None, budget=0.5, profile=p)
    assert any(m == "recompute-cheap" and first.depth(i) == 0 for i, m in enumerate(first.modes))
    for budget in (plan.budget_bytes, 0.5):
        before, after = replanned(budget, slower_modes)
        assert after == pytest.approx(before)

    def dearer_bookkeeping(q):
        q.seconds["bookkeeping"] = [
            {"checkpoint": b["checkpoint"] + 1e-3, "recompute-cheap": b["recompute-cheap"]} for b in books
        ]

    before, after = replanned(plan.budget_bytes, dearer_bookkeeping)
    # each block of a region pays it at least once (a nested one more often)
    inside = {i for s, e in plan.regions for i in range(s, e)}
    assert after >= before + 1e-3 * len(inside) * (1 - 1e-9)

    def untimed_python(q):  # an accelerator's profile: no Python timed apart
        q.seconds["bookkeeping"] = [{} for _ in books]
        slower_modes(q)

    before, after = replanned(0.5, untimed_python)
    assert after > 1.5 * before


def test_timed_modes_are_ratios_to_store_all_within_a_round(monkeypatch):
    """A round slowed down as a whole (load on a shared machine) moves the store-all median, not the
    other modes' ratios to it."""
    from llmmem.checkpointing import costs as block_costs
    from llmmem.checkpointing.calls import BlockCall
    from llmmem.checkpointing.modes import MODES

    block = nn.Linear(4, 4)
    call = BlockCall((torch.randn(2, 4),))
    # store-all 1 s + 2 s, the other modes twice that, in every round; round 2 three times slower
    t = {"now": 0.0}
    costs = {"store-all": (1.0, 2.0), "selective": (2.0, 4.0), "recompute-cheap": (2.0, 4.0), "nostore": (2.0, 4.0)}
    order = [m for _ in range(4) for m in ("store-all", "selective", "recompute-cheap", "nostore")]
    slow = [1, 1, 3, 1]  # warm-up round, then three timed rounds, the middle one slowed down
    phases = iter([(m, part, slow[i // 4]) for i, m in enumerate(order) for part in (0, 1)])

    def fake_perf_counter():
        return t["now"]

    real_run_call = block_costs.run_call

    def timed_run_call(fn, args, kwargs, mode, block=None, **options):
        out = real_run_call(fn, args, kwargs, "store-all", block)
        m, part, factor = next(phases)
        assert m == mode and part == 0
        t["now"] += costs[mode][0] * factor
        return out

    real_backward = torch.autograd.backward

    def timed_backward(*a, **k):
        real_backward(*a, **k)
        m, part, factor = next(phases)
        assert part == 1
        t["now"] += costs[m][1] * factor

    monkeypatch.setattr(block_costs.time, "perf_counter", fake_perf_counter)
    monkeypatch.setattr(block_costs, "run_call", timed_run_call)
    monkeypatch.setattr(block_costs.torch.autograd, "backward", timed_backward)
    out = block_costs._timed_steps(block, block, call, MODES, repeats=3, warmup=1, device=torch.device("cpu"))
    assert out["store-all"] == pytest.approx((1.0, 2.0))
    for m in ("selective", "recompute-cheap", "nostore"):
        assert out[m] == pytest.approx((2.0, 4.0))


def test_least_budget_is_not_above_checkpointing_every_block():
    """``min_budget_bytes`` is the least feasible budget: checkpointing every block with
    llmmem.checkpoint (a plan the planner could choose) must not peak below it."""
    import functools

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.1)).train()
    idx = torch.randint(0, 64, (2, 32))
    plan = llmmem.auto_checkpoint(model, budget=1.0, sample=(idx, idx), repeats=0)
    least = plan.min_budget_bytes
    plan.remove()
    for b in model.blocks:
        b.forward = functools.partial(llmmem.checkpoint, type(b).forward.__get__(b))
    try:
        peak, _ = step_memory(model, lambda: model(idx, idx)[1].backward())
    finally:
        for b in model.blocks:
            del b.forward
    assert least <= peak, (least, peak)


def _small_gpt_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.1)).train()
    idx = torch.randint(0, 64, (2, 32))
    return model, model.blocks, (idx, idx), lambda: model(idx, idx)[1].backward()


def _tiny_llama_step():
    model = tiny_llama("sdpa", layers=4)  # skips without transformers
    batch = lm_batch()
    return model, model.model.layers, batch, lambda: model(**batch).loss.backward()


@pytest.mark.filterwarnings("ignore:llmmem.auto_checkpoint. caching is incompatible")  # the Llama's cache
@pytest.mark.parametrize("build", [_small_gpt_step, _tiny_llama_step], ids=["gpt", "llama"])
def test_every_block_and_least_budget_plans_match_the_measured_peak(build):
    """Where the forward transients decide the peak: checkpointing every block (each region's
    forward runs without a tape, each recompute keeps one) is predicted within 2% of its measured
    peak, and the plan at the least feasible budget never peaks above that budget."""
    model, blocks, sample, step = build()
    plan = llmmem.auto_checkpoint(model, budget=1.0, sample=sample, repeats=0)
    prof, least = plan.profile, plan.min_budget_bytes
    plan.remove()
    L = prof.n_blocks
    chain = prof.to_chain()
    every = [(i, i + 1) for i in range(L)]
    sim = _C.plan_simulate(chain, [0] * len(chain["fwd_time"]), every)
    predicted = max(sim["peak_bytes"] + prof.static_bytes, prof.outside_peak_bytes)
    # run as auto_checkpoint runs any plan (a cache is never written by a recompute)
    runner = ChainRunner(
        blocks, dataclasses.replace(plan.plan, modes=["store-all"] * L, regions=every), prof.hidden, {}
    )
    runner.install()
    try:
        measured, _ = step_memory(model, step)
    finally:
        runner.remove()
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    at_least = llmmem.auto_checkpoint(model, budget=least, profile=prof)
    try:
        peak, _ = step_memory(model, step)
    finally:
        at_least.remove()
    assert at_least.predicted_peak_bytes <= least
    assert peak <= least, (peak, least)


def test_hand_made_profiles_send_one_forward_transient():
    """A ChainProfile built by hand (without the per-forward transients) sends none of them: the
    planner charges fwd_tmp_bytes to every forward, as before they existed; given, they go with the
    head's own figure appended."""
    from llmmem.checkpointing.profile import ChainProfile

    L = 3
    prof = ChainProfile(
        modes=("store-all", "selective"),
        fwd_time=[[1.0, 1.2]] * L,
        fwd_nostore_time=[1.0] * L,
        bwd_time=[[2.0, 2.5]] * L,
        input_bytes=[100] * (L + 1),
        saved_bytes=[[400, 150]] * L,
        fwd_tmp_bytes=[60] * L,
        bwd_tmp_bytes=[[50, 90]] * L,
        head={"saved_bytes": 30, "fwd_tmp_bytes": 20, "bwd_tmp_bytes": 10},
    )
    chain = prof.to_chain()
    assert chain["fwd_nostore_tmp_bytes"] is None and chain["fwd_tape_tmp_bytes"] is None
    least = llmmem.plan_checkpoints(None, budget=10**6, profile=prof).min_budget_bytes
    prof.fwd_nostore_tmp_bytes = [60] * L
    prof.fwd_tape_tmp_bytes = [[60, 60]] * L
    chain = prof.to_chain()
    assert chain["fwd_nostore_tmp_bytes"] == [60] * L + [20]
    assert chain["fwd_tape_tmp_bytes"] == [[60, 60]] * L + [[20, 20]]
    assert llmmem.plan_checkpoints(None, budget=10**6, profile=prof).min_budget_bytes == least
    prof.fwd_nostore_tmp_bytes = [600] * L  # a region's forward now needs more than any tape's
    assert llmmem.plan_checkpoints(None, budget=10**6, profile=prof).min_budget_bytes > least


def test_planner_warnings_point_at_the_model_code_not_at_llmmem():
    """The use_cache warning of a planned block is reported at the call of the model (here, in this
    file), not inside llmmem or torch's module call."""
    model, idx = _kw_model()
    plan = llmmem.auto_checkpoint(model, budget=1.0, sample=lambda: model(idx).backward())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(idx).backward()
    plan.remove()
    cache = [w for w in caught if "caching is incompatible" in str(w.message)]
    assert cache and all(w.filename == __file__ for w in cache)


def test_the_use_cache_warning_points_at_the_users_call_not_the_models_loop():
    """A Hugging Face model calls its layers from its own file: the warning names the line that
    called the model, where use_cache=False can be passed."""
    model = tiny_llama("sdpa", layers=2)  # skips without transformers
    batch = lm_batch(seq=16)
    plan = llmmem.auto_checkpoint(model, budget=1.0, sample=batch, repeats=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**batch).loss.backward()
    finally:
        plan.remove()
    cache = [w for w in caught if "caching is incompatible" in str(w.message)]
    assert [w.filename for w in cache] == [__file__]


def test_an_infeasible_budget_and_the_least_feasible_one_read_differently():
    """Bytes below the least feasible budget: both sizes get the decimals that tell them apart."""
    from llmmem.checkpointing.profile import ChainProfile

    mib = 2**20
    prof = ChainProfile(
        modes=("store-all",),
        fwd_time=[[1.0]] * 3,
        fwd_nostore_time=[1.0] * 3,
        bwd_time=[[2.0]] * 3,
        input_bytes=[3 * mib] * 4,
        saved_bytes=[[9 * mib]] * 3,
        fwd_tmp_bytes=[mib] * 3,
        bwd_tmp_bytes=[[mib]] * 3,
    )
    least = llmmem.plan_checkpoints(None, budget=10**9, profile=prof).min_budget_bytes
    with pytest.raises(llmmem.InfeasibleError) as info:
        llmmem.plan_checkpoints(None, budget=least - 1000, profile=prof)
    shown = re.findall(r"bytes \(([0-9.]+) MiB\)", str(info.value))
    assert len(shown) == 2 and shown[0] != shown[1] and float(shown[0]) < float(shown[1]), str(info.value)


def test_auto_checkpoint_errors_name_auto_checkpoint():
    """The user called auto_checkpoint: its budget errors say so (they come from plan_checkpoints),
    and an infeasible one still carries the least budget."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=3, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0)).train()
    idx = torch.randint(0, 64, (2, 32))
    with pytest.raises(llmmem.InfeasibleError, match=r"^auto_checkpoint: no plan fits") as info:
        llmmem.auto_checkpoint(model, budget=0.01, sample=(idx, idx), repeats=0)
    assert info.value.min_budget_bytes > 0
    with pytest.raises(ValueError, match=r"^auto_checkpoint: budget") as info:
        llmmem.auto_checkpoint(model, budget="lots", sample=(idx, idx), repeats=0)
    assert info.traceback[-1].path.name == "plan.py"  # where it was raised, still
    assert all("_llmmem_chain" not in b.__dict__ for b in model.blocks)  # nothing left installed
    x = torch.randn(2, 32, 32)
    with pytest.raises(ValueError, match=r"^auto_checkpoint: budget"):
        llmmem.auto_checkpoint(model.blocks, x, budget="lots")  # the bare-chain form too


def test_a_short_bookkeeping_list_prices_the_other_blocks_without_it():
    """A profile made by hand may time the Python of some blocks only: the others are priced by
    work alone, not by their own timings in checkpointed form."""
    import copy

    from llmmem.checkpointing.plan import _price_by_work

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0)).train()
    idx = torch.randint(0, 64, (2, 32))
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=(idx, idx), repeats=1)
    plan.remove()
    p = copy.deepcopy(plan.profile)
    p.seconds["bookkeeping"] = p.seconds["bookkeeping"][:1]
    chain = p.to_chain(seconds=True)
    _price_by_work(chain, p)
    for i in range(1, p.n_blocks):
        assert chain["fwd_nostore_time"][i] == pytest.approx(p.fwd_nostore_time[i] * p.time_unit)
