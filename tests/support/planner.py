"""Helpers for the recompute planner's tests: the activation bytes of one training step, gradients
to compare, and small Hugging Face models from configs (random weights, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

from llmmem.checkpointing.meters import ActivationMeter


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


def seeded_step(model, batch: dict) -> torch.Tensor:
    """One forward and backward of ``model(**batch).loss`` from cleared gradients and a fixed seed;
    the loss, detached."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def assert_grads_close(got: list, want: list) -> None:
    """Gradients (from :func:`grads`) equal within float32 reordering, None where the other is."""
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


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


def tiny_t5(layers: int = 4, dropout: float = 0.1, seed: int = 0):
    """An encoder-decoder with relative position biases (made by each stack's first layer)."""
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    cfg = transformers.T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=256,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=4,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg).train()


def tiny_bart(layers: int = 4, dropout: float = 0.1, seed: int = 0):
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    cfg = transformers.BartConfig(
        vocab_size=256,
        d_model=64,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_position_embeddings=128,
        dropout=dropout,
        attention_dropout=dropout,
    )
    return transformers.BartForConditionalGeneration(cfg).train()


def seq2seq_batch(seed: int = 0, batch: int = 2, seq: int = 64, target: int = 48, vocab: int = 256) -> dict:
    """Source and target of different lengths, so that a mix-up of the two shows."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(3, vocab, (batch, seq), generator=g),
        "labels": torch.randint(3, vocab, (batch, target), generator=g),
    }
