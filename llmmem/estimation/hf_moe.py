"""The Hugging Face decoders whose configs spell their mixture of experts (or their attention) each
its own way, as fields of :class:`llmmem.estimation.model_configs.ModelConfig`, and the ones the
estimator refuses by name because its layer model cannot describe them.

Pure Python, like :mod:`llmmem.estimation.hf_encoders`: reads a config's ``to_dict()`` (or a
``config.json``), imports neither transformers nor torch nor the rest of the estimator.

Read (element counts: ``h`` hidden, ``n`` experts):

- Mixtral's ``num_local_experts``; Qwen-MoE's ``num_experts``, ``moe_intermediate_size``, gated
  shared expert, ``mlp_only_layers`` and ``decoder_sparse_step``; GraniteMoeShared's
  ``shared_intermediate_size``; DeepSeek's ``first_k_dense_replace``;
- HunYuan MoE: every layer a mixture, with a shared MLP of ``intermediate_size`` (no gate) beside
  experts of the same width; ``moe_topk`` an integer or the same one for every layer;
- Ernie 4.5 MoE: experts only from ``moe_layer_start_index`` to ``moe_layer_end_index`` (inclusive;
  -1 the last layer) every ``moe_layer_interval``, ``moe_num_shared_experts`` shared experts of
  ``moe_intermediate_size``, and a router bias of ``n`` a mixture layer;
- DBRX: the sizes nested in ``attn_config`` and ``ffn_config`` (:func:`flat_dbrx`), LayerNorms
  without a bias.

Refused (:func:`refuse_unread`), since a guess would be silently wrong: compressed key/value
attention (DeepSeek V2/V3's multi-head latent attention, any config with ``kv_lora_rank``), JetMoe's
mixture of attention experts, Llama 4's text mixture (Hugging Face runs every expert on every token,
scaled by the router, where the estimator keeps the routed top-k's activations).
"""

from __future__ import annotations

__all__ = ["expert_fields", "flat_dbrx", "refuse_unread"]

_LLAMA4 = ("llama4", "llama4_text")


def refuse_unread(model_type: str, raw: dict) -> None:
    """ValueError naming ``model_type`` and what the estimator cannot read in it, for the families
    above; nothing for any other config."""
    if raw.get("kv_lora_rank") is not None:
        what = (
            "compressed key/value attention (multi-head latent attention: kv_lora_rank, q_lora_rank, "
            "separate rotary and value head sizes)"
        )
    elif model_type == "jetmoe":
        what = "a mixture of attention experts (its attention projections routed per token, top-k of them)"
    elif model_type in _LLAMA4:
        what = (
            "Llama 4's mixture of experts as Hugging Face runs it (every expert on every token, scaled by the "
            "router's sigmoid, where the estimator keeps the activations of the routed top-k)"
        )
    else:
        return
    raise ValueError(
        f"model: a Hugging Face config of model_type {model_type!r}, {what}: the estimator's layer model does not "
        "describe it and does not guess one from this config"
    )


def flat_dbrx(raw: dict) -> dict:
    """A DBRX config's ``to_dict()`` with the sizes of its nested ``attn_config`` and ``ffn_config``
    under the names the decoder reader looks for (``num_key_value_heads``, ``intermediate_size``,
    ``num_local_experts``, ``num_experts_per_tok``, ``hidden_act``, ``rope_theta``, ``clip_qkv``), and no bias on
    its linear layers (``attention_bias`` false) or norms (``norm_bias`` false)."""
    attn = raw.get("attn_config") or {}
    ffn = raw.get("ffn_config") or {}
    if not isinstance(attn, dict) or not isinstance(ffn, dict):
        raise ValueError("model: a DBRX config whose attn_config and ffn_config are not mappings")
    act = ffn.get("ffn_act_fn") or {}
    flat = dict(raw)
    flat.update(
        num_key_value_heads=attn.get("kv_n_heads", 1),
        attention_dropout=attn.get("attn_pdrop", 0.0),
        rope_theta=attn.get("rope_theta", 10000.0),
        intermediate_size=ffn.get("ffn_hidden_size", 3584),
        num_local_experts=ffn.get("moe_num_experts", 4),
        num_experts_per_tok=ffn.get("moe_top_k", 1),
        hidden_act=act.get("name", "silu") if isinstance(act, dict) else "silu",
        num_hidden_layers=raw.get("n_layers"),
        num_attention_heads=raw.get("n_heads"),
        hidden_size=raw.get("d_model"),
        clip_qkv=attn.get("clip_qkv"),
        attention_bias=False,
        norm_bias=False,
        max_position_embeddings=raw.get("max_seq_len", 0),
    )
    return flat


def _moe_layers(raw: dict, layers: int) -> list[bool]:
    """For each layer, whether it has experts (else the dense MLP of ``intermediate_size``)."""
    if raw.get("model_type") == "ernie4_5_moe":
        start = int(raw.get("moe_layer_start_index", 1) or 0)
        end = raw.get("moe_layer_end_index", -1)
        end = layers - 1 if end is None or int(end) < 0 else int(end)
        every = int(raw.get("moe_layer_interval") or 1)
        return [start <= i <= end and (i + 1) % every == 0 for i in range(layers)]
    only = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    return [not (i in only or (i + 1) % step or i < first_dense) for i in range(layers)]


def _top_k(raw: dict, get) -> int:
    top_k = get("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", default=1)
    if isinstance(top_k, (list, tuple)):  # HunYuan: one a layer
        if len(set(top_k)) != 1:
            raise ValueError(
                f"model: a Hugging Face config of model_type {raw.get('model_type')!r} with a different top-k a "
                f"layer (moe_topk {list(top_k)}): the estimator reads one top-k for every layer"
            )
        top_k = top_k[0]
    return top_k


def expert_fields(raw: dict, get) -> dict:
    """The mixture-of-experts fields of ``ModelConfig`` from a Hugging Face config (``get`` reads the
    first of several attribute names that is set); empty for a dense model."""
    experts = get("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 0:
        return {}
    layers = get("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    model_type = raw.get("model_type")
    expert_ffn = get("moe_intermediate_size")
    shared, gate = raw.get("shared_expert_intermediate_size") or 0, False
    if shared:
        gate = True  # Qwen2-MoE's shared expert has a sigmoid gate
    elif raw.get("shared_intermediate_size"):  # GraniteMoeShared: no gate
        shared = raw["shared_intermediate_size"]
    elif model_type == "hunyuan_v1_moe":  # its shared MLP, ungated, as wide as an expert
        shared = raw.get("intermediate_size") or 0
    else:
        count = raw.get("n_shared_experts") or raw.get("moe_num_shared_experts")
        if count and (expert_ffn or raw.get("intermediate_size")):
            shared = int(count) * int(expert_ffn or raw["intermediate_size"])
    moe = _moe_layers(raw, layers)
    fields = dict(
        experts=experts,
        experts_per_token=_top_k(raw, get),
        expert_ffn=expert_ffn,
        shared_ffn=int(shared),
        shared_gate=gate,
        dense_layers=moe.count(False),
    )
    if model_type == "ernie4_5_moe":  # the router's score correction bias, (1, n) a mixture layer
        fields["extra_tensors"] = (experts,) * moe.count(True)
    return fields
