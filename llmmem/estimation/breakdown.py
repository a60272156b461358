"""Every number of an estimate: model state, activations under the chosen checkpointing, the
largest temporary, and the expected slowdown of the memory techniques."""

from __future__ import annotations

import math

from llmmem.estimation.activations import (
    CROSS,
    SCORE_TERMS,
    ceil_div,
    element_bytes,
    head_loss_terms,
    head_rows,
    head_width,
    materialises_scores,
    other_activation_terms,
    stack_layer_terms,
)
from llmmem.estimation.model_configs import ModelConfig
from llmmem.estimation.model_state import MIN_QUANTIZED_NUMEL, config_tensors, llmmem_state, sharded_tensors
from llmmem.estimation.settings import OPTIMIZERS, PRECISIONS, Settings

__all__ = ["compute", "flops", "slowdown_terms", "ZERO3_SLOWDOWN", "TP_SLOWDOWN_PER_DOUBLING"]

# --- the slowdown model (fractions of one training step; assumptions, not measurements) --------
# Recompute costs are FLOP ratios computed per model (see slowdown_terms). Communication costs depend on
# the interconnect, so they are stated constants:
# - ZeRO stages 1 and 2 move the same volume as DDP's gradient all-reduce (2Ψ: reduce-scatter +
#   all-gather; Rajbhandari et al. 2020, section 7), so they cost nothing extra here.
# - ZeRO-3 moves 3Ψ (an extra parameter all-gather per pass): +50% data-parallel traffic. We
#   assume that traffic is partly exposed and costs ~10% of a step.
ZERO3_SLOWDOWN = 0.10
# - Tensor parallelism adds 4 all-reduces of s·b·h activations per layer and step (Narayanan et al.
#   2021); within one NVLink node we assume ~5% of a step per doubling of t. The search stays in one
#   node (t <= 8). Sequence parallelism replaces each all-reduce by a reduce-scatter + all-gather of
#   the same volume (Korthikanti et al. 2022, section 4.2.2): no extra cost.
TP_SLOWDOWN_PER_DOUBLING = 0.05


def flops(cfg: ModelConfig, st: Settings) -> tuple[int, int, int]:
    """(layer forward, attention-core forward, whole step) FLOPs, 2 per multiply-add.

    Layer: ``2sb·(h(h + 2kd) + h² + n·h·f)`` for the projections (``n`` = 2 GELU, 3 SwiGLU) plus
    ``4·s²·b·h`` for QK^T and P·V. Step = 3 x forward (backward ≈ 2 x forward; Kaplan et al. 2020),
    forward = layers + the LM head ``2·s·b·h·V``.
    """
    s, b, h, f = st.seq, st.batch, cfg.hidden, cfg.ffn
    n = 2 if cfg.mlp == "gelu" else 3
    core = 4 * s * s * b * h
    layer = 2 * s * b * (h * (h + 2 * cfg.kv_heads * cfg.head_dim) + h * h + n * h * f) + core
    forward = cfg.layers * layer
    if cfg.architecture == "encoder-decoder":
        # the decoder's layers at its length q, with cross-attention: Q and output projections of
        # its q tokens, K and V of the encoder's s, and the q x s core
        q = st.decoder_seq
        self_ = 2 * q * b * (h * (h + 2 * cfg.kv_heads * cfg.head_dim) + h * h + n * h * f) + 4 * q * q * b * h
        cross = 2 * q * b * 2 * h * h + 2 * s * b * 2 * h * cfg.kv_heads * cfg.head_dim + 4 * q * s * b * h
        forward += cfg.decoder_layers * (self_ + cross)
    step = 3 * (forward + 2 * head_rows(cfg, st) * h * head_width(cfg))
    return layer, core, step


def slowdown_terms(cfg: ModelConfig, st: Settings) -> dict:
    """Expected extra step time, as fractions of a step without any technique, by cause.

    - full / every-K recompute: one extra forward of each recomputed layer, ``n_r·F_layer / F_step``
      (≈ 1/3 for full recompute: Chen et al. 2016; Korthikanti et al. 2022 measure 30-40%);
    - selective recompute: the attention core (QK^T, softmax, dropout, P·V) again,
      ``L·4s²bh / F_step`` (Korthikanti et al. report 2-4% in time: softmax and dropout are
      memory-bound, which FLOPs undercount); nothing with a fused kernel, which keeps no scores;
    - ZeRO-3 (data_parallel > 1): :data:`ZERO3_SLOWDOWN`; stages 1-2: 0 (same traffic as DDP);
    - tensor parallel: :data:`TP_SLOWDOWN_PER_DOUBLING` x log2(t); sequence parallel: 0;
    - fused attention instead of explicit: 0 (flash attention is usually faster; we claim nothing).
    """
    layer, core, step = flops(cfg, st)
    parts = {}
    n_r = st.recomputed_layers(cfg.layers) + st.recomputed_layers(cfg.decoder_layers)
    if n_r:
        parts["recompute"] = n_r * layer / step
    elif st.checkpointing == "selective" and materialises_scores(cfg, st):
        parts["selective recompute"] = cfg.total_layers * core / step
    if st.zero_stage == 3 and st.data_parallel > 1:
        parts["ZeRO-3 parameter gathers"] = ZERO3_SLOWDOWN
    if st.tensor_parallel > 1:
        parts["tensor-parallel collectives"] = TP_SLOWDOWN_PER_DOUBLING * math.log2(st.tensor_parallel)
    return parts


