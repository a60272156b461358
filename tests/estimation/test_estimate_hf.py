"""The estimator on real models: Hugging Face Llama and GPT-2 (small configs, random weights) read for
their architecture, activations against the bytes a training step really holds (exact live tensor
bytes), ``estimate(model.config)``, and ``measure=`` on a module the formulas cannot see into.
Skipped when ``transformers`` is not installed."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn as nn
from support.planner import lm_batch, step_memory, tiny_gpt2, tiny_llama, transformers_or_skip

import llmmem
from llmmem.estimation import model_configs
from llmmem.models.gpt import GPT, GPTConfig

transformers_or_skip()

BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def _held(model, batch) -> int:
    """Activation bytes held when the backward starts, training without a key/value cache."""
    _, held = step_memory(model, lambda: model(**batch, use_cache=False).loss.backward())
    return held


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_activations_within_10_percent_of_a_real_step(kind, attn, dropout):
    model = BUILDERS[kind](attn, dropout=dropout)
    for b, s in ((2, 64), (3, 96)):
        held = _held(model, lm_batch(batch=b, seq=s))
        est = llmmem.estimate(model, batch=b, seq=s, precision="fp32", device_type="cpu")
        print(f"{kind} {attn} dropout {dropout} b{b} s{s}: estimated {est.activations}, measured {held}")
        assert abs(est.activations - held) <= 0.10 * held
        from_config = llmmem.estimate(model.config, batch=b, seq=s, precision="fp32", device_type="cpu")
        assert from_config.activations == est.activations
    assert est.parameter_count == sum(p.numel() for p in model.parameters())
    assert from_config.parameter_count == est.parameter_count  # the formula counts what the module has


def test_the_architecture_is_read_from_the_config():
    llama = llmmem.estimate(tiny_llama("eager").config, batch=2, seq=64).model
    assert (llama.mlp, llama.activation, llama.norm, llama.fused_norm) == ("swiglu", "silu", "rmsnorm", False)
    assert (llama.positions, llama.bias, llama.kv_heads, llama.heads, llama.attention) == (
        "rotary",
        False,
        2,
        4,
        "explicit",
    )
    assert (llama.attention_dropout, llama.hidden_dropout) == (0.1, 0.0)
    gpt2 = llmmem.estimate(tiny_gpt2("sdpa").config, batch=2, seq=64).model
    assert (gpt2.mlp, gpt2.activation, gpt2.norm, gpt2.fused_norm) == ("gelu", "gelu_new", "layernorm", True)
    assert (gpt2.positions, gpt2.bias, gpt2.tied_embeddings, gpt2.attention) == ("learned", True, True, "sdpa")
    assert gpt2.max_positions == 128 and gpt2.hidden_dropout == gpt2.attention_dropout == 0.1


def test_grouped_query_heads_are_kept_repeated_by_eager_attention():
    """Eager attention (and SDPA's math path on the CPU with dropout) keeps K and V after repeating
    the 2 key/value heads to the 4 query heads; a fused kernel keeps them grouped."""
    sizes = {}
    for attn, dropout in (("eager", 0.0), ("sdpa", 0.0), ("sdpa", 0.1)):
        cfg = tiny_llama(attn, dropout=dropout).config
        sizes[attn, dropout] = llmmem.estimate(cfg, batch=2, seq=64, precision="fp32", device_type="cpu").layer_terms[
            "q, k, v"
        ]
    q = 4 * 2 * 64 * 64  # fp32, b=2, s=64, 4 heads of 16
    assert sizes["eager", 0.0] == sizes["sdpa", 0.1] == 3 * q
    assert sizes["sdpa", 0.0] == q + 2 * q // 2


class _HandWrittenGelu(nn.Module):
    """A GELU written as elementwise operators, which keeps several tensors: only a measurement sees it."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def test_measure_sees_what_the_formulas_cannot():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, hidden=64, heads=4, seq_len=64, vocab_size=128, dropout=0.0)).train()
    for block in model.blocks:
        block.mlp.act = _HandWrittenGelu()
        block.mlp.forward = lambda x, m=block.mlp: m.proj(m.act(m.fc(x)))
    idx = torch.randint(0, 128, (2, 64))
    _, held = step_memory(model, lambda: model(idx, idx)[1].backward())
    model.zero_grad(set_to_none=True)
    guessed = llmmem.estimate(model, batch=2, seq=64, precision="fp32", device_type="cpu")
    measured = llmmem.estimate(model, batch=2, seq=64, precision="fp32", device_type="cpu", measure=True)
    assert guessed.activations < 0.9 * held  # the formula takes torch's GELU
    assert measured.layer_scale > 1 and abs(measured.activations - held) <= 0.05 * held
    assert measured.to_dict()["measured_layer_bytes"] == measured.measured_layer_bytes > 0
    # a batch of the model's own inputs works as well; measuring leaves no gradient behind
    again = llmmem.estimate(model, batch=2, seq=64, precision="fp32", device_type="cpu", measure=(idx,))
    assert again.measured_layer_bytes == measured.measured_layer_bytes
    assert all(p.grad is None for p in model.parameters())
    # on a Hugging Face model the formulas are exact: measuring changes nothing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = tiny_llama("eager")
        est = llmmem.estimate(hf, batch=2, seq=64, precision="fp32", device_type="cpu", measure=True)
    assert est.layer_scale == pytest.approx(1.0, abs=1e-3)


def test_measure_misuse():
    with pytest.raises(ValueError, match="measure: needs an nn.Module"):
        llmmem.estimate("llama-7b", measure=True)
    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab_size=64))
    with pytest.raises(TypeError, match="measure: expected True or a batch"):
        llmmem.estimate(model, batch=1, seq=16, measure=3.5)


