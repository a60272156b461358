"""Helpers for the recompute planner's tests: the activation bytes of one training step, gradients
to compare, and small Hugging Face models from configs (random weights, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

from llmmem.checkpointing.profile import ActivationMeter


def step_memory(model, step) -> tuple[int, int]:
    """``(peak, held)``: activation bytes of ``step()`` at its peak and when its backward starts,
    exactly (tensor storages made during the step, parameter gradients not counted). Gradients are
    set to ``None`` first, as a training loop's ``zero_grad()`` does."""
    for p in model.parameters():
        p.grad = None
    with ActivationMeter(list(model.parameters())) as meter:
        step()
    return meter.peak, meter.marks["backward"][0]


def grads(model) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same_grads(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
    )


def transformers_or_skip():
    return pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (optional)")


def tiny_llama(attn: str, layers: int = 8, dropout: float = 0.1, seed: int = 0):
    """A Llama with grouped-query attention (4 heads, 2 key/value heads), random weights."""
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=dropout,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def tiny_gpt2(attn: str, layers: int = 8, dropout: float = 0.1, seed: int = 0):
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_positions=128,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        attn_implementation=attn,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


def lm_batch(seed: int = 0, batch: int = 2, seq: int = 64, vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids}
