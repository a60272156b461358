"""oom_report's model-state advice (issue 23, item 5): "switch to llmmem.optim.AdamW(state_dtype=
'int8')", "step_in_backward" and "bf16 weights with stochastic rounding", each with what it saves
counted from the optimizer found, offered only where it applies, and checked against what the
change really saves when applied."""

from __future__ import annotations

import pytest
import torch
from support.diagnostics import gpt_step, tiny_gpt

import llmmem
import llmmem.optim
from llmmem.diagnostics.advice import estimate_settings
from llmmem.diagnostics.tracker import MemoryTracker

STATE_KINDS = {"optimizer-state", "step_in_backward", "bf16-weights", "model-state"}


def _model(bf16: bool = False, **dims):
    model, _ = tiny_gpt(**({"layers": 4, "hidden": 128} | dims))
    return model.to(torch.bfloat16) if bf16 else model


def _steady(model, opt, batch: int, in_backward: bool = False):
    """(peak bytes of a second step, the tracker) with ``opt`` (stepped in backward if asked)."""
    handle = llmmem.optim.step_in_backward(model, opt) if in_backward else None
    try:
        gpt_step(model, opt, batch)
        with MemoryTracker(model, opt) as tracker:
            gpt_step(model, opt, batch)
    finally:
        if handle is not None:
            handle.remove()
    return tracker.peak_bytes(), tracker


def _suggestions(model, opt, batch: int, in_backward: bool = False) -> dict:
    """The report's suggestions by kind, from an out-of-memory error under a budget halfway between
    what stays between steps (parameters, optimizer state) and the step's peak."""
    peak, tracker = _steady(model, opt, batch, in_backward)
    resident = sum(tracker.current().values())
    handle = llmmem.optim.step_in_backward(model, opt) if in_backward else None
    try:
        with pytest.raises(llmmem.OutOfMemoryError) as info:
            with llmmem.oom_report(model, opt, budget=(resident + peak) // 2, plan=False):
                gpt_step(model, opt, batch)
    finally:
        if handle is not None:
            handle.remove()
    report = info.value.report
    for s in report.suggestions:
        if s.kind in STATE_KINDS:
            assert s.source == "optimizer" and s.predicted_peak == report.basis["predicted_peak"] - s.saves
    return {s.kind: s for s in report.suggestions}, str(info.value)


def _moments(opt) -> int:
    keys = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k in keys)


def test_torch_adamw_gets_all_three_and_int8_saves_what_llmmem_int8_really_saves():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    found, text = _suggestions(model, opt, 8)
    assert STATE_KINDS <= set(found), sorted(found)
    int8 = found["optimizer-state"]
    assert "llmmem.optim.AdamW(state_dtype='int8')" in int8.change and "state_dtype='int8'" in int8.code
    assert "switch to llmmem.optim.AdamW(state_dtype='int8')" in text
    # applied: the same model and step with llmmem's int8 moments
    twin = _model()
    twin.load_state_dict(model.state_dict())
    int8_opt = llmmem.optim.AdamW(twin.parameters(), lr=1e-3, state_dtype="int8")
    gpt_step(twin, int8_opt, 8)
    assert int8.saves == _moments(opt) - _moments(int8_opt)
    assert _moments(int8_opt) / sum(p.numel() for p in twin.parameters()) < 2.3  # ~2.03 B a quantized parameter
    fresh = _model()
    int8_peak, _ = _steady(fresh, llmmem.optim.AdamW(fresh.parameters(), state_dtype="int8"), 8)
    fresh = _model()
    torch_peak, _ = _steady(fresh, torch.optim.AdamW(fresh.parameters()), 8)
    print(f"int8 moments: predicted saving {int8.saves}, measured peak drop {torch_peak - int8_peak}")
    assert abs((torch_peak - int8_peak) - int8.saves) <= 0.01 * int8.saves
    # bf16 weights: the fp32 parameters and their gradients halve
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert found["bf16-weights"].saves == params  # half the parameters + half the gradients
    assert found["model-state"].saves > max(found[k].saves for k in STATE_KINDS - {"model-state"})


