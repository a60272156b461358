"""find_batch_size on real models: at most four trials, and the answer is the true largest batch
(the step at that batch fits the budget, at one more it does not), measured the way the finder
measures (live tensor bytes of the process)."""

from __future__ import annotations

import gc

import pytest
import torch
from support.diagnostics import gpt_step, hf_model, hf_step, tiny_gpt

import llmmem
from llmmem.diagnostics.batch_size import MAX_TRIALS
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
def test_returns_the_true_largest_batch_in_at_most_four_trials(target):
    step = _gpt_step()
    below, above = _peak(step, target), _peak(step, target + 1)
    assert below < above
    budget = (below + above) // 2
    search = llmmem.find_batch_size(step, budget=budget, details=True)
    assert search.batch == target, search.describe()
    assert len(search.trials) <= MAX_TRIALS
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
    assert len(search.trials) <= MAX_TRIALS
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
    assert 1 <= search.batch <= 7 and len(search.trials) <= MAX_TRIALS
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
