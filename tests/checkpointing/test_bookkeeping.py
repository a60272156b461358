"""The Python bookkeeping of a checkpoint, timed on a null block for the planner's predictions."""

from __future__ import annotations

import torch

from llmmem.checkpointing import bookkeeping
from llmmem.checkpointing.bookkeeping import checkpoint_bookkeeping_seconds
from llmmem.checkpointing.calls import BlockCall


def _call(**kwargs):
    h = torch.randn(2, 4)
    mask = torch.ones(2, 4, requires_grad=True)
    return BlockCall((h, mask), dict(kwargs), hidden=0), mask


def test_positive_and_leaves_the_call_and_random_state_alone():
    # keyword arguments named like checkpoint options are the block's own, not options
    call, mask = _call(debug=True, use_reentrant=True, offload="no", scale=0.5)
    state = torch.get_rng_state()
    seconds = checkpoint_bookkeeping_seconds(call, saved=40, rounds=5)
    assert 0 < seconds < 1
    assert torch.equal(torch.get_rng_state(), state)
    assert mask.grad is None and not call.args[0].requires_grad


def test_hidden_by_keyword_and_no_saved_tensor():
    h = torch.randn(3)
    call = BlockCall((), {"hidden_states": h, "position": 4}, hidden="hidden_states")
    assert checkpoint_bookkeeping_seconds(call, saved=0, rounds=3) >= 0
    assert checkpoint_bookkeeping_seconds(call, saved=5, rounds=0) == 0.0


def test_not_measured_off_the_cpu():
    call = BlockCall((torch.empty(2, 4, device="meta"),))
    assert checkpoint_bookkeeping_seconds(call, saved=10) == 0.0


def test_many_saved_tensors_cost_a_line_through_two_null_blocks(monkeypatch):
    """Past MAX_NULL_SAVES the null block is not built that long (a block saving thousands of
    tensors would take seconds to mimic): the cost is drawn through one and the cap, and a noisy
    pair of timings (the longer one faster) gives a flat line, never a negative figure."""
    cap = bookkeeping.MAX_NULL_SAVES
    timings = {1: 1e-4 + 1e-5, cap: 1e-4 + 1e-5 * cap}
    asked = []

    def fake(call, saved, rounds):
        asked.append(saved)
        return timings.get(saved, 1e-4 + 1e-5 * saved)

    monkeypatch.setattr(bookkeeping, "_null_extra", fake)
    call, _ = _call()
    got = checkpoint_bookkeeping_seconds(call, saved=10 * cap)
    assert asked == [1, cap]
    assert abs(got - (1e-4 + 1e-5 * 10 * cap)) < 1e-12
    asked.clear()
    assert checkpoint_bookkeeping_seconds(call, saved=7) == fake(call, 7, 0)
    assert asked == [7, 7]
    timings[cap] = 0.5e-4  # noise: the long null block timed faster than the short one
    assert checkpoint_bookkeeping_seconds(call, saved=3000) == timings[1]


def test_null_block_never_longer_than_the_cap(monkeypatch):
    built = []
    real = bookkeeping._null_block

    def spy(saved, hidden):
        built.append(saved)
        return real(saved, hidden)

    monkeypatch.setattr(bookkeeping, "_null_block", spy)
    call, _ = _call()
    assert checkpoint_bookkeeping_seconds(call, saved=5000, rounds=2) >= 0
    assert built and max(built) == bookkeeping.MAX_NULL_SAVES
