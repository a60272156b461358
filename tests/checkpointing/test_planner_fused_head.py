"""auto_checkpoint on a model whose loss is the fused head (issue 24, item 3): its description says
the logits are chunked by llmmem.linear_cross_entropy and how many rows a chunk holds; the profile
measures the step as it runs, so the plan holds its budget with no change to the budget's
arithmetic, at a fraction of the peak and at the least feasible budget: exactly with an untied
head; with a head tied to the embedding the prediction is high by the head's weight gradient, as
it is with the plain head (the profile counts that gradient, which waits in autograd for the
embedding's until the chain's backward ends, as held throughout the step)."""

from __future__ import annotations

import pytest
import torch
from support.planner import grads, same_grads, step_memory

import llmmem
from llmmem.head import marker
from llmmem.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, CHUNK = 8192, 64


def _model(chunk_size=CHUNK, tied=True):
    """llmmem's GPT with its loss from the fused head (llmmem.patch_lm_loss, which marks it)."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=6, hidden=64, heads=4, seq_len=64, vocab_size=VOCAB, dropout=0.0)
    model = GPT(cfg).train()
    if not tied:
        model.head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
    llmmem.patch_lm_loss(model, chunk_size=chunk_size)
    return model, torch.randint(0, VOCAB, (4, 64))


def test_the_description_says_the_head_is_fused_and_how_many_rows_a_chunk_holds():
    model, idx = _model()
    plan = llmmem.auto_checkpoint(model, budget=0.6, sample=(idx, idx), repeats=0)
    try:
        text = plan.describe()
        line = (
            "LM head fused (llmmem.patch_lm_loss): its logits are chunked by llmmem.linear_cross_entropy, its peak "
            f"at most one chunk of {CHUNK} rows x {VOCAB}"
        )
        assert line in text and text.count("LM head fused") == 1
    finally:
        plan.remove()
    # the memory target's rows when the mark names no chunk size: 32 MiB of fp32 logits hold all 4 x 64 here
    model, idx = _model(chunk_size=None)
    with llmmem.auto_checkpoint(model, budget=1.0, sample=(idx, idx), repeats=0) as plan:
        assert f"one chunk of 256 rows x {VOCAB}" in plan.describe()
    # an unmarked model's description says nothing of it
    marker.unmark(model)
    with llmmem.auto_checkpoint(model, budget=1.0, sample=(idx, idx), repeats=0) as plan:
        assert "LM head fused" not in plan.describe()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("budget", ["fraction", "least"])
def test_a_marked_model_s_plan_holds_its_budget(budget, tied):
    model, idx = _model(tied=tied)

    def step():
        model(idx, idx)[1].backward()

    ref_peak, _ = step_memory(model, step)
    ref_grads = grads(model)
    plan = llmmem.auto_checkpoint(model, budget=0.6, sample=(idx, idx), repeats=0)
    if budget == "least":
        least, profile = plan.min_budget_bytes, plan.profile
        plan.remove()
        plan = llmmem.auto_checkpoint(model, budget=least, profile=profile)
    try:
        # the fused head's forward (a chunk of logits, the weight's gradient) is measured as its transient
        assert plan.profile.head["fwd_tmp_bytes"] >= CHUNK * VOCAB * 4
        assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes < ref_peak
        peak, held = step_memory(model, step)
        print(f"{budget}, tied {tied}: budget {plan.budget_bytes}, predicted peak {plan.predicted_peak_bytes}, "
              f"measured {peak}; predicted held {plan.predicted_held_bytes}, measured {held}")  # fmt: skip
        assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)
        high = VOCAB * 64 * 4 if tied else 0  # the tied head's fp32 weight gradient (see the module docstring)
        for predicted, measured in ((plan.predicted_peak_bytes, peak), (plan.predicted_held_bytes, held)):
            assert -0.01 * measured <= predicted - measured <= high + 0.01 * measured, (predicted, measured)
        if tied:  # as the backward starts: among what the head keeps and among what is held throughout
            assert plan.predicted_held_bytes - held == pytest.approx(high, rel=0.01)
        assert same_grads(grads(model), ref_grads)  # (no dropout: the same step)
    finally:
        plan.remove()