def _bloom_config(dropout: float = 0.0, layers: int = 8):
    """A small BLOOM config naming no attention implementation (ALiBi, fused QKV, LayerNorm, GELU)."""
    transformers = transformers_or_skip()
    return transformers.BloomConfig(
        vocab_size=256, hidden_size=64, n_layer=layers, n_head=4, hidden_dropout=dropout, attention_dropout=dropout
    )


def test_bloom_without_an_attention_implementation_is_estimated_with_explicit_attention(tmp_path):
    """Hugging Face's BLOOM has no SDPA path, so a config that names no implementation runs eager
    attention: the estimate, from the config object and from its config.json, keeps the scores and
    matches a real step (without dropout, where an SDPA estimate is 20-26% low)."""
    transformers = transformers_or_skip()
    config = _bloom_config()
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(_bloom_config()).train()
    assert model.config._attn_implementation == "eager"  # what Hugging Face itself chose
    read = {"object": config, "config.json": model_configs.read_hf_config_file(tmp_path / "config.json")}
    for b, s in ((2, 64), (3, 96)):
        held = _held(model, lm_batch(batch=b, seq=s))
        for source, cfg in read.items():
            est = llmmem.estimate(cfg, batch=b, seq=s, precision="fp32", device_type="cpu")
            print(f"bloom b{b} s{s} from the {source}: estimated {est.activations}, measured {held}")
            assert est.model.attention == "explicit", source
            assert abs(est.activations - held) <= 0.10 * held, source


def _saved(config, path) -> str:
    config.save_pretrained(path)
    return str(path / "config.json")


def test_the_default_attention_follows_the_model_class_without_transformers_too(tmp_path, monkeypatch):
    """Llama and GPT-2 support SDPA, BLOOM does not: the same default whether the installed
    transformers is asked or, when it cannot be imported, the estimator's own table is."""
    transformers = transformers_or_skip()
    llama = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4
    )
    gpt2 = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    expected = {"llama": "sdpa", "gpt2": "sdpa", "bloom": "explicit"}
    configs = {"llama": llama, "gpt2": gpt2, "bloom": _bloom_config(layers=2)}
    files = {kind: _saved(cfg, tmp_path / kind) for kind, cfg in configs.items()}
    for kind, cfg in configs.items():
        assert llmmem.estimate(cfg, batch=1, seq=16).model.attention == expected[kind], kind
        assert model_configs.read_hf_config_file(files[kind]).attention == expected[kind], kind
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    assert model_configs.hf_class_supports_sdpa(configs["bloom"]) is None
    for kind, cfg in configs.items():
        assert llmmem.estimate(cfg, batch=1, seq=16).model.attention == expected[kind], kind
        assert model_configs.read_hf_config_file(files[kind]).attention == expected[kind], kind


def test_the_table_of_model_types_without_sdpa_agrees_with_transformers():
    """The fallback table holds what the installed transformers says of each type it knows."""
    transformers_or_skip()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = sorted(t for t in model_configs._HF_TYPES_WITHOUT_SDPA if t in CONFIG_MAPPING)
    assert "bloom" in known
    for model_type in known:
        assert model_configs.hf_class_supports_sdpa(CONFIG_MAPPING[model_type]()) is False, model_type
    for model_type in ("llama", "gpt2", "mistral", "qwen2", "gpt_neox"):
        assert model_configs.hf_class_supports_sdpa(CONFIG_MAPPING[model_type]()) is True, model_type
