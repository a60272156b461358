"""find_batch_size on real steps: the answer is the true largest batch (the step at that batch fits
the budget, at one more it does not), measured the way the finder measures (live tensor bytes of the
process), on memory that grows linearly, quadratically and in steps; no trial ever has more than the
budget live; a handful of trials."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from support.diagnostics import gpt_step, hf_model, hf_step, tiny_gpt

import llmmem
from llmmem.diagnostics.batch_size import MAX_TRIALS
from llmmem.diagnostics.live import LiveBytes
from llmmem.diagnostics.tracker import MemoryTracker


def _peak(step, batch: int) -> int:
    gc.collect()
    with MemoryTracker(timeline=False, stacks=False, existing="gc") as tracker:
        step(batch)
    return tracker.peak_bytes()


def _gpt_step():
    model, opt = tiny_gpt()
    gpt_step(model, opt, 1)  # the optimizer state exists before the search: every step is alike
    return lambda b: gpt_step(model, opt, b)


@pytest.mark.parametrize("target", [3, 10, 24])
def test_returns_the_true_largest_batch_in_a_few_trials(target):
    step = _gpt_step()
    below, above = _peak(step, target), _peak(step, target + 1)
    assert below < above
    budget = (below + above) // 2
    search = llmmem.find_batch_size(step, budget=budget, details=True)
    assert search.batch == target and search.exact, search.describe()
    assert len(search.trials) <= 7, search.describe()
    assert _peak(step, search.batch) <= budget < _peak(step, search.batch + 1)
    assert llmmem.find_batch_size(step, budget=budget) == target  # the plain form returns the int


def test_state_made_by_the_first_trial_is_counted_in():
    """No warm-up: the first trial makes the optimizer state, which every later step carries."""

    def probe_budget() -> int:  # a twin of the model, measured and gone before the search
        step = _gpt_step()
        return (_peak(step, 12) + _peak(step, 13)) // 2

    budget = probe_budget()
    model, opt = tiny_gpt()

    def step(b):
        gpt_step(model, opt, b)

    search = llmmem.find_batch_size(step, budget=budget, details=True)
    assert len(search.trials) <= 8, search.describe()
    assert _peak(step, search.batch) <= budget < _peak(step, search.batch + 1), search.describe()
    assert search.batch == 12


def test_high_bounds_the_search():
    step = _gpt_step()
    search = llmmem.find_batch_size(step, low=2, high=6, budget="1GiB", details=True)
    assert search.batch == 6 and len(search.trials) <= 3
    assert llmmem.find_batch_size(step, low=3, high=3, budget="1GiB") == 3


def test_low_that_does_not_fit_is_a_clear_error():
    step = _gpt_step()
    with pytest.raises(llmmem.InfeasibleError, match="even batch 4 does not fit"):
        llmmem.find_batch_size(step, low=4, budget=_peak(step, 4) - 1)


def test_out_of_memory_errors_in_trials_are_caught_and_released():
    """A step that runs out of memory above batch 7 (as a device would): the search never crashes,
    returns a batch that ran, and leaves no memory behind."""
    model, opt = tiny_gpt()
    gpt_step(model, opt, 1)

    def step(b):
        idx = torch.randint(0, 256, (b, 64))
        logits, loss = model(idx, targets=idx)
        if b > 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    gc.collect()
    with MemoryTracker(timeline=False, existing="gc") as tracker:
        before = sum(tracker.current().values())
        search = llmmem.find_batch_size(step, budget="1GiB", details=True)
        gc.collect()
        after = sum(tracker.current().values())
    assert search.batch == 7 and search.exact and len(search.trials) <= MAX_TRIALS
    assert any(t["error"] for t in search.trials)
    assert after == before  # the failed trials' activations were freed
    assert all(p.grad is None for p in model.parameters())


def test_hugging_face_llama():
    model = hf_model("llama")
    opt = torch.optim.AdamW(model.parameters())
    hf_step(model, opt, 1)

    def step(b):
        hf_step(model, opt, b)

    below, above = _peak(step, 9), _peak(step, 10)
    assert llmmem.find_batch_size(step, budget=(below + above) // 2) == 9


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("step",), {}, TypeError, "step"),
        ((print,), dict(low=0), ValueError, "low"),
        ((print,), dict(low=True), ValueError, "low"),
        ((print,), dict(low=4, high=2), ValueError, "high"),
        ((print,), dict(budget="lots"), ValueError, "budget"),
        ((print,), dict(budget=0), ValueError, "budget"),
        ((print,), dict(device="tpu"), ValueError, "device"),
        ((print,), dict(details="yes"), TypeError, "details"),
    ],
)
def test_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        llmmem.find_batch_size(*args, **kwargs)


def test_a_step_whose_memory_does_not_grow_needs_high():
    with pytest.raises(ValueError, match="high="):
        llmmem.find_batch_size(lambda b: torch.ones(1000), budget="1MiB")


# -------------------------------------------------------------------------------------------------
# the shapes of memory a step can have, against a reference search on the measured peaks
# -------------------------------------------------------------------------------------------------
def _live_peak(step, b: int) -> int:
    gc.collect()
    with LiveBytes(existing="gc") as live:
        step(b)
    return live.max_allocated("cpu")


def _true_largest(step, budget: int) -> int:
    """The largest batch whose measured peak fits: doubling, then bisection, on the peaks alone (the
    peak of these steps does not fall as the batch grows), no model."""
    lo, hi = 1, 2
    while _live_peak(step, hi) <= budget:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _live_peak(step, mid) <= budget else (lo, mid)
    return lo


def _search_under_a_counter(step, budget: int, **kwargs):
    """The search, and the most bytes an independent counter saw live while it ran (the counter is
    entered first, so it sits below the trials' own cap and counts only what was really made)."""
    gc.collect()
    with LiveBytes(existing="gc") as outside:
        search = llmmem.find_batch_size(step, budget=budget, details=True, **kwargs)
    return search, outside.max_allocated("cpu")


def _mlp_step():
    """A small MLP and AdamW, in the common order: zero_grad(set_to_none=True) first, so every step
    frees the previous step's gradients and makes them again."""
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(mlp.parameters())

    def step(b):
        opt.zero_grad(set_to_none=True)
        mlp(torch.randn(b, 256, 512)).square().mean().backward()
        opt.step()

    return step


def _attention_step(n: int, d: int = 16):
    """Attention over n tokens: the scores are n x n, so memory grows with n squared."""
    q, k, v = (torch.randn(n, d, requires_grad=True) for _ in range(3))
    p = torch.softmax(q @ k.T / math.sqrt(d), dim=-1)
    (p @ v).sum().backward()


def _padded_step(b: int):
    """A batch padded up to a multiple of 8: memory grows in steps."""
    x = torch.randn(8 * math.ceil(b / 8), 4096, requires_grad=True)
    (x * 2).sum().backward()


@pytest.mark.parametrize("budget", ["64MiB", "128MiB"])
def test_a_step_beginning_with_zero_grad_set_to_none(budget):
    """Its first call makes the gradients and the optimizer state that every later call frees in
    part and makes again: the first trial's peak is not one of the line's points."""
    budget = llmmem.parse_bytes(budget)
    step = _mlp_step()
    search, most = _search_under_a_counter(step, budget)
    assert most <= budget, search.describe()
    assert search.exact and search.batch == _true_largest(step, budget), search.describe()
    assert len(search.trials) <= 7, search.describe()


def test_memory_that_grows_with_the_square():
    budget = 22 * 2**20
    largest = _true_largest(_attention_step, budget)
    for low in (1, 8):  # 8: the line through 8 and 16 (as in the report) asks for many times the answer
        search, most = _search_under_a_counter(_attention_step, budget, low=low)
        assert most <= budget, search.describe()  # the line through the small trials asks for far more
        assert any(not t["fits"] and t["batch"] > 2 * search.batch for t in search.trials)  # and was stopped
        assert search.exact and search.batch == largest, search.describe()
        assert len(search.trials) <= 8, search.describe()


@pytest.mark.parametrize("budget", [3 * 2**20, 10 * 2**20])
def test_memory_that_grows_in_steps(budget):
    search, most = _search_under_a_counter(_padded_step, budget)
    assert most <= budget, search.describe()
    assert search.exact and search.batch == _true_largest(_padded_step, budget), search.describe()
    # measured: 11 trials at 3 MiB, 16 at 10 MiB (the model undershoots a staircase: it climbs the
    # last steps from below, about halving the gap each trial)
    assert search.batch % 8 == 0 and len(search.trials) <= 16, search.describe()


@pytest.mark.cuda
def test_cuda_trials_stay_under_the_budget_and_the_answer_is_checked_both_ways():
    """On CUDA the trial's cap is the caching allocator's per-process fraction, restored afterwards."""
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.AdamW(mlp.parameters())

    def step(b):
        opt.zero_grad(set_to_none=True)
        mlp(torch.randn(b, 256, 1024, device="cuda")).square().mean().backward()
        opt.step()

    def reserved_peak(b):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step(b)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_reserved()

    step(1)
    fraction = torch.cuda.get_per_process_memory_fraction(0)
    budget = reserved_peak(1) + 256 * 2**20
    search = llmmem.find_batch_size(step, budget=budget, device="cuda", details=True)
    assert torch.cuda.get_per_process_memory_fraction(0) == fraction
    assert all(t["peak"] is None or t["peak"] <= budget for t in search.trials), search.describe()
    assert search.exact and reserved_peak(search.batch) <= budget < reserved_peak(search.batch + 1), search.describe()
