"""auto_checkpoint on Hugging Face Llama and GPT-2 (small configs, random weights, dropout on, sdpa
and eager attention): gradients bitwise those of no checkpointing, the measured peak within the
budget at 50% and 25%, held bytes within 5% of the prediction, the same plan on every run, caches.
Skipped when ``transformers`` is not installed (an optional test dependency)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from support.planner import (
    grads,
    lm_batch,
    same_grads,
    step_memory,
    tiny_gpt2,
    tiny_llama,
    transformers_or_skip,
)

import llmmem

transformers_or_skip()

BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def _step(model, batch, seed=11):
    def step():
        torch.manual_seed(seed)
        model(**batch).loss.backward()

    return step


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*caching is incompatible.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_plans_fit_the_budget_exactly_and_the_same_every_time(kind, attn):
    batch = lm_batch()
    reference = BUILDERS[kind](attn, seed=0)
    step_memory(reference, _step(reference, batch))
    ref_grads = grads(reference)
    seen = {0.5: set(), 0.25: set()}
    for run in range(5):
        model = BUILDERS[kind](attn, seed=run)  # a fresh model each run (other weights): profiled anew
        profile = None
        for budget in (0.5, 0.25):
            before = grads(model)
            plan = llmmem.auto_checkpoint(model, budget=budget, sample=batch, profile=profile, repeats=1)
            assert same_grads(grads(model), before)  # planning leaves the gradients as they were
            profile = plan.profile
            assert plan.blocks_name == ("model.layers" if kind == "llama" else "transformer.h")
            seen[budget].add((tuple(plan.modes), tuple(plan.regions), plan.budget_bytes, plan.predicted_peak_bytes))
            if run == 0:
                peak, held = step_memory(model, _step(model, batch))
                assert same_grads(grads(model), ref_grads), budget
                assert peak <= plan.budget_bytes, (budget, peak, plan.budget_bytes)
                assert plan.predicted_peak_bytes <= plan.budget_bytes
                assert abs(held - plan.predicted_held_bytes) <= 0.05 * plan.predicted_held_bytes, (held, plan)
                assert plan.regions, "a 50% or 25% budget needs some recompute"
            plan.remove()
    assert all(len(plans) == 1 for plans in seen.values()), seen


def test_the_reference_peak_is_the_measured_one():
    """A fraction is of the peak without checkpointing: the planner's figure for it is within a few
    percent of the peak measured on the model."""
    batch = lm_batch()
    for kind in BUILDERS:
        model = BUILDERS[kind]("eager")
        peak, _ = step_memory(model, _step(model, batch))
        plan = llmmem.auto_checkpoint(model, budget=1.0, sample=batch, repeats=0)
        assert abs(plan.no_checkpoint_peak_bytes - peak) <= 0.06 * peak, (kind, plan.no_checkpoint_peak_bytes, peak)
        assert plan.regions == [] or plan.predicted_peak_bytes <= plan.budget_bytes
        plan.remove()


def test_caches_and_generation():
    """Training with use_cache=True: the planned layers write no cache (a recompute would write it
    twice); with gradients off (generation) they run as they are and the cache fills."""
    batch = lm_batch()
    model = tiny_llama("sdpa")
    ref = copy.deepcopy(model)
    plan = llmmem.auto_checkpoint(model, budget=0.4, sample=batch)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        m(**batch, use_cache=True).loss.backward()
    assert same_grads(grads(model), grads(ref))
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], use_cache=True, return_dict=True)
    assert out.past_key_values.get_seq_length() == batch["input_ids"].shape[1]
    model.eval()
    ref.eval()
    generated = model.generate(batch["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
    expected = ref.generate(batch["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, expected)
    plan.remove()


def test_takes_over_hugging_face_checkpointing_and_gives_it_back():
    batch = lm_batch()
    model = tiny_gpt2("sdpa")
    model.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.transformer.h)
    ref = copy.deepcopy(model)
    ref.gradient_checkpointing_disable()
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch)
    assert not any(layer.gradient_checkpointing for layer in model.transformer.h)
    peak, _ = step_memory(model, _step(model, batch))
    step_memory(ref, _step(ref, batch))
    assert same_grads(grads(model), grads(ref)) and peak <= plan.budget_bytes
    plan.remove()
    assert all(layer.gradient_checkpointing for layer in model.transformer.h)
    assert all("forward" not in layer.__dict__ for layer in model.transformer.h)


def _mlp_calls(model, step) -> int:
    """How many times the layers' MLPs ran in ``step``: once each without checkpointing, once more
    per recompute."""
    calls = []
    handles = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    try:
        step_memory(model, step)
    finally:
        for h in handles:
            h.remove()
    return len(calls)


def test_hugging_face_checkpointing_enabled_after_planning_is_turned_off_again():
    """What ``Trainer(gradient_checkpointing=True)`` does to a model planned before it: warned once,
    Hugging Face's checkpointing off again before the step, the plan's recomputes only, gradients
    exact; ``remove()`` gives the user's switch back."""
    batch = lm_batch()
    model = tiny_llama("sdpa", dropout=0.0)
    ref = copy.deepcopy(model)
    step_memory(ref, _step(ref, batch))
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
    planned_calls = _mlp_calls(model, _step(model, batch))
    assert planned_calls > len(model.model.layers)  # the plan recomputes some
    model.gradient_checkpointing_enable()
    for step in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            calls = _mlp_calls(model, _step(model, batch))
        said = [w for w in caught if "enabled on the planned blocks" in str(w.message)]
        assert len(said) == (1 if step == 0 else 0)
        if said:
            assert "before this step" in str(said[0].message) and said[0].filename == __file__
        assert calls == planned_calls  # never Hugging Face's checkpoint around the plan's
        assert same_grads(grads(model), grads(ref))
        assert not any(layer.gradient_checkpointing for layer in model.model.layers)  # the truth
    plan.remove()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # as the user asked
    assert not model._forward_pre_hooks


