"""Tiny Hugging Face causal LMs of every family llmmem.patch_lm_loss supports (random weights,
nothing downloaded), batches with ignored labels, and the comparisons of its tests."""

from __future__ import annotations

import warnings

import pytest
import torch

VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# a soft cap that the logits reach (weights 10x the default scale)
_CAPPED = {"head_dim": 8, "final_logit_softcapping": 2.0, "initializer_range": 0.2}
_NO_KV = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}
# family -> (config class, model class, config arguments)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _COMMON),
    "mistral": ("MistralConfig", "MistralForCausalLM", _COMMON),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _COMMON),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_COMMON, "head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_COMMON, "head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_COMMON, **_CAPPED}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_COMMON, **_CAPPED}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _COMMON),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2),
    ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _NO_KV),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _COMMON),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True},
    ),
}


def transformers_or_skip():
    return pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (optional)")


def build(family: str, seed: int = 0, **overrides):
    """A tiny model of ``family`` (random weights; eval mode, so dropout is off)."""
    transformers = transformers_or_skip()
    config_name, model_name, kwargs = FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"this transformers has no {model_name}")
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_name)(**{**kwargs, **overrides})
        return getattr(transformers, model_name)(config).eval()


def batch(seed: int = 1, b: int = 2, s: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt the loss ignores
    labels[1, -2:] = -100
    return ids, labels


def run(model, **kwargs):
    """(output, gradients of every parameter by name) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-12, msg=name)
