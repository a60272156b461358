"""The head a Hugging Face model's class has, read or refused by the class's name, never guessed:
``BertForQuestionAnswering`` (a start and an end logit a token, no pooler) read as question
answering, ``T5EncoderModel`` (T5's encoder alone) refused rather than read as the whole
encoder-decoder. Tiny random-weight models on the CPU in fp32."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from support.planner import step_memory

import llmmem
from llmmem.__main__ import main
from llmmem.estimation.model_configs import from_hf_config

transformers = pytest.importorskip("transformers", reason="the Hugging Face families need transformers (optional)")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BERT = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
)
T5 = dict(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4, decoder_start_token_id=0)
FP32 = dict(precision="fp32", optimizer="adam", device_type="cpu")


def _quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_question_answering_is_read_as_its_own_head(family):
    config_cls, model_cls = {
        "bert": ("BertConfig", "BertForQuestionAnswering"),
        "roberta": ("RobertaConfig", "RobertaForQuestionAnswering"),
    }[family]
    config = _quiet(lambda: getattr(transformers, config_cls)(**BERT))
    torch.manual_seed(0)
    model = _quiet(lambda: getattr(transformers, model_cls)(config)).train()
    real = sum(p.numel() for p in model.parameters())
    est = llmmem.estimate(model, batch=2, seq=48, **FP32)
    assert est.model.task == "question-answering" and "task question-answering, 2 labels" in str(est)
    assert est.parameter_count == real
    # from the config: no pooler, qa_outputs of 2 x hidden and its bias
    cfg = from_hf_config(config, task="question-answering")
    assert cfg.parameters(seq=48) == real, (cfg.parameters(seq=48), real)
    assert "last hidden states (the classifier reads a view of the first token)" not in est.other_terms
    assert est.other_terms["targets (int64)"] == 8 * 2 * 2  # a start and an end position a sequence
    for b, s in ((2, 48), (3, 32)):
        ids = torch.randint(0, 256, (b, s))
        pos = dict(start_positions=torch.randint(0, s, (b,)), end_positions=torch.randint(0, s, (b,)))
        _, held = step_memory(model, lambda: model(input_ids=ids, **pos).loss.backward())
        got = llmmem.estimate(model, batch=b, seq=s, **FP32).activations
        print(f"{model_cls} b{b} s{s}: estimated {got}, measured {held}")
        assert abs(got / held - 1) <= 0.02, (got, held)


def test_question_answering_from_a_config_json(tmp_path, capsys):
    config = _quiet(lambda: transformers.BertConfig(**BERT, architectures=["BertForQuestionAnswering"]))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert main(["estimate", str(tmp_path), "--seq", "48", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["task"] == "question-answering"
    assert out["bytes"]["total"] == llmmem.estimate(config, seq=48).total


def test_distilbert_question_answering_is_refused_by_task():
    config = transformers.DistilBertConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    model = _quiet(lambda: transformers.DistilBertForQuestionAnswering(config))
    with pytest.raises(ValueError, match="task: 'question-answering' is not a head of model_type 'distilbert'"):
        llmmem.estimate(model, batch=2, seq=32)


@pytest.mark.parametrize("cls", ["T5EncoderModel", "MT5EncoderModel"])
def test_an_encoder_only_class_of_an_encoder_decoder_is_refused_by_name(cls):
    config_cls = "MT5Config" if cls.startswith("MT5") else "T5Config"
    model = _quiet(lambda: getattr(transformers, cls)(getattr(transformers, config_cls)(**T5)))
    with pytest.raises(ValueError) as info:
        llmmem.estimate(model, batch=2, seq=48, **FP32)
    text = str(info.value)
    for w in (cls, "encoder alone", f"model_type '{model.config.model_type}'", "does not guess"):
        assert w in text, (w, text)
    # the whole model of the same config is still read
    full = _quiet(lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)))
    assert llmmem.estimate(full, batch=2, seq=48).model.architecture == "encoder-decoder"