def model_state(cfg: ModelConfig, counted: int | None, st: Settings, shapes=None) -> tuple[dict, dict, int, int]:
    """(bytes of parameters, gradients, master weights and optimizer state per device, what they
    are made of, parameters in all, parameters per device).

    ``shapes``: an ``nn.Module``'s parameter shapes (its ``counted`` parameters), else the tensors
    are :func:`~llmmem.estimation.model_state.config_tensors`. Only llmmem's formats and the step in
    backward need the tensors one by one."""
    t, n_d = st.tensor_parallel, st.data_parallel
    prec = PRECISIONS[st.precision]
    total_params = cfg.parameters(seq=st.seq)
    device_params = cfg.parameters(seq=st.seq, tensor_parallel=t)
    if counted is not None:  # an nn.Module: its real count, split across TP as the formula splits
        device_params = ceil_div(counted * device_params, total_params)
        total_params = counted

    def part(per_param: int, sharded: bool) -> int:
        return ceil_div(device_params * per_param, n_d if sharded else 1)

    master = 4 if st.master_weights else 0
    out = {
        "parameters": part(prec["param"], st.zero_stage >= 3),
        "gradients": part(prec["grad"], st.zero_stage >= 2),
        "master_weights": part(master, st.zero_stage >= 1),
    }
    terms: dict = {}
    dtype = st.state_dtype
    if dtype is None and not st.step_in_backward:
        out["optimizer_state"] = part(prec["moment"] * OPTIMIZERS[st.optimizer], st.zero_stage >= 1)
        return out, terms, total_params, device_params
    tensors = config_tensors(cfg, st.seq, t) if shapes is None else sharded_tensors(shapes, t)
    if dtype is None:
        out["optimizer_state"] = part(prec["moment"] * OPTIMIZERS[st.optimizer], st.zero_stage >= 1)
    else:
        mq = MIN_QUANTIZED_NUMEL if st.min_quantized_numel is None else st.min_quantized_numel
        count = llmmem_state(dtype, tensors, st.block_size, mq)
        terms.update(
            state_dtype=dtype,
            state_bytes_per_parameter=count.bytes / max(1, sum(tensors)),
            kept_fp32_tensors=count.kept_fp32,
            kept_fp32_numel=count.kept_fp32_numel,
        )
        out["optimizer_state"] = ceil_div(count.bytes, n_d if st.zero_stage >= 1 else 1)
    if st.step_in_backward and tensors:  # (data_parallel is 1: see settings)
        # each gradient is freed once its parameter is stepped: the largest is what stays at most
        terms["largest_gradient_numel"] = max(tensors)
        out["gradients"] = max(tensors) * prec["grad"]
    return out, terms, total_params, device_params


def _mlp_part(terms: dict) -> int:
    """Bytes of a layer's terms from its MLP's input on (the cross-attention's, listed after them
    but run before the MLP, left out): what the layer's backward frees before its attention's."""
    keys = list(terms)
    if "mlp input" not in keys:
        return 0
    return sum(terms[k] for k in keys[keys.index("mlp input") :] if not k.startswith(CROSS))


