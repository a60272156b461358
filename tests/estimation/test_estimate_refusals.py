"""Models the estimator does not read, refused by name the same way from a config, a config.json
and a model instance: multimodal models (a vision tower beside the text model: LLaVA, Qwen2-VL,
Gemma 3, PaliGemma, Idefics 3, mllama), whose text model alone stays estimable from its own config;
encoder-decoders and encoders it has no reader for, refused by model_type before any task their
class names. Tiny random-weight models on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import llmmem
from llmmem.__main__ import main

transformers = pytest.importorskip("transformers", reason="the Hugging Face families need transformers (optional)")

TEXT = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32)


def _quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


MULTIMODAL = {
    "gemma3": lambda: transformers.Gemma3Config(
        text_config=dict(TEXT), vision_config=dict(VISION, patch_size=8), mm_tokens_per_image=4
    ),
    "llava": lambda: transformers.LlavaConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(VISION, model_type="clip_vision_model", patch_size=8, projection_dim=32),
    ),
    "qwen2_vl": lambda: transformers.Qwen2VLConfig(
        text_config=dict(
            {k: v for k, v in TEXT.items() if k != "head_dim"},
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4),
    ),
    "paligemma": lambda: transformers.PaliGemmaConfig(),
    "idefics3": lambda: transformers.Idefics3Config(),
    "mllama": lambda: transformers.MllamaConfig(),
}
BUILT = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}


def _refusal(obj, **kw) -> str:
    with pytest.raises(ValueError) as info:
        llmmem.estimate(obj, batch=2, seq=64, **kw)
    return str(info.value)


@pytest.mark.parametrize("name", list(MULTIMODAL))
def test_a_multimodal_config_is_refused_by_name_in_the_api_and_the_cli(name, tmp_path, capsys):
    config = _quiet(MULTIMODAL[name])
    text = _refusal(config)
    model_type = config.model_type
    for w in (f"model_type {model_type!r}", "multimodal", "vision_config", "does not estimate the tower"):
        assert w in text, (w, text)
    assert _refusal(config, task="seq2seq-lm") == text  # what the model is, before the task asked
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert main(["estimate", str(tmp_path / "config.json"), "--batch", "2", "--seq", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model: ") and err.count("\n") == 1 and "does not estimate the tower" in err, err


def test_the_cli_refuses_a_multimodal_config_without_transformers_loaded(tmp_path):
    # the command line reads config.json offline, without importing transformers (nor its list of
    # causal LMs, which refused LLaVA in the API but not here)
    (tmp_path / "config.json").write_text(json.dumps(_quiet(MULTIMODAL["llava"]).to_dict()))
    code = (
        "import sys; from llmmem.__main__ import main; rc = main(sys.argv[1:]); "
        "assert 'transformers' not in sys.modules; sys.exit(rc)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, "estimate", str(tmp_path), "--batch", "2", "--seq", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "model_type 'llava', a multimodal model" in run.stderr and "vision_config" in run.stderr


@pytest.mark.parametrize("name", list(BUILT))
def test_a_multimodal_model_is_refused_as_its_config_is(name):
    config = _quiet(MULTIMODAL[name])
    model = _quiet(lambda: getattr(transformers, BUILT[name])(config))
    assert _refusal(model) == _refusal(model.config) == _refusal(config)


def test_the_text_model_alone_stays_estimable():
    config = _quiet(MULTIMODAL["gemma3"])
    est = llmmem.estimate(config.text_config, batch=2, seq=64)
    assert est.model.layers == 2 and est.model.hidden == 32
    model = _quiet(lambda: transformers.Gemma3ForCausalLM(config.text_config))
    real = sum(p.numel() for p in model.parameters())
    assert llmmem.estimate(model, batch=2, seq=64).parameter_count == real
    assert abs(est.parameter_count / real - 1) <= 0.01, (est.parameter_count, real)


# model types the estimator has no reader for: (model class, config class, tiny fields)
UNREAD = {
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", "bart"),
    "led": ("LEDForConditionalGeneration", "LEDConfig", "bart"),
    "blenderbot": ("BlenderbotForConditionalGeneration", "BlenderbotConfig", "bart"),
    "prophetnet": ("ProphetNetForConditionalGeneration", "ProphetNetConfig", "prophetnet"),
    "fsmt": ("FSMTForConditionalGeneration", "FSMTConfig", "fsmt"),
    "albert": ("AlbertForSequenceClassification", "AlbertConfig", "bert"),
    "deberta-v2": ("DebertaV2ForSequenceClassification", "DebertaV2Config", "bert"),
    "modernbert": ("ModernBertForSequenceClassification", "ModernBertConfig", "bert"),
}
SIZES = {
    "bart": dict(
        vocab_size=128,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64,
    ),
    "prophetnet": dict(
        vocab_size=128,
        hidden_size=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    ),
    "fsmt": dict(
        src_vocab_size=128,
        tgt_vocab_size=128,
        langs=["en", "de"],
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    ),
    "bert": dict(
        vocab_size=128,
        hidden_size=32,
        embedding_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id"), 0),
    ),
}


@pytest.mark.parametrize("name", list(UNREAD))
def test_a_model_instance_is_refused_by_model_type_as_its_config_is(name):
    model_cls, config_cls, sizes = UNREAD[name]
    config = _quiet(lambda: getattr(transformers, config_cls)(**SIZES[sizes]))
    model = _quiet(lambda: getattr(transformers, model_cls)(config))
    text = _refusal(model)
    assert text == _refusal(config), (text, _refusal(config))
    assert text.startswith(f"model: a Hugging Face config of model_type {config.model_type!r}"), text
    assert "task" not in text.split(":")[0]


@pytest.mark.parametrize("kind", ["T5Model", "BartModel", "BertModel", "ViTModel"])
def test_a_headless_model_of_a_family_read_with_a_head_is_refused_by_class(kind):
    transformers = pytest.importorskip("transformers", reason="needs transformers (optional)")
    configs = {
        "T5Model": lambda: transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4
        ),
        "BartModel": lambda: transformers.BartConfig(
            vocab_size=64,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
        ),
        "BertModel": lambda: transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
        ),
        "ViTModel": lambda: transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
        ),
    }
    model = getattr(transformers, kind)(configs[kind]())
    with pytest.raises(ValueError, match=f"a {kind} of model_type .* has no task head"):
        llmmem.estimate(model, batch=2, seq=16)
