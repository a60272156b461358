"""AllocationCap: an operator that would take the live CPU bytes past the cap is refused before it
allocates (an independent counter below it never sees more than the cap), the sizing is exact (a
cap of the step's own peak lets it run), and what runs under it computes exactly what runs without."""

from __future__ import annotations

import gc

import pytest
import torch
from support.diagnostics import gpt_step, tiny_gpt

import llmmem
from llmmem.diagnostics.cap import AllocationCap
from llmmem.diagnostics.live import LiveBytes


def _capped(limit, fn, *args):
    """Runs ``fn`` under a cap of ``limit`` live bytes (or ``limit(bytes live before)``); returns
    (result or the error, cap, the most bytes an outside counter saw live, the bytes live before)."""
    gc.collect()
    outside = LiveBytes(existing="gc")  # below the cap: sees only what the cap let through
    with outside:
        before = outside.allocated("cpu")
        limit = limit(before) if callable(limit) else limit
        live = LiveBytes(existing="gc")
        cap = AllocationCap(limit, lambda: live.allocated("cpu"))
        try:
            with cap, live:
                result = fn(*args)
        except llmmem.OutOfMemoryError as exc:
            result = exc
    return result, cap, outside.max_allocated("cpu"), before


def test_a_cap_of_the_steps_own_peak_lets_it_run_one_byte_less_refuses_before_allocating():
    model, opt = tiny_gpt()
    gpt_step(model, opt, 4)  # the optimizer state exists: every step is alike
    gc.collect()
    with LiveBytes(existing="gc") as probe:
        start = probe.allocated("cpu")
        gpt_step(model, opt, 4)
    # the step's own bytes above what lived before it: tensors other tests left may be freed between
    # the probe and the capped runs (the process's, counted with existing="gc")
    rise = probe.max_allocated("cpu") - start
    result, cap, seen, before = _capped(lambda before: before + rise, gpt_step, model, opt, 4)
    assert not isinstance(result, Exception) and cap.refused is None
    assert seen - before == rise
    result, cap, seen, before = _capped(lambda before: before + rise - 1, gpt_step, model, opt, 4)
    assert isinstance(result, llmmem.OutOfMemoryError) and "allocation cap" in str(result)
    live, request, _ = cap.refused
    assert live + request > before + rise - 1 and seen <= before + rise - 1
    assert cap.unchecked == 0  # every operator of a GPT step is sized before it runs


def test_a_huge_request_is_refused_without_being_made():
    result, cap, seen, before = _capped(lambda live: live + 2**20, lambda: torch.empty(2**40, dtype=torch.uint8))
    assert isinstance(result, llmmem.OutOfMemoryError)  # 1 TiB asked for, nothing made
    assert cap.refused[1] == 2**40 and seen == before
    a = torch.ones(1000)
    # 1000 x 1000 floats from two vectors: refused before the 4 MB exist
    result, cap, seen, before = _capped(lambda live: live + 2**20, torch.outer, a, a)
    assert isinstance(result, llmmem.OutOfMemoryError) and cap.refused[1] == 4 * 10**6 and seen == before


def test_views_and_in_place_operators_request_nothing_and_out_growth_is_sized():
    x = torch.zeros(256, 256)

    def views_and_in_place():
        x.t().add_(1)
        return x.view(-1)[:10].mul_(2)

    result, cap, seen, before = _capped(lambda live: live, views_and_in_place)  # not one byte to spare
    assert not isinstance(result, Exception) and seen == before and cap.unchecked == 0
    result, cap, seen, before = _capped(lambda live: live + 1000, lambda: torch.add(x, 1, out=torch.empty(0)))
    assert isinstance(result, llmmem.OutOfMemoryError) and cap.refused[1] == x.nbytes and seen == before


def test_data_dependent_outputs_are_checked_after_and_counted():
    x = torch.arange(1000) % 3 == 0
    result, cap, _, _ = _capped(10**9, torch.nonzero, x)
    assert torch.equal(result, torch.nonzero(x))
    assert cap.unchecked == 1 and cap.unchecked_bytes == result.untyped_storage().nbytes()


def test_results_and_random_numbers_are_those_of_an_uncapped_run():
    model, opt = tiny_gpt()  # dropout 0.1: draws random numbers in every step
    twin, twin_opt = tiny_gpt()
    for _ in range(2):
        torch.manual_seed(1)
        gpt_step(model, opt, 2)
        torch.manual_seed(1)
        _capped(10**10, gpt_step, twin, twin_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [(dict(limit=0, live=lambda: 0), ValueError, "limit"), (dict(limit=10, live=3), TypeError, "live")],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        AllocationCap(**kwargs)
