"""``llmmem.estimate`` against the built model, per Hugging Face family (issue 27): tiny random-weight
configs on the CPU, fp32, torch's Adam.

For each family it prints and writes (JSON):

- parameters: the estimate from the config alone against the built model's count;
- activations: the estimate (from the config) against the bytes a training step holds when its
  backward starts (every tensor storage made in the forward and still alive,
  :class:`llmmem.checkpointing.meters.ActivationMeter`);
- the whole step: the estimate's ``total`` (and ``peak``, the larger of its two phases), asked of
  the model itself (its parameters counted), against the
  measured peak of a second training step (``zero_grad(set_to_none=True)``, forward, backward,
  ``Adam.step``), live tensor bytes counted exactly by :class:`llmmem.diagnostics.LiveBytes`
  with every tensor already alive (parameters, the optimizer's state made by a first step, inputs).

Not a timing benchmark: the numbers are bytes, the same on every run and machine with the same
torch and transformers. ``--quick`` measures four families (T5, BART, a BERT classifier, ViT).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

# family: (model class, config class, config fields, inputs(batch, seq, target_seq, config) -> the model's kwargs)
BATCH, SEQ, TARGET = 4, 64, 32
DEC = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)


def _lm(b, s, t, c):
    import torch

    ids = torch.randint(0, c.vocab_size, (b, s))
    return dict(input_ids=ids, labels=ids, use_cache=False)


def _seq2seq(b, s, t, c):
    import torch

    return dict(
        input_ids=torch.randint(0, c.vocab_size, (b, s)),
        labels=torch.randint(0, c.vocab_size, (b, t)),
        use_cache=False,
    )


def _classify(b, s, t, c):
    import torch

    return dict(input_ids=torch.randint(0, c.vocab_size, (b, s)), labels=torch.randint(0, c.num_labels, (b,)))


def _tokens(b, s, t, c):
    import torch

    return dict(input_ids=torch.randint(0, c.vocab_size, (b, s)), labels=torch.randint(0, c.num_labels, (b, s)))


def _masked(b, s, t, c):
    import torch

    ids = torch.randint(0, c.vocab_size, (b, s))
    return dict(input_ids=ids, labels=ids)


def _image(b, s, t, c):
    import torch

    return dict(
        pixel_values=torch.randn(b, c.num_channels, c.image_size, c.image_size),
        labels=torch.randint(0, c.num_labels, (b,)),
    )


FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(DEC, intermediate_size=128, num_key_value_heads=2, head_dim=16), _lm),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(DEC, intermediate_size=128, num_key_value_heads=2, head_dim=16), _lm),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(DEC, intermediate_size=128, num_key_value_heads=2, head_dim=16), _lm),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(DEC, intermediate_size=128, num_key_value_heads=2), _lm),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(DEC, intermediate_size=128, num_key_value_heads=2), _lm),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(DEC, multi_query=True), _lm),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=512, n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=256), _lm),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(DEC, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2), _lm),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(DEC, intermediate_size=128, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, head_dim=16, num_key_value_heads=2), _lm),
    "hunyuan-moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(DEC, intermediate_size=96, num_experts=4, moe_topk=2, num_key_value_heads=2, head_dim=16), _lm),
    "ernie4.5-moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(DEC, intermediate_size=128, moe_intermediate_size=48, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2, num_key_value_heads=2), _lm),
    "dbrx": ("DbrxForCausalLM", "DbrxConfig", dict(vocab_size=512, d_model=64, n_layers=4, n_heads=4, max_seq_len=128, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)), _lm),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=512, d_model=64, d_kv=8, d_ff=128, num_layers=3, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0), _seq2seq),
    "flan-t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=512, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0), _seq2seq),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(vocab_size=512, d_model=64, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128), _seq2seq),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", dict(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128, scale_embedding=True), _seq2seq),
    "bert-cls": ("BertForSequenceClassification", "BertConfig", dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, max_position_embeddings=128, num_labels=3), _classify),
    "bert-token": ("BertForTokenClassification", "BertConfig", dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, max_position_embeddings=128, num_labels=5), _tokens),
    "bert-mlm": ("BertForMaskedLM", "BertConfig", dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, max_position_embeddings=128), _masked),
    "roberta-cls": ("RobertaForSequenceClassification", "RobertaConfig", dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, max_position_embeddings=130, num_labels=3), _classify),
    "distilbert-cls": ("DistilBertForSequenceClassification", "DistilBertConfig", dict(vocab_size=512, dim=64, n_layers=4, n_heads=4, hidden_dim=128, max_position_embeddings=128, num_labels=3), _classify),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=64, patch_size=8, num_labels=10), _image),
}  # fmt: skip
QUICK = ("t5", "bart", "bert-cls", "vit")


def build(name: str, seed: int = 0):
    """``(model in train mode, its config, inputs(batch, seq, target_seq) -> kwargs)``."""
    import torch
    import transformers

    model_cls, config_cls, fields, inputs = FAMILIES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(**fields)
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config).train()
    return model, config, lambda b, s, t: inputs(b, s, t, config)


def held_at_backward(model, batch: dict) -> int:
    """Activation bytes alive when the backward starts (parameter gradients not counted)."""
    from llmmem.checkpointing.meters import ActivationMeter

    for p in model.parameters():
        p.grad = None
    with ActivationMeter(list(model.parameters())) as meter:
        model(**batch).loss.backward()
    for p in model.parameters():
        p.grad = None
    return meter.marks["backward"][0]


def step_peak(model, batch: dict) -> int:
    """Peak live tensor bytes of a second Adam step (the first makes the optimizer's state)."""
    import torch

    from llmmem.diagnostics.live import LiveBytes

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    step()
    gc.collect()  # what earlier runs left in reference cycles is not this step's
    with LiveBytes(existing="gc") as live:
        live.reset_peak()
        step()
        peak = live.max_allocated()
    opt.zero_grad(set_to_none=True)
    return peak


def measure(name: str, batch: int = BATCH, seq: int = SEQ, target_seq: int = TARGET) -> dict:
    import llmmem

    model, config, inputs = build(name)
    kwargs = dict(batch=batch, precision="fp32", optimizer="adam", device_type="cpu")
    if name == "vit":
        seq = (config.image_size // config.patch_size) ** 2 + 1
    else:
        kwargs["seq"] = seq
    if getattr(config, "is_encoder_decoder", False):
        kwargs["target_seq"] = target_seq
    data = inputs(batch, seq, target_seq)
    built = sum(p.numel() for p in model.parameters())
    from_config = llmmem.estimate(config, task=_task(model), **kwargs)
    from_model = llmmem.estimate(model, **kwargs)
    held = held_at_backward(model, data)
    peak = step_peak(model, data)
    return {
        "family": name,
        "built_parameters": built,
        "estimated_parameters": from_config.parameter_count,
        "model_parameters": from_model.parameter_count,
        "measured_activations": held,
        "estimated_activations": from_config.activations,
        "measured_peak": peak,
        "estimated_total": from_model.total,
        "estimated_peak": from_model.peak,
    }


def _task(model) -> str | None:
    from llmmem.estimation.hf_encoders import task_of_class

    return task_of_class(type(model).__name__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu only (the estimate's own bytes, not a device's)")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--families", default=None, help="comma-separated subset of: " + ", ".join(FAMILIES))
    ap.add_argument(
        "--json", default=None, help="write the rows here (default benchmarks/results/estimate_families.json)"
    )
    args = ap.parse_args(argv)
    if args.device != "cpu":
        print("bench_estimate_families: CPU only; nothing to do on", args.device)
        return 0
    names = args.families.split(",") if args.families else list(QUICK if args.quick else FAMILIES)
    rows = []
    print(
        f"{'family':<16}{'params est':>11}{'built':>9}{'ratio':>7} {'act est':>12}{'held':>12}{'ratio':>7} "
        f"{'total':>12}{'peak est':>12}{'measured':>12}{'total/m':>8}{'peak/m':>8}"
    )
    for name in names:
        r = measure(name)
        rows.append(r)
        print(
            f"{name:<16}{r['estimated_parameters']:>11,}{r['built_parameters']:>9,}"
            f"{r['estimated_parameters'] / r['built_parameters']:>7.3f} "
            f"{r['estimated_activations']:>12,}{r['measured_activations']:>12,}"
            f"{r['estimated_activations'] / r['measured_activations']:>7.3f} "
            f"{r['estimated_total']:>12,}{r['estimated_peak']:>12,}{r['measured_peak']:>12,}"
            f"{r['estimated_total'] / r['measured_peak']:>8.3f}{r['estimated_peak'] / r['measured_peak']:>8.3f}",
            flush=True,
        )
    path = _harness.write_json(
        "estimate_families", {"batch": BATCH, "seq": SEQ, "target_seq": TARGET, "rows": rows}, args.json
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
