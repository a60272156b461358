"""The estimator on the families beyond dense decoders (issue 27, item 1): mixtures of experts
(Mixtral, Qwen2-MoE with its shared expert and dense layers, Qwen3-MoE), multi-query attention in
Falcon's spellings, q/k/v-only biases (Qwen2), parameters counted within 1% of the built model
(random weights, small configs; the Mixtral-8x7B config against the model on the meta device), a
mixture-of-experts layer's activations against those measured; encoder-decoder and encoder-only
configs refused, naming the model type, by the API and the command line alike."""

from __future__ import annotations

import json

import pytest
import torch

import llmmem
from llmmem.__main__ import main
from llmmem.diagnostics.live import LiveBytes
from llmmem.estimation.model_configs import ModelConfig, from_hf_config
from llmmem.estimation.model_state import config_tensors

transformers = pytest.importorskip("transformers", reason="the Hugging Face families need transformers (optional)")

BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)

FAMILIES = {
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2),
    ),
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            num_experts_per_tok=2,
            num_key_value_heads=2,
        ),
    ),
    "qwen2-moe-sparse": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=5,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            num_experts_per_tok=2,
            num_key_value_heads=2,
            decoder_sparse_step=2,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            intermediate_size=64,
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            num_key_value_heads=2,
        ),
    ),
    "granitemoe-shared": (
        "GraniteMoeSharedForCausalLM",
        "GraniteMoeSharedConfig",
        dict(
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=40,
            num_key_value_heads=2,
        ),
    ),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(intermediate_size=64, num_key_value_heads=2)),
    "falcon-mqa": ("FalconForCausalLM", "FalconConfig", dict(multi_query=True)),
    "falcon-gqa": ("FalconForCausalLM", "FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2)),
}


def _build(name):
    model_cls, config_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config), config


@pytest.mark.parametrize("name", list(FAMILIES))
def test_parameters_are_counted_within_one_percent_of_the_built_model(name):
    model, config = _build(name)
    real = sum(p.numel() for p in model.parameters())
    cfg = from_hf_config(config)
    assert abs(cfg.parameters(seq=16) / real - 1) <= 0.01, (cfg.describe(), cfg.parameters(seq=16), real)
    assert sum(config_tensors(cfg, 16)) == cfg.parameters(seq=16)  # the layout the optimizer state is sized on
    est = llmmem.estimate(model, batch=2, seq=16)  # given the model itself: its parameters exactly
    assert est.parameter_count == real


def test_the_mixtral_8x7b_config_is_within_one_percent_of_the_model_on_the_meta_device():
    config = transformers.MixtralConfig()  # the 8 x 7B defaults
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    real = sum(p.numel() for p in model.parameters())
    est = llmmem.estimate(config, batch=1, seq=4096)
    assert real > 46e9 and abs(est.parameter_count / real - 1) <= 0.01, (est.parameter_count, real)
    assert "8 experts" in from_hf_config(config).describe()


def test_a_mixture_of_experts_layer_keeps_what_the_estimate_says():
    """Bytes kept for backward by one Mixtral layer (the difference of a 4- and a 2-layer model,
    every tensor counted, fp32, eager attention) within 10% of the estimate's layer; the dense
    Mistral layer as the yardstick."""

    def per_layer(moe: bool) -> tuple[float, float]:
        kept = {}
        for layers in (2, 4):
            kw = dict(num_local_experts=8, num_experts_per_tok=2) if moe else {}
            name = "Mixtral" if moe else "Mistral"
            config = getattr(transformers, f"{name}Config")(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
                attn_implementation="eager",
                **kw,
            )
            torch.manual_seed(0)
            model = getattr(transformers, f"{name}ForCausalLM")(config).train()
            ids = torch.randint(0, 512, (2, 64))
            with LiveBytes(existing="gc") as live:
                before = live.allocated()
                out = model(input_ids=ids, labels=ids)
                kept[layers] = live.allocated() - before
            del out
            estimate = llmmem.estimate(model, batch=2, seq=64, precision="fp32").activations_per_layer
        return (kept[4] - kept[2]) / 2, estimate

    measured, estimated = per_layer(moe=True)
    assert abs(estimated / measured - 1) <= 0.10, (estimated, measured)
    dense_measured, dense_estimated = per_layer(moe=False)
    assert estimated - dense_estimated > 0.5 * (measured - dense_measured)  # the experts are seen


@pytest.mark.parametrize(
    "config_cls, words",
    [
        ("WhisperConfig", ["'whisper'", "encoder-decoder"]),
        ("UMT5Config", ["'umt5'", "encoder-decoder"]),
        ("ElectraConfig", ["'electra'", "an encoder"]),
        ("BambaConfig", ["'bamba'", "hybrid"]),
        ("T5GemmaConfig", ["'t5gemma'", "encoder-decoder"]),
        ("HubertConfig", ["'hubert'", "not a causal language model"]),
        ("BigBirdConfig", ["'big_bird'", "an encoder"]),
        ("JambaConfig", ["'jamba'", "hybrid"]),
        ("Qwen3NextConfig", ["'qwen3_next'", "hybrid", "linear_attention"]),
    ],
)
def test_encoder_decoders_and_encoders_are_refused_naming_them_by_the_api_and_the_cli(
    config_cls, words, tmp_path, capsys
):
    config = getattr(transformers, config_cls)()
    with pytest.raises(ValueError) as info:
        llmmem.estimate(config, batch=1, seq=128)
    for w in words + ["does not guess"]:
        assert w in str(info.value), (w, str(info.value))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert main(["estimate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(experts=4, experts_per_token=5), ["experts_per_token", "between 1 and experts"]),
        (dict(experts=4, experts_per_token=0), ["experts_per_token"]),
        (dict(experts_per_token=2), ["experts", "give its number of experts"]),
        (dict(experts=4, experts_per_token=2, dense_layers=3), ["dense_layers", "more than the 2 layers"]),
        (dict(experts=-1), ["experts", ">= 0"]),
        (dict(experts=4, experts_per_token=2, shared_gate=1), ["shared_gate"]),
    ],
)
def test_bad_expert_fields_name_the_field(fields, words):
    with pytest.raises(ValueError) as info:
        ModelConfig(layers=2, hidden=32, heads=4, vocab=128, mlp="swiglu", **fields)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_a_mixture_of_experts_counts_every_expert_in_the_state_and_the_routed_ones_in_the_activations():
    dense = ModelConfig(layers=2, hidden=64, heads=4, vocab=256, mlp="swiglu", ffn=128, bias=False)
    moe = ModelConfig(
        layers=2, hidden=64, heads=4, vocab=256, mlp="swiglu", ffn=128, bias=False, experts=8, experts_per_token=2
    )
    per_layer_mlp = 3 * 64 * 128
    assert moe.parameters() - dense.parameters() == 2 * (7 * per_layer_mlp + 64 * 8)  # 7 more experts, a router
    a = llmmem.estimate(dense, batch=2, seq=32)
    b = llmmem.estimate(moe, batch=2, seq=32)
    assert b.optimizer_state / a.optimizer_state > 4  # every expert's moments
    assert 1.5 < b.activations_per_layer / a.activations_per_layer < 3  # two experts a token, not eight