def compute(cfg: ModelConfig, counted: int | None, st: Settings, layer_scale: float = 1.0, shapes=None) -> dict:
    """Every number of an :class:`Estimate`, in bytes per device. ``layer_scale``: the layer's
    activation terms times this (a measured layer over the formula's, see ``estimate(measure=)``);
    ``shapes``: an ``nn.Module``'s parameter shapes (see :func:`model_state`)."""
    t, n_d = st.tensor_parallel, st.data_parallel
    prec = PRECISIONS[st.precision]
    out, state_terms, total_params, device_params = model_state(cfg, counted, st, shapes)

    # Each stack (an encoder-decoder has two, of different lengths and layers) on its own: a
    # recomputed layer keeps only its input, e·sbh (divided by t with sequence parallelism), and
    # every-K recompute counts layers 0, K, 2K, ... of each stack.
    e, _, r, _ = element_bytes(cfg, st)
    stacks = []
    for stack, layers, seq, terms in stack_layer_terms(cfg, st):
        if layer_scale != 1.0:
            terms = {k: round(v * layer_scale) for k, v in terms.items()}
        full = sum(terms.values())
        scores = sum(terms.get(k, 0) for k in SCORE_TERMS)
        stored = full - scores if st.checkpointing == "selective" else full
        n_r = st.recomputed_layers(layers)
        kept = n_r * ceil_div(e * seq * st.batch * cfg.hidden, r) + (layers - n_r) * stored
        stacks.append((stack, terms, full, scores, n_r, kept))
    if len(stacks) == 1:
        layer_terms = stacks[0][1]
    else:
        layer_terms = {f"{stack} layer: {k}": v for stack, terms, *_ in stacks for k, v in terms.items()}
    # the largest layer's: what one layer without recompute (or one recomputed) holds
    _, _, full_layer, score_bytes, _, _ = max(stacks, key=lambda x: x[2])
    n_r = sum(x[4] for x in stacks)
    other_terms = other_activation_terms(cfg, st)
    out["activations_per_layer"] = full_layer
    out["activations_layers"] = sum(x[5] for x in stacks)
    out["activations_other"] = sum(other_terms.values())
    out["activations"] = out["activations_layers"] + out["activations_other"]

    # Largest transient buffer, beyond what is stored: either the head and loss's (the plain head's
    # backward holds the fp32 gradients of the log-probabilities and of the logits together; the
    # fused head's forward one chunk of logits) or one layer's backward: the gradients of the
    # s x s probabilities and scores (explicit attention), the activations it recomputes, and under
    # ZeRO-3 its gathered parameters (one layer; prefetching more is not counted).
    s, b = st.seq, st.batch
    layer_tmp = {}
    if score_bytes:
        pairs = max(s * s, st.decoder_seq * max(s, st.decoder_seq)) if cfg.stacks == 2 else s * s
        layer_tmp["gradients of attention probabilities and scores"] = 2 * ceil_div(e * cfg.heads * pairs * b, t)
    if n_r:
        layer_tmp["one recomputed layer's activations"] = full_layer
    elif st.checkpointing == "selective" and score_bytes:
        layer_tmp["one layer's recomputed attention scores"] = score_bytes
    if st.zero_stage == 3 and n_d > 1:
        largest = cfg.layer_parameters(t) + cfg.cross_attention_parameters(t)
        layer_tmp["one layer's gathered parameters (ZeRO-3)"] = largest * prec["param"]
    state = sum(out[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state"))
    rest = out["activations"] - sum(head_loss_terms(cfg, st)[0].values())  # all but the head and loss
    head_loss = {}
    for name, fused in (("plain", False), ("fused", True)):
        kept, loss_tmp = head_loss_terms(cfg, st, fused)
        tmp = loss_tmp if sum(loss_tmp.values()) >= sum(layer_tmp.values()) else layer_tmp
        head_loss[name] = {
            "kept": sum(kept.values()),
            "temporary": sum(loss_tmp.values()),
            "temporary_terms": loss_tmp,
            "total": state + rest + sum(kept.values()) + sum(tmp.values()),
        }
        if fused == st.fused_head:
            out["temporary"], temporary_terms = sum(tmp.values()), tmp
            head_kept, head_tmp = sum(kept.values()), sum(loss_tmp.values())
    out["total"] = sum(
        out[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state", "activations", "temporary")
    )
    # The peak of a step that starts without gradients (zero_grad(set_to_none=True), torch's
    # default): the larger of its two phases. When backward starts, every activation is alive but
    # no gradient exists yet; when it ends, every gradient exists, the activations are freed, and
    # the last layer's backward holds its transients. ``total`` adds all of them at once: the
    # peak of a step whose gradients are already held (gradient accumulation, set_to_none=False).
    # By the time the last layer's attention makes its transients, backward has freed what the
    # head and that layer's MLP kept (without recompute, which remakes them instead).
    released = head_kept + (_mlp_part(stacks[-1][1]) if not n_r else 0)
    start = state - out["gradients"] + out["activations"] + max(head_tmp, sum(layer_tmp.values()) - released)
    end = state + sum(layer_tmp.values())
    out["peak"] = max(start, end)
    slow = slowdown_terms(cfg, st)
    return {
        "bytes": out,
        "layer_terms": layer_terms,
        "other_terms": other_terms,
        "temporary_terms": temporary_terms,
        "head_loss": head_loss,
        "state_terms": state_terms,
        "parameter_count": total_params,
        "parameters_per_device": device_params,
        "slowdown": sum(slow.values()),
        "slowdown_terms": slow,
    }
