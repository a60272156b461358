"""Falcon against the estimate (issue 27): its layer runs attention and the MLP in parallel from one
norm (one LayerNorm a layer, the MLP reading the Q/K/V projection's input), and its multi-query
attention hands SDPA one key/value head unrepeated, so that PyTorch takes its math path (the
``s x s`` probabilities and K, V expanded to every head kept, as eager attention keeps them). Grouped
heads in Llama's family are repeated by eager attention and kept grouped by SDPA, as estimated.
Tiny random-weight configs, CPU, fp32."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import llmmem
from llmmem.__main__ import main
from llmmem.diagnostics.live import LiveBytes
from llmmem.estimation.model_configs import from_hf_config

transformers = pytest.importorskip("transformers", reason="the Hugging Face families need transformers (optional)")

BASE = dict(vocab_size=512, hidden_size=64, num_attention_heads=4)
FP32 = dict(precision="fp32", optimizer="adam", device_type="cpu")


def _falcon(layers=4, **extra):
    config = transformers.FalconConfig(**BASE, num_hidden_layers=layers, **extra)
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(config).train(), config


def _kept(model, b, s) -> int:
    """Bytes a forward leaves alive for backward (every tensor made in it, the logits' too)."""
    ids = torch.randint(0, model.config.vocab_size, (b, s))
    gc.collect()
    with LiveBytes(existing="gc") as live:
        before = live.allocated()
        out = model(input_ids=ids, labels=ids, use_cache=False)
        kept = live.allocated() - before
    del out
    return kept


def _per_layer(make, b=2, s=64) -> tuple[float, int]:
    """(measured bytes one layer keeps: a 4-layer model's less a 2-layer one's, halved; the estimate's)."""
    small, big = make(2)[0], make(4)[0]
    measured = (_kept(big, b, s) - _kept(small, b, s)) / 2
    return measured, llmmem.estimate(big, batch=b, seq=s, **FP32).activations_per_layer


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_multi_query_falcon_layer_keeps_what_the_estimate_says(attn):
    measured, estimated = _per_layer(lambda n: _falcon(n, multi_query=True, attn_implementation=attn))
    print(f"falcon mqa {attn}: estimated {estimated}, measured {measured}")
    assert abs(estimated / measured - 1) <= 0.05, (estimated, measured)
    cfg = from_hf_config(_falcon(2, multi_query=True, attn_implementation=attn)[1])
    assert (cfg.kv_heads, cfg.parallel_attention, cfg.kv_broadcast) == (1, True, True)


def _step_peak(model, b, s) -> int:
    ids = torch.randint(0, model.config.vocab_size, (b, s))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    step()
    gc.collect()
    with LiveBytes(existing="gc") as live:
        live.reset_peak()
        step()
        return live.max_allocated()


def test_the_peak_of_a_multi_query_falcon_step_within_10_percent():
    model, config = _falcon(4, multi_query=True)
    measured = _step_peak(model, 4, 64)
    est = llmmem.estimate(model, batch=4, seq=64, **FP32)
    print(f"falcon mqa: peak {est.peak}, measured {measured}")
    assert abs(est.peak / measured - 1) <= 0.10, (est.peak, measured)
    assert est.parameter_count == from_hf_config(config).parameters(seq=64)  # one norm a layer


@pytest.mark.parametrize(
    "extra, parallel, broadcast",
    [
        (dict(multi_query=True), True, True),
        (dict(multi_query=True, parallel_attn=False), False, True),
        (dict(multi_query=False), True, False),
        (dict(new_decoder_architecture=True, num_kv_heads=2), False, False),
        (dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1), True, False),
        (dict(multi_query=True, ffn_hidden_size=96, activation="relu"), True, True),  # Falcon's own spellings
    ],
)
def test_falcon_layouts_are_read_and_counted_exactly(extra, parallel, broadcast):
    model, config = _falcon(2, **extra)
    cfg = from_hf_config(config)
    assert (cfg.parallel_attention, cfg.kv_broadcast) == (parallel, broadcast)
    assert cfg.parameters(seq=64) == sum(p.numel() for p in model.parameters()), cfg.describe()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_grouped_heads_in_llamas_family_are_kept_repeated_by_eager_attention_and_grouped_by_sdpa(attn):
    def make(n):
        config = transformers.LlamaConfig(
            **BASE, num_hidden_layers=n, num_key_value_heads=1, intermediate_size=128, attn_implementation=attn
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train(), config

    measured, estimated = _per_layer(make)
    print(f"llama gqa {attn}: estimated {estimated}, measured {measured}")
    assert abs(estimated / measured - 1) <= 0.05, (estimated, measured)
    terms = llmmem.estimate(make(2)[0], batch=2, seq=64, **FP32).layer_terms
    kv = 4 if attn == "eager" else 1  # key/value heads kept: repeated to the 4 query heads, or the one
    assert terms["q, k, v"] == 4 * 2 * 64 * 16 * (4 + 2 * kv)


def test_the_command_line_reads_a_falcon_config_as_the_api_does(tmp_path, capsys):
    _, config = _falcon(4, multi_query=True)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert main(["estimate", str(tmp_path), "--batch", "4", "--seq", "64", "--precision", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    api = llmmem.estimate(config, batch=4, seq=64, precision="fp32")
    assert (out["bytes"]["total"], out["bytes"]["peak"]) == (api.total, api.peak)
    assert out["model"]["parameter_count"] == api.parameter_count