def test_step_in_backward_saves_the_gradients_where_the_model_state_makes_the_peak():
    # wide and short: the peak comes once every gradient exists (a fine-tune's shape)
    dims = {"layers": 2, "hidden": 256, "seq_len": 16}
    model = _model(**dims)
    opt = llmmem.optim.AdamW(model.parameters(), lr=1e-3)
    found, _ = _suggestions(model, opt, 1)
    sib = found["step_in_backward"]
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    assert sib.saves == sum(sizes) - max(sizes)
    fresh = _model(**dims)
    before, before_tracker = _steady(fresh, llmmem.optim.AdamW(fresh.parameters()), 1)
    fresh = _model(**dims)
    after, after_tracker = _steady(fresh, llmmem.optim.AdamW(fresh.parameters()), 1, in_backward=True)
    was, now = before_tracker.peak()["categories"], after_tracker.peak()["categories"]
    assert was["gradients"] == sum(sizes)
    # the peak falls by the gradients, less what autograd still holds at the new peak
    held = now["activations"] + now["temporaries"] + now["inputs"]
    assert sib.saves - held <= before - after <= sib.saves + was["temporaries"]
    print(f"step in backward: predicted {sib.saves}, measured {before - after} (autograd held {held})")


def test_llmmem_int8_gets_no_int8_advice_and_the_lean_setup_none_of_them():
    model = _model()
    opt = llmmem.optim.AdamW(model.parameters(), lr=1e-3, state_dtype="int8")
    found, _ = _suggestions(model, opt, 8)
    assert "optimizer-state" not in found
    assert {"step_in_backward", "bf16-weights"} <= set(found)  # fp32 weights, gradients after backward
    assert "state_dtype='int8'" in found["bf16-weights"].code
    settings = estimate_settings(model, batch=8, seq=64, optimizer=opt)
    assert settings["optimizer"] == "adamw-int8" and settings["precision"] == "fp32"
    lean = _model(bf16=True)
    lean_opt = llmmem.optim.AdamW(lean.parameters(), lr=1e-3, state_dtype="int8")
    found, text = _suggestions(lean, lean_opt, 8, in_backward=True)
    assert not STATE_KINDS & set(found), sorted(found)
    assert "state_dtype='int8'" not in text


def test_the_estimate_describes_an_llmmem_optimizer_as_it_is():
    model = _model(bf16=True)
    opt = llmmem.optim.AdamW(model.parameters(), state_dtype="int4", master_weights=True)
    settings = estimate_settings(model, batch=2, seq=64, optimizer=opt)
    assert (settings["optimizer"], settings["precision"], settings["master_weights"]) == ("adamw-int4", "bf16", True)
    gpt_step(model, opt, 2)
    est = llmmem.estimate(model, **settings)
    held = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k == "master")
    assert est.master_weights == held and est.optimizer_state == _moments(opt)
    handle = llmmem.optim.step_in_backward(model, opt)
    try:
        assert estimate_settings(model, batch=2, seq=64, optimizer=opt)["step_in_backward"] is True
    finally:
        handle.remove()
    assert "step_in_backward" not in estimate_settings(model, batch=2, seq=64, optimizer=opt)


def test_a_master_copy_is_advised_away_by_its_bytes():
    model = _model(bf16=True)
    opt = llmmem.optim.AdamW(model.parameters(), lr=1e-3, state_dtype="int8", master_weights=True)
    found, _ = _suggestions(model, opt, 8)
    master = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k == "master")
    assert master > 0 and found["bf16-weights"].saves == master
    assert "optimizer-state" not in found


@pytest.mark.parametrize("make", ["sgd", "amsgrad"])
def test_no_llmmem_optimizer_advice_where_it_does_not_apply(make):
    model = _model()
    if make == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    found, _ = _suggestions(model, opt, 8)
    assert "optimizer-state" not in found and "bf16-weights" not in found
    assert "step_in_backward" in found  # any optimizer can be stepped in backward
