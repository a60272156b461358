"""auto_checkpoint on models whose parameters are partly or wholly frozen: LoRA-style adapters in the
blocks of a Hugging Face Llama and of llmmem's GPT (the base frozen, so the first block's input needs
no gradient) are profiled and planned, with the adapters' gradients bitwise those of no
checkpointing and the measured peak within the prediction; a frozen model, or frozen blocks in the
chain, are a clear error naming the cause."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from support.planner import grads, lm_batch, same_grads, step_memory, tiny_llama, transformers_or_skip

import llmmem
from llmmem.models.gpt import GPT, GPTConfig


class LoRA(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``x @ A @ B``."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(base.in_features, rank) * 0.02)
        self.B = nn.Parameter(torch.randn(rank, base.out_features) * 0.02)

    def forward(self, x):
        return self.base(x) + x @ self.A @ self.B


def _freeze(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lora_llama(layers: int = 6):
    """A Llama (dropout on) frozen, with adapters on every layer's q_proj and v_proj."""
    model = _freeze(tiny_llama("eager", layers=layers))
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    return model


def lora_gpt(layers: int = 6):
    """llmmem's GPT (dropout on) frozen, with adapters on every block's qkv projection."""
    torch.manual_seed(0)
    model = _freeze(GPT(GPTConfig(layers=layers, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.1)))
    torch.manual_seed(1)
    for block in model.blocks:
        block.attn.qkv = LoRA(block.attn.qkv)
    return model


def _llama_step(model, batch, seed=11):
    def step():
        torch.manual_seed(seed)
        model(**batch).loss.backward()

    return step


def _gpt_step(model, batch, seed=11):
    def step():
        torch.manual_seed(seed)
        model(*batch)[1].backward()

    return step


def _gpt_batch():
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    return (idx, idx)


CASES = {"llama": (lora_llama, lm_batch, _llama_step), "gpt": (lora_gpt, _gpt_batch, _gpt_step)}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*caching is incompatible.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


@pytest.mark.parametrize("callable_sample", [False, True])
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_lora_models_are_planned_and_their_adapter_gradients_exact(kind, callable_sample):
    """Was: ``element 0 of tensors does not require grad`` (a batch or a callable sample) or
    ``TypeError: sample: the model returned tuple with no floating-point tensor`` (the GPT)."""
    build, make_batch, make_step = CASES[kind]
    if kind == "llama":
        transformers_or_skip()
    batch = make_batch()
    model = build()
    reference = copy.deepcopy(model)
    step_memory(reference, make_step(reference, batch))
    ref_grads = grads(reference)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and len(trained) < len(list(model.parameters()))
    sample = make_step(model, batch) if callable_sample else batch
    profile = None
    for budget in (0.5, 0.25):
        plan = llmmem.auto_checkpoint(model, budget=budget, sample=sample, profile=profile, repeats=0)
        profile = plan.profile
        assert plan.regions, "a 50% or 25% budget needs some recompute"
        peak, held = step_memory(model, make_step(model, batch))
        assert same_grads(grads(model), ref_grads), budget  # the adapters' exactly, the frozen ones None
        assert peak <= plan.predicted_peak_bytes <= plan.budget_bytes, (budget, peak, plan.predicted_peak_bytes)
        # the planner's chain charges the first block a gradient of its input, which a frozen
        # embedding never gets: a little above, never below
        assert plan.predicted_peak_bytes - peak <= 0.02 * peak, (budget, peak, plan.predicted_peak_bytes)
        assert abs(held - plan.predicted_held_bytes) <= 0.05 * plan.predicted_held_bytes, (held, plan)
        plan.remove()


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_lora_model_needs_less_recompute_than_its_unfrozen_copy(kind):
    """The plan of the frozen model against that of the same model unfrozen: frozen weights keep
    less for backward (the first block's input, with no gradient, least), so at the unfrozen plan's
    byte budget the LoRA plan fits with no more recompute."""
    build, make_batch, _ = CASES[kind]
    if kind == "llama":
        transformers_or_skip()
    batch = make_batch()
    model = build()
    unfrozen = copy.deepcopy(model)
    for p in unfrozen.parameters():
        p.requires_grad_(True)
    profiles = []
    for m in (model, unfrozen):
        plan = llmmem.auto_checkpoint(m, budget=1.0, sample=batch, repeats=0)
        plan.remove()
        profiles.append(plan.profile)
    lora, full = profiles
    assert all(a[0] <= b[0] for a, b in zip(lora.saved_bytes, full.saved_bytes))
    assert lora.saved_bytes[0][0] < lora.saved_bytes[1][0]  # block 0 makes no gradient of its input
    for fraction in (0.7, 0.5, 0.25):
        theirs = llmmem.plan_checkpoints(None, budget=fraction, profile=full)
        ours = llmmem.plan_checkpoints(None, budget=theirs.budget_bytes, profile=lora)
        assert ours.predicted_overhead_work <= theirs.predicted_overhead_work, (fraction, ours, theirs)
        assert ours.no_checkpoint_peak_bytes < theirs.no_checkpoint_peak_bytes


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_frozen_model_is_a_clear_error(kind):
    build, make_batch, make_step = CASES[kind]
    if kind == "llama":
        transformers_or_skip()
    batch = make_batch()
    model = _freeze(build(layers=2))
    for sample in (batch, make_step(model, batch)):
        with pytest.raises(
            ValueError, match=r"has no backward: no parameter of \w+ requires grad \(the model is frozen"
        ):
            llmmem.auto_checkpoint(model, budget=0.5, sample=sample, repeats=0)
        assert all("forward" not in b.__dict__ for b in model.modules())  # nothing left installed


def test_frozen_blocks_in_the_chain_are_named():
    """A frozen prefix (blocks 0 and 1 and the embeddings frozen): those blocks keep nothing; the
    error names them, and the blocks that train can be planned alone."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=0.0))
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # untie, so the embeddings can freeze
    for m in (model.tok_emb, model.pos_emb, *model.blocks[:2]):
        _freeze(m)
    batch = _gpt_batch()
    with pytest.raises(ValueError, match=r"block\(s\) \[0, 1\] of the 4 blocks have no backward"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0)
    reference = copy.deepcopy(model)
    step_memory(reference, _gpt_step(reference, batch))
    plan = llmmem.auto_checkpoint(model, budget=0.65, sample=batch, blocks=list(model.blocks[2:]), repeats=0)
    assert plan.regions
    peak, _ = step_memory(model, _gpt_step(model, batch))
    assert same_grads(grads(model), grads(reference)) and peak <= plan.predicted_peak_bytes
    plan.remove()
