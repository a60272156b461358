"""oom_report's fused-head advice (issue 24, item 3): "llmmem.patch_lm_loss(model): saves X" where
the plain head's logits are a large part of the peak, X the estimator's plain total less its fused
one, checked against what computing the loss with ``llmmem.linear_cross_entropy`` really saves;
never for a model that carries the mark, nor where the logits are small."""

from __future__ import annotations

import pytest
import torch
from support.diagnostics import PeftLike, gpt_step, opt_model, tiny_gpt

import llmmem
from llmmem.diagnostics.advice import estimate_settings, suggest
from llmmem.diagnostics.tracker import MemoryTracker
from llmmem.models.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 16384  # over 2 x 64 tokens and a hidden size of 64: the logits make the plain step's peak


def _patched(model: GPT) -> GPT:
    llmmem.patch_lm_loss(model)  # its loss from the fused head, and the mark: (None, loss) with targets
    return model


def _peak(model, opt, batch: int) -> tuple[int, MemoryTracker]:
    gpt_step(model, opt, batch)
    with MemoryTracker(model, opt) as tracker:
        gpt_step(model, opt, batch)
    return tracker.peak_bytes(), tracker


def _report(model, opt, batch: int):
    """The report of an out-of-memory error under a budget halfway between what stays between
    steps and the step's peak."""
    peak, tracker = _peak(model, opt, batch)
    resident = sum(tracker.current().values())
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=(resident + peak) // 2, plan=False):
            gpt_step(model, opt, batch)
    report = info.value.report
    return {s.kind: s for s in report.suggestions}, report, str(info.value)


def test_large_logits_get_patch_lm_loss_with_what_the_estimator_and_a_real_step_say_it_saves():
    model, opt = tiny_gpt(vocab_size=VOCAB)
    found, report, text = _report(model, opt, 2)
    fused = found["fused-head"]
    settings = estimate_settings(model, batch=2, seq=64, optimizer=opt)
    est = llmmem.estimate(model, **settings)
    assert fused.saves == est.fused_head_saves > 0  # the estimator's two numbers
    assert fused.change == "llmmem.patch_lm_loss(model)" and "llmmem.patch_lm_loss(model)" in fused.code
    assert fused.predicted_peak == report.basis["predicted_peak"] - fused.saves and fused.source == "estimator"
    assert "llmmem.patch_lm_loss(model): saves" in text
    # applied: the same step with the loss computed by the fused head
    plain_peak, _ = _peak(model, opt, 2)
    twin, twin_opt = tiny_gpt(vocab_size=VOCAB)
    fused_peak, _ = _peak(_patched(twin), twin_opt, 2)
    print(f"fused head: predicted saving {fused.saves}, measured peak drop {plain_peak - fused_peak}")
    assert abs((plain_peak - fused_peak) - fused.saves) <= 0.05 * fused.saves


def test_a_marked_model_is_never_told_to_patch_its_loss():
    model, opt = tiny_gpt(vocab_size=VOCAB)
    _patched(model)
    found, report, text = _report(model, opt, 2)
    assert "fused-head" not in found and "patch_lm_loss" not in text
    assert llmmem.estimate(model, **estimate_settings(model, batch=2, seq=64, optimizer=opt)).settings.fused_head


def test_small_logits_get_no_fused_head_advice():
    model, opt = tiny_gpt(vocab_size=64, hidden=128, layers=4)
    found, _, text = _report(model, opt, 8)
    assert "fused-head" not in found and "patch_lm_loss" not in text


def _fused_head_suggestion(model, opt):
    settings = estimate_settings(model, batch=2, seq=64, optimizer=opt)
    found, _ = suggest(model, capacity=1 << 20, settings=settings, measured={}, plan=False, optimizer=opt)
    return next((s for s in found if s.kind == "fused-head"), None)


def test_the_advice_offers_patch_lm_loss_only_where_it_takes_the_model():
    """An architecture patch_lm_loss refuses gets llmmem.linear_cross_entropy by hand; a PEFT
    wrapper the patch of the model inside it, and nothing once that model carries the mark."""
    model, opt = tiny_gpt(vocab_size=VOCAB)
    assert _fused_head_suggestion(model, opt).change == "llmmem.patch_lm_loss(model)"
    wrapped = PeftLike(model)
    suggestion = _fused_head_suggestion(wrapped, opt)
    assert suggestion.change == "llmmem.patch_lm_loss(model.get_base_model())"
    _patched(model)  # as llmmem.patch_lm_loss(model.get_base_model()) leaves it
    assert _fused_head_suggestion(wrapped, opt) is None
    other = opt_model(VOCAB)
    suggestion = _fused_head_suggestion(other, torch.optim.AdamW(other.parameters()))
    assert "patch_lm_loss(model)" not in suggestion.change + suggestion.code
    assert "llmmem.patch_lm_loss refuses it: OPTForCausalLM is not an architecture it knows" in suggestion.change
    assert suggestion.code.startswith("loss = llmmem.linear_cross_entropy(hidden, lm_head.weight, labels)")