@pytest.mark.cuda
def test_hugging_face_llama_on_cuda():
    """On a GPU: the measured peak (tensor bytes, and the allocator's) within the budget."""
    batch = {k: v.cuda() for k, v in lm_batch(batch=4, seq=128).items()}
    model = tiny_llama("sdpa").cuda()
    ref = copy.deepcopy(model)
    step_memory(ref, _step(ref, batch))
    for budget in (0.5, 0.25):
        plan = llmmem.auto_checkpoint(model, budget=budget, sample=batch)
        peak, held = step_memory(model, _step(model, batch))
        assert same_grads(grads(model), grads(ref))
        assert peak <= plan.budget_bytes
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, batch)()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= 1.05 * plan.budget_bytes
        plan.remove()


def test_grouped_query_attention_plans_and_trains():
    """Fewer key/value heads than query heads (Llama 2 70B, Mistral, Qwen2): sdpa is called with
    grouped heads, which the planner's work count must accept; gradients stay those of no checkpointing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(cfg).train()

    batch = lm_batch()
    reference = build()
    _step(reference, batch)()
    model = build()
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=1)
    assert plan.regions or any(m != "store-all" for m in plan.modes)
    _step(model, batch)()
    assert same_grads(grads(model), grads(reference))
    plan.remove()


def test_a_loop_keeping_the_output_is_told_what_it_costs():
    """Planned on a batch (the output freed before the backward), then trained by a loop that keeps
    the output (to log the logits, say): one warning, at the loop's line, with the bytes kept, and
    the step's peak within the predicted peak plus those bytes. The loop the plan assumed (also
    returning hidden states and attentions, which autograd holds anyway), a callable sample, and a
    removed plan say nothing; a plan made again from the batch's profile watches too."""
    import re

    batch = lm_batch()
    model = tiny_llama("eager", seed=0)
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
    logits = batch["input_ids"].numel() * model.config.vocab_size * 4

    def keeping(**extra):
        out = model(**batch, **extra)  # out (the logits) alive through the backward
        out.loss.backward()

    def warnings_of(step, **extra):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            peak, _ = step_memory(model, lambda: step(**extra))
        return [w for w in seen if "still alive during the backward" in str(w.message)], peak

    def freeing(**extra):
        model(**batch, **extra).loss.backward()

    assert warnings_of(freeing)[0] == []
    assert warnings_of(freeing, output_hidden_states=True, output_attentions=True)[0] == []
    kept, peak = warnings_of(keeping)
    assert len(kept) == 1 and kept[0].filename == __file__  # at the loop's line
    assert kept[0].lineno == keeping.__code__.co_firstlineno + 1
    size = re.match(r"llmmem.auto_checkpoint: ([\d.]+ \w+) of the model's output", str(kept[0].message)).group(1)
    assert llmmem.parse_bytes(size.replace(" ", "")) == logits
    assert plan.predicted_peak_bytes < peak <= plan.predicted_peak_bytes + logits
    assert warnings_of(keeping)[0] == []  # once
    plan.remove()
    assert warnings_of(keeping)[0] == []  # removed: nothing watches

    again = llmmem.auto_checkpoint(model, budget=0.5, profile=plan.profile)
    kept, _ = warnings_of(keeping, output_hidden_states=True)
    # the logits and the final norm's output: made after the chain's last block
    assert len(kept) == 1 and "2 tensor(s)" in str(kept[0].message)
    again.remove()

    callable_plan = llmmem.auto_checkpoint(model, budget=0.5, sample=keeping, repeats=0)
    kept, peak = warnings_of(keeping)
    assert kept == [] and peak <= callable_plan.budget_bytes
    callable_plan.remove()


def test_the_output_warning_points_at_the_loop_from_a_backward_thread():
    """On an accelerator autograd runs the hook on its own thread, with no frame of the user's:
    the warning still points at the line that called the model."""
    import inspect
    import threading

    batch = lm_batch()
    model = tiny_llama("sdpa", seed=0)
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
    out = model(**batch)  # the line the warning points at
    line = inspect.currentframe().f_lineno - 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        worker = threading.Thread(target=plan.watch._on_chain_backward, args=(None,))
        worker.start()
        worker.join()
    kept = [w for w in seen if "still alive" in str(w.message)]
    assert len(kept) == 1 and (kept[0].filename, kept[0].lineno) == (__file__, line)
    del out
    plan.remove()
