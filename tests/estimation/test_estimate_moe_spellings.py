"""Mixtures of experts spelled each family's own way (issue 27): HunYuan MoE (a shared MLP beside
the experts, per-head query/key norms), Ernie 4.5 MoE (experts in a range of layers only, a router
bias) and DBRX (sizes nested in ``attn_config`` and ``ffn_config``, LayerNorms without a bias,
clamped Q/K/V) read, their parameters exact and their step within 10% of a measured one; compressed
(MLA) attention, JetMoe's attention experts and Llama 4's every-expert routing refused by name, by the
API and the command line alike. Tiny random-weight configs, CPU, fp32."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from support.planner import step_memory

import llmmem
from llmmem.__main__ import main
from llmmem.diagnostics.live import LiveBytes
from llmmem.estimation.model_configs import from_hf_config
from llmmem.estimation.model_state import config_tensors

transformers = pytest.importorskip("transformers", reason="the Hugging Face families need transformers (optional)")

DEC = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
FP32 = dict(precision="fp32", optimizer="adam", device_type="cpu")
READ = {
    "hunyuan-moe": (
        "HunYuanMoEV1ForCausalLM",
        "HunYuanMoEV1Config",
        dict(DEC, intermediate_size=96, num_experts=4, moe_topk=2, head_dim=16),
    ),
    "ernie4.5-moe": (
        "Ernie4_5_MoeForCausalLM",
        "Ernie4_5_MoeConfig",
        dict(
            DEC,
            intermediate_size=128,
            moe_intermediate_size=48,
            moe_num_experts=4,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
        ),
    ),
    "dbrx": (
        "DbrxForCausalLM",
        "DbrxConfig",
        dict(
            vocab_size=512,
            d_model=64,
            n_layers=4,
            n_heads=4,
            max_seq_len=128,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2),
        ),
    ),
}


def _build(name):
    model_cls, config_cls, fields = READ[name]
    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).train(), config


@pytest.mark.parametrize("name", list(READ))
def test_parameters_from_the_config_are_the_built_models(name):
    model, config = _build(name)
    cfg = from_hf_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert cfg.parameters(seq=64) == built, (cfg.describe(), cfg.parameters(seq=64), built)
    assert sum(config_tensors(cfg, 64)) == built  # the layout the optimizer state is sized on
    assert cfg.experts == 4 and cfg.experts_per_token == 2


def test_the_layers_each_family_gives_experts():
    assert from_hf_config(_build("ernie4.5-moe")[1]).dense_layers == 2  # layers 0 and 3: outside 1..2
    hunyuan = from_hf_config(_build("hunyuan-moe")[1])
    assert (hunyuan.dense_layers, hunyuan.shared_ffn, hunyuan.shared_gate, hunyuan.qk_norm) == (0, 96, False, "head")
    dbrx = from_hf_config(_build("dbrx")[1])
    assert (dbrx.kv_heads, dbrx.expert_ffn, dbrx.norm_bias, dbrx.clip_qkv, dbrx.bias) == (2, 96, False, True, False)


def _held_and_peak(model, b, s) -> tuple[int, int]:
    """(activation bytes alive when backward starts, the peak of a second Adam step, every tensor)."""
    ids = torch.randint(0, model.config.vocab_size, (b, s))
    _, held = step_memory(model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward())
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
        return held, live.max_allocated()


@pytest.mark.parametrize("name", list(READ))
def test_the_activations_and_the_peak_of_a_step_within_10_percent(name):
    model, config = _build(name)
    held, peak = _held_and_peak(model, 4, 64)
    est = llmmem.estimate(model, batch=4, seq=64, **FP32)
    print(f"{name}: activations {est.activations} (held {held}), peak {est.peak} (measured {peak})")
    assert abs(est.activations / held - 1) <= 0.10, (est.activations, held)
    assert abs(est.peak / peak - 1) <= 0.10, (est.peak, peak)


def test_the_command_line_reads_them_as_the_api_does(tmp_path, capsys):
    for name in READ:
        _, config = _build(name)
        (tmp_path / f"{name}.json").write_text(json.dumps(config.to_dict()))
        argv = ["estimate", str(tmp_path / f"{name}.json"), "--batch", "4", "--seq", "64", "--precision", "fp32"]
        assert main(argv + ["--json"]) == 0, name
        out = json.loads(capsys.readouterr().out)
        api = llmmem.estimate(config, batch=4, seq=64, precision="fp32")
        assert (out["bytes"]["total"], out["bytes"]["peak"]) == (api.total, api.peak), name
        assert out["model"]["parameter_count"] == api.parameter_count, name


REFUSED = {
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(DEC, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48),
        "compressed key/value attention",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(DEC, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48),
        "compressed key/value attention",
    ),
    "jetmoe": ("JetMoeConfig", dict(vocab_size=512, hidden_size=64, num_hidden_layers=2), "attention experts"),
    "llama4_text": (
        "Llama4TextConfig",
        dict(DEC, intermediate_size=64, num_local_experts=4),
        "every expert on every token",
    ),
}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_families_the_layer_model_cannot_describe_are_refused_by_name(model_type, tmp_path, capsys):
    config_cls, fields, words = REFUSED[model_type]
    config = getattr(transformers, config_cls)(**fields)
    with pytest.raises(ValueError) as info:
        llmmem.estimate(config, batch=1, seq=64)
    for w in (f"'{model_type}'", words, "does not guess"):
        assert w in str(info.value), (w, str(info.value))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert main(["estimate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model: ") and err.count("\n") == 1 and words in err, err


def test_llama4_is_refused_through_its_multimodal_config_too():
    with pytest.raises(ValueError, match="'llama4"):
        llmmem.estimate(transformers.Llama4Config(), batch=1, seq=64)


def test_a_different_top_k_a_layer_is_refused_naming_it():
    config = transformers.HunYuanMoEV1Config(**READ["hunyuan-moe"][2])
    config.moe_topk = [1, 2, 2, 2]
    with pytest.raises(ValueError, match=r"moe_topk \[1, 2, 2, 2\]"):
        llmmem.estimate(config, batch=1, seq=64)
