"""The activation model: the bytes each operator of a transformer layer (and of the embeddings, head
and loss) keeps for backward, per device, from the model's architecture and the run settings."""

from __future__ import annotations

import dataclasses

from llmmem.estimation.model_configs import ModelConfig
from llmmem.estimation.settings import PRECISIONS, Settings

__all__ = [
    "ceil_div",
    "materialises_scores",
    "element_bytes",
    "SCORE_TERMS",
    "layer_activation_terms",
    "decoder_layer_activation_terms",
    "stack_layer_terms",
    "other_activation_terms",
    "head_loss_terms",
    "fused_head_chunk_rows",
    "FUSED_HEAD_MIN_CHUNK_BYTES",
    "FUSED_HEAD_MIN_CHUNK_ROWS",
    "megatron_layer_activation_bytes",
]

# llmmem.head.chunks' memory target: a chunk's logits take at most max(this, the hidden states'
# bytes) in fp32, but a chunk has at least FUSED_HEAD_MIN_CHUNK_ROWS rows (the same constants,
# kept here so that naming a model imports no torch)
FUSED_HEAD_MIN_CHUNK_BYTES = 32 << 20
FUSED_HEAD_MIN_CHUNK_ROWS = 256
# fp32 numbers a row of a chunk the fused head keeps at once beside the logits (row maximum, sum,
# target logit and sum of logits; loss, log-sum-exp, scale and the reductions' temporaries)
_FUSED_ROW_FLOATS = 8


def ceil_div(x: int, t: int) -> int:
    return -(-x // t)  # ceil: a rank holds whole elements


def materialises_scores(cfg: ModelConfig, st: Settings) -> bool:
    """Whether attention keeps ``s x s`` tensors for backward.

    Explicit attention does. A fused kernel (flash / memory-efficient SDPA) does not, except that
    PyTorch's CPU flash kernel has no dropout, so SDPA on CPU with dropout > 0 falls back to the math
    path, which saves the same ``s x s`` tensors as explicit attention (checked with saved_tensors_hooks
    on torch 2.11), and key/value heads handed to SDPA broadcast (``cfg.kv_broadcast``, Falcon's
    multi-query attention) take the math path on every device: torch's fused kernels need as many
    key/value heads as query heads unless ``enable_gqa`` is set.
    """
    if st.attention == "explicit" or cfg.kv_broadcast:  # (the math path, on every device)
        return True
    return st.device_type == "cpu" and cfg.attention_dropout > 0


def kv_heads_saved(cfg: ModelConfig, st: Settings) -> int:
    """Key/value heads whose K and V are kept: explicit attention (and the math path SDPA falls back
    to) repeats grouped key/value heads to every query head before the products that keep them;
    a fused kernel takes the grouped ones as they are."""
    return cfg.heads if materialises_scores(cfg, st) else cfg.kv_heads


# Tensors of the MLP width an activation keeps beyond its output (which the down projection keeps):
# GELU and SiLU their input, ReLU none, gelu_new's elementwise operators input, tanh, x/2, 1 + tanh.
_ACTIVATION_SAVES = {"gelu": 1, "silu": 1, "relu": 0, "gelu_new": 4}


def element_bytes(cfg: ModelConfig, st: Settings) -> tuple[int, int, int, int]:
    """``(e, m, r, stat)``: bytes per activation element; per dropout-mask element (a CUDA dropout
    keeps a bool mask, a CPU one a noise tensor of the activation dtype); the divisor of the
    activations outside the tensor-parallel regions (``t`` with sequence parallelism, else 1); and
    the fp32 norm statistics per token (mean and rstd for LayerNorm, rstd only for RMSNorm)."""
    e = PRECISIONS[st.precision]["activation"]
    mask = 1 if st.device_type == "cuda" else e
    r = st.tensor_parallel if st.sequence_parallel else 1
    stat = 8 if cfg.norm == "layernorm" else 4
    return e, mask, r, stat


# Terms that hold s x s tensors: what Megatron's selective recompute drops (a decoder layer of an
# encoder-decoder has them twice, the second time under the cross-attention's prefix).
_SCORES = (
    "attention soft-cap (tanh output)",
    "attention probabilities (softmax output)",
    "attention dropout mask",
    "attention dropout output",
)
CROSS = "cross-attention: "
SCORE_TERMS = _SCORES + tuple(CROSS + k for k in _SCORES)


def layer_activation_terms(cfg: ModelConfig, st: Settings) -> dict:
    """Bytes one transformer layer saves for backward on one device, term by term (no recompute).

    Derived from what each op of a pre-norm layer saves in PyTorch's autograd, with ``s`` sequence,
    ``b`` micro-batch, ``h`` hidden, ``a`` heads of size ``d`` (``A = a·d``, ``h`` unless
    ``head_dim`` says otherwise), ``k`` kv heads (``k' = a`` where the attention repeats them, see
    :func:`kv_heads_saved`), ``f`` MLP width, ``e`` bytes per activation element (4 fp32, 2
    fp16/bf16), ``m`` bytes per dropout-mask element, ``t`` tensor-parallel size and ``r = t`` with
    sequence parallelism, else 1:

    ==============================================  ===========================  ==========
    term                                            bytes                        Megatron
    ==============================================  ===========================  ==========
    two norm inputs                                 ``2·e·sbh / r``              4sbh
    norm statistics (fp32 mean+rstd / rstd)         ``2·8·sb / r`` / ``2·4·sb/r``  (omitted)
    unfused RMSNorm (fp32 input, normalized)        ``2·4·sbh / r``
    Q/K/V projection input                          ``e·sbh / r``                2sbh
    Q, K, V (inputs of QK^T and of P·V)             ``e·sb·(A + 2k'd) / t``      6sbh
    softmax output                                  ``e·a·s²·b / t``             2as²b
    attention dropout mask, dropout output          ``(m + e)·a·s²·b / t``       3as²b
    attention output projection input               ``e·sbA / t``                2sbh
    residual dropout mask after attention           ``m·sbh / r``                sbh
    MLP input                                       ``e·sbh / r``                2sbh
    GELU input and output (down-projection input)   ``2·e·sbf / t``              16sbh
    (gelu_new: also tanh, x/2, 1 + tanh)            ``+3·e·sbf / t``
    (SwiGLU: gate out, SiLU out, up out, product)   ``4·e·sbf / t``
    residual dropout mask after the MLP             ``m·sbh / r``                sbh
    ==============================================  ===========================  ==========

    With ``e = 2``, ``m = 1`` (a CUDA dropout keeps a bool mask), ``f = 4h``, ``k = a``, a fused
    LayerNorm, torch's GELU and dropout, the sum is ``sbh·(34 + 5as/h)/t``-shaped exactly as
    Megatron-LM's formula (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", section 4.1 and table 2; see :func:`megatron_layer_activation_bytes`) plus
    the small norm statistics it omits. On CPU, PyTorch's dropout multiplies by a noise tensor of
    the activation dtype instead, so ``m = e``. Without dropout (LLaMA) the masks and the dropout
    output vanish and P·V reads the softmax output. A fused attention kernel (``attention="sdpa"``)
    keeps no ``s x s`` tensor; besides Q, K, V it saves its output, which it lays out as
    ``(b, s, a, d)`` so that the output projection's input is a view of the same storage (counted
    once, as the projection input), and the fp32 log-sum-exp, ``4·a·s·b/t``. An RMSNorm written
    from elementwise operators (Hugging Face, Meta) keeps its input upcast to fp32 (the input itself
    in fp32) and the normalized tensor before the weight: ``4·sbh`` more than one kernel would,
    whatever ``e``.

    Not counted: explicit attention with ``masked_fill`` also saves the ``s x s`` bool causal mask
    (``s²`` bytes per layer, independent of batch and heads), which a fused scale-mask-softmax
    (Megatron) does not.
    """
    s, b, h, t = st.seq, st.batch, cfg.hidden, st.tensor_parallel
    e, mask, r, stat = element_bytes(cfg, st)
    sbh, a, f, d = s * b * h, cfg.heads, cfg.ffn, cfg.head_dim
    width = a * d

    # parallel attention and MLP (Falcon) read one norm's output: one norm, one input
    norms = 1 if cfg.parallel_attention else 2
    terms = {
        f"norm inputs ({norms})": ceil_div(norms * e * sbh, r),
        "norm statistics (fp32)": ceil_div(norms * stat * s * b, r),
    }
    if not cfg.fused_norm:
        terms["unfused norms (fp32 input, normalized)"] = ceil_div(norms * 4 * sbh, r)
    terms["q/k/v projection input"] = ceil_div(e * sbh, r)
    if cfg.qk_norm != "none":
        # each of them an unfused norm of the queries and of the keys: its input, its fp32
        # normalized output, a statistic a head (or a token)
        qk = width + cfg.kv_heads * d
        rows = (a + cfg.kv_heads) if cfg.qk_norm == "head" else 2
        terms["q/k norms (input, fp32 normalized, statistics)"] = ceil_div(s * b * ((e + 4) * qk + 4 * rows), t)
    terms["q, k, v"] = ceil_div(e * s * b * (width + 2 * kv_heads_saved(cfg, st) * d), t)
    if cfg.clip_qkv:
        # DBRX clamps the fused projection's output: the clamp keeps its input, and V, a view of
        # the clamped output, keeps all of it (Q and K are rotated copies), both e·sb·(A + 2kd)
        qkv = e * s * b * (width + 2 * cfg.kv_heads * d)
        terms["q/k/v clamp input (the fused projection's output)"] = ceil_div(qkv, t)
        terms["clamped q/k/v beyond v (v's view keeps all of it)"] = ceil_div(qkv - e * s * b * cfg.kv_heads * d, t)
    if materialises_scores(cfg, st):
        if cfg.attention_softcap:
            terms["attention soft-cap (tanh output)"] = ceil_div(e * a * s * s * b, t)
        terms["attention probabilities (softmax output)"] = ceil_div(e * a * s * s * b, t)
        if cfg.attention_dropout > 0:
            terms["attention dropout mask"] = ceil_div(mask * a * s * s * b, t)
            terms["attention dropout output"] = ceil_div(e * a * s * s * b, t)
    else:
        terms["attention log-sum-exp (fp32)"] = ceil_div(4 * a * s * b, t)
    terms["attention projection input"] = ceil_div(e * s * b * width, t)
    if cfg.hidden_dropout > 0:
        terms["attention residual dropout mask"] = ceil_div(mask * sbh, r)
    if cfg.sandwich_norm:
        # Gemma's norms of the attention's and the MLP's outputs: each keeps its input and its
        # fp32 normalized output (as an unfused RMSNorm) and a statistic a token
        terms["norms after attention and mlp (2)"] = ceil_div(2 * ((e + 4) * sbh + stat * s * b), r)
    if not cfg.parallel_attention:  # else the q/k/v projection's input, counted above
        terms["mlp input"] = ceil_div(e * sbh, r)
    if cfg.experts:
        terms.update(_expert_terms(cfg, st, e, t))
    else:
        terms.update(_mlp_terms(cfg, e, s * b, f, t))
    if cfg.activation_dropout > 0:
        # dropout on the MLP's hidden (T5, BART): its mask, and a ReLU's output, which its backward
        # keeps, is no longer the down projection's input (the dropout's output is)
        terms["mlp hidden dropout mask"] = ceil_div(mask * s * b * f, t)
        if cfg.mlp == "gelu" and cfg.activation == "relu":
            terms["relu output (the dropout's input)"] = ceil_div(e * s * b * f, t)
    if cfg.hidden_dropout > 0:
        terms["mlp residual dropout mask"] = ceil_div(mask * sbh, r)
    return terms


def decoder_layer_activation_terms(cfg: ModelConfig, st: Settings) -> dict:
    """Bytes a decoder layer of an encoder-decoder saves for backward: the terms of
    :func:`layer_activation_terms` at the decoder's length (``s_t``, ``st.decoder_seq``), then its
    cross-attention's (prefixed ``cross-attention: ``), with ``s`` the encoder's length:

    ====================================================  ==========================================
    norm input, its statistics (an unfused RMSNorm more)  ``e·s_t·bh / r``, ``8·s_t·b / r`` (or ``4``)
    Q projection input, Q                                 ``e·s_t·bh / r``, ``e·s_t·bA / t``
    K, V (projected from the encoder's output)            ``2·e·sb·k'd / t``
    probabilities, dropout mask and output (explicit)     ``(e [+ m + e])·a·s_t·s·b / t``
    log-sum-exp (a fused kernel)                          ``4·a·s_t·b / t``
    output projection input, residual dropout mask        ``e·s_t·bA / t``, ``m·s_t·bh / r``
    ====================================================  ==========================================

    The encoder's output, which every decoder layer's K and V projections read, is counted once,
    outside the layers (:func:`other_activation_terms`)."""
    terms = layer_activation_terms(cfg, dataclasses.replace(st, seq=st.decoder_seq))
    s, q, b, h, t = st.seq, st.decoder_seq, st.batch, cfg.hidden, st.tensor_parallel
    e, mask, r, stat = element_bytes(cfg, st)
    a, d = cfg.heads, cfg.head_dim
    qbh = q * b * h
    cross = {"norm input": ceil_div(e * qbh, r), "norm statistics (fp32)": ceil_div(stat * q * b, r)}
    if not cfg.fused_norm:
        cross["unfused norm (fp32 input, normalized)"] = ceil_div(4 * qbh, r)
    cross["q projection input"] = ceil_div(e * qbh, r)
    cross["q"] = ceil_div(e * q * b * a * d, t)
    cross["k, v (from the encoder's output)"] = ceil_div(2 * e * s * b * kv_heads_saved(cfg, st) * d, t)
    if materialises_scores(cfg, st):
        cross["attention probabilities (softmax output)"] = ceil_div(e * a * q * s * b, t)
        if cfg.attention_dropout > 0:
            cross["attention dropout mask"] = ceil_div(mask * a * q * s * b, t)
            cross["attention dropout output"] = ceil_div(e * a * q * s * b, t)
    else:
        cross["attention log-sum-exp (fp32)"] = ceil_div(4 * a * q * b, t)
    cross["attention projection input"] = ceil_div(e * q * b * a * d, t)
    if cfg.hidden_dropout > 0:
        cross["residual dropout mask"] = ceil_div(mask * qbh, r)
    terms.update({CROSS + k: v for k, v in cross.items()})
    return terms


def stack_layer_terms(cfg: ModelConfig, st: Settings) -> list[tuple[str, int, int, dict]]:
    """``(stack, layers, sequence length, one layer's terms)`` for each stack of ``cfg``: the
    layers of a decoder-only model or an encoder at ``st.seq`` (a mixture of experts with dense
    layers as two: its dense layers, its mixture layers); an encoder-decoder's encoder at
    ``st.seq`` and its decoder (with cross-attention) at ``st.decoder_seq``."""
    if cfg.architecture != "encoder-decoder" and cfg.experts and cfg.dense_layers:
        # a mixture whose first (DeepSeek), interleaved (Qwen2-MoE) or outer (Ernie 4.5) layers are
        # dense: those keep a dense MLP's activations (listed first: the last layer is a mixture's
        # in most of them, and backward starts there)
        dense = dataclasses.replace(
            cfg, experts=0, experts_per_token=0, expert_ffn=None, shared_ffn=0, shared_gate=False, dense_layers=0
        )
        return [
            ("dense", cfg.dense_layers, st.seq, layer_activation_terms(dense, st)),
            ("mixture-of-experts", cfg.moe_layers, st.seq, layer_activation_terms(cfg, st)),
        ]
    if cfg.architecture != "encoder-decoder":
        return [(cfg.architecture, cfg.layers, st.seq, layer_activation_terms(cfg, st))]
    return [
        ("encoder", cfg.layers, st.seq, layer_activation_terms(cfg, st)),
        ("decoder", cfg.decoder_layers, st.decoder_seq, decoder_layer_activation_terms(cfg, st)),
    ]


def _mlp_terms(cfg: ModelConfig, e: int, rows: int, f: int, t: int, what: str = "mlp") -> dict:
    """What an MLP of width ``f`` keeps for ``rows`` tokens, past its input."""
    terms = {}
    act, sbf = cfg.activation, rows * f
    if cfg.mlp == "gelu":
        if _ACTIVATION_SAVES[act]:
            terms[f"{act} input" + (", tanh, x/2, 1 + tanh" if act == "gelu_new" else "")] = ceil_div(
                _ACTIVATION_SAVES[act] * e * sbf, t
            )
        terms[f"mlp down-projection input ({act} output)"] = ceil_div(e * sbf, t)
    else:
        terms[f"gate projection output ({act} input)"] = ceil_div(e * sbf, t)
        terms[f"{act} output"] = ceil_div(e * sbf, t)
        terms["up projection output"] = ceil_div(e * sbf, t)
        terms[f"mlp down-projection input ({act}·up)"] = ceil_div(e * sbf, t)
        if act == "gelu_new":
            terms["gelu_new tanh, x/2, 1 + tanh"] = ceil_div(3 * e * sbf, t)
    if what != "mlp":
        terms = {f"{what}: {k.removeprefix('mlp ')}": v for k, v in terms.items()}
    return terms


def _expert_terms(cfg: ModelConfig, st: Settings, e: int, t: int) -> dict:
    """A mixture-of-experts MLP (Hugging Face's Mixtral and Qwen-MoE blocks): the router's fp32
    softmax and top-k indices and weights, each token's copy gathered for each of the
    ``experts_per_token`` experts it runs, those experts' MLP activations (``k`` rows a token, of
    width ``expert_ffn``), their outputs kept for the routing weight's gradient, and the shared
    experts as a dense MLP (with its gate's sigmoid)."""
    rows, h, k, n = st.seq * st.batch, cfg.hidden, cfg.experts_per_token, cfg.experts
    terms = {
        "router probabilities (fp32 softmax)": 4 * rows * n,
        "routing indices (int64) and weights": rows * k * (8 + e),
        "expert inputs (a token's copy for each of its experts)": e * rows * k * h,
    }
    for key, v in _mlp_terms(cfg, e, rows * k, cfg.expert_ffn, t, "experts").items():
        terms[key] = v
    terms["expert outputs (for the routing weights' gradient)"] = e * rows * k * h
    if cfg.shared_ffn:
        terms.update(_mlp_terms(cfg, e, rows, cfg.shared_ffn, t, "shared experts"))
        if cfg.shared_gate:
            terms["shared experts' gate (sigmoid output)"] = e * rows
    return terms


def other_activation_terms(cfg: ModelConfig, st: Settings) -> dict:
    """Bytes saved for backward outside the transformer layers, on one device.

    Token ids and targets are int64 (``8·sb``); a learned position table also saves its ids
    (``8·s``), rotary positions their cos and sin tables, which every layer shares (``2·e·s·d``),
    T5's relative positions the ``s x s`` int64 bucket of each pair of positions; the embedding
    dropout keeps a mask (``m·sbh/r``); the final norm keeps its input and statistics (an unfused
    RMSNorm ``4·sbh/r`` more; an encoder's is its embeddings' LayerNorm); the head and loss what
    :func:`head_loss_terms` says they keep. An encoder-decoder has these a stack (the decoder's at
    its length, prefixed ``decoder: ``; T5 also ends each stack with a dropout), plus its encoder's
    output, which every cross-attention reads (``e·sbh/r``). An image classifier (ViT) reads no
    token ids. Full recompute keeps all of these: they are outside the checkpointed layers.
    """
    if cfg.architecture != "encoder-decoder":
        terms = _stack_other_terms(cfg, st, st.seq)
    else:
        terms = {f"encoder: {k}": v for k, v in _stack_other_terms(cfg, st, st.seq).items()}
        terms.update({f"decoder: {k}": v for k, v in _stack_other_terms(cfg, st, st.decoder_seq).items()})
        e, _, r, _ = element_bytes(cfg, st)
        terms["encoder output (read by every cross-attention)"] = ceil_div(e * st.seq * st.batch * cfg.hidden, r)
    terms.update(head_loss_terms(cfg, st)[0])
    return terms


def _stack_other_terms(cfg: ModelConfig, st: Settings, s: int) -> dict:
    b, h = st.batch, cfg.hidden
    e, mask, r, stat = element_bytes(cfg, st)
    terms = {} if cfg.task == "image-classification" else {"token ids (int64)": 8 * s * b}
    if cfg.positions == "learned":
        if cfg.task != "image-classification":  # ViT adds its table whole, no ids
            terms["position ids (int64)"] = 8 * s
    elif cfg.positions == "relative":
        terms["relative position buckets (int64, s x s)"] = 8 * s * s
    else:
        terms["rotary cos and sin (shared by the layers)"] = 2 * e * s * cfg.head_dim
    if cfg.hidden_dropout > 0:
        terms["embedding dropout mask"] = ceil_div(mask * s * b * h, r)
        if cfg.positions == "relative":
            terms["final dropout mask"] = ceil_div(mask * s * b * h, r)
    terms["final norm input"] = ceil_div(e * s * b * h, r)
    terms["final norm statistics (fp32)"] = ceil_div(stat * s * b, r)
    if not cfg.fused_norm:
        terms["unfused final norm (fp32 input, normalized)"] = ceil_div(4 * s * b * h, r)
    return terms


def head_rows(cfg: ModelConfig, st: Settings) -> int:
    """Rows the head reads: every token of the (decoder's) sequence, or one a sequence for a
    sequence or image classifier."""
    if cfg.task in ("sequence-classification", "image-classification"):
        return st.batch
    return (st.decoder_seq if cfg.architecture == "encoder-decoder" else st.seq) * st.batch


def head_width(cfg: ModelConfig) -> int:
    """Outputs of the head: the vocabulary, or the classifier's labels."""
    return cfg.vocab if cfg.vocab_head else cfg.num_labels


def fused_head_chunk_rows(cfg: ModelConfig, st: Settings) -> int:
    """Rows of logits a chunk of the fused head (``llmmem.head.chunks.chunk_rows``): the
    settings' ``head_chunk_size``, else the most whose fp32 logits take ``max(32 MiB, the
    hidden states' bytes)`` but at least 256; at least one, at most ``s·b``. With tensor
    parallelism each rank's chunk spans its ``V/t`` columns of the vocabulary."""
    n = head_rows(cfg, st)
    if st.head_chunk_size is not None:
        return max(1, min(n, st.head_chunk_size))
    e = PRECISIONS[st.precision]["activation"]
    target = max(FUSED_HEAD_MIN_CHUNK_BYTES, n * cfg.hidden * e)
    rows = target // (ceil_div(head_width(cfg), st.tensor_parallel) * 4)
    return max(1, min(n, max(FUSED_HEAD_MIN_CHUNK_ROWS, rows)))


def head_loss_terms(cfg: ModelConfig, st: Settings, fused: bool | None = None) -> tuple[dict, dict]:
    """``(kept, temporary)``: bytes the LM head and its loss keep for backward, and their largest
    transient buffer, on one device; ``fused`` (default: the settings' ``fused_head``) says which head.

    Like the rest of the estimate, these take the gradients row as already there (as under gradient
    accumulation), so the weight gradient either head makes is a new buffer beside it
    (``g·V/t·h``, ``g`` the precision's bytes a gradient): the fused head makes it in its forward,
    the plain one in its backward. In a fresh step it is that row's own, made early by both heads
    alike: where the head makes the step's peak, what the fused head saves is the same either way.

    **Plain** (``F.linear`` then cross-entropy): the head keeps its input (``e·sbh/r``); the loss is
    computed in fp32 in every precision (Megatron and Hugging Face upcast the logits for a stable
    softmax), so the log-softmax keeps its fp32 output, ``4·s·b·V/t`` (vocabulary-parallel with TP);
    its backward holds the fp32 gradients of the log-probabilities and of the logits together,
    ``2·4·s·b·V/t``, then, the log-probabilities freed, the logits' gradient in the compute dtype
    (``e·s·b·V/t``) while the head's matmuls make the weight's gradient and the hidden states'
    (``e·sbh/r``): the larger of the two moments.

    **Fused** (``llmmem.linear_cross_entropy``, gradients made in the forward): it keeps the hidden
    states' gradient (``e·sbh/r``, in place of the input the plain head keeps) and, while its
    forward runs, holds its input, one chunk of ``R`` rows of logits in the compute dtype
    (``R·V/t·e``, ``R`` from :func:`fused_head_chunk_rows`), a few fp32 numbers a row of it, and
    the weight's gradient, accumulated in fp32 (``4·V/t·h``) and, where the weights are 16-bit,
    turned into their dtype as the forward ends (``e·V/t·h`` more, while the chunk's numbers are
    gone). The passes over the logits (C on the CPU, CUDA kernels) read the chunk in place; only the
    CPU's accumulation of a 16-bit chunk into the fp32 gradient upcasts it and its rows of hidden
    states (``4·R·(V/t + h)``). Under ``*-mixed`` (fp32 weights under autocast, what Hugging Face's
    ``bf16=True`` runs) the fused head's operand is a 16-bit copy of the weight (``e·V/t·h``) beside
    the one autocast caches for the head's own (empty) matmul, which the parameters row counts.
    Both keep the int64 targets (``8·sb``).

    Beyond causal LMs, ``s·b`` is the rows the head reads (:func:`head_rows`: an encoder-decoder's
    decoder tokens; one row a sequence for a sequence or image classifier) and ``V`` its outputs
    (:func:`head_width`: the labels of a classifier); an encoder's head keeps what
    :func:`_task_head_terms` says before its last matrix.
    """
    fused = st.fused_head if fused is None else fused
    h, t = cfg.hidden, st.tensor_parallel
    sb = head_rows(cfg, st)  # the rows the head reads (s·b tokens; b for a sequence classifier)
    e, mask, r, stat = element_bytes(cfg, st)
    v = ceil_div(head_width(cfg), t) if cfg.vocab_head else cfg.num_labels
    hidden = ceil_div(e * sb * h, r)
    weight_grad = PRECISIONS[st.precision]["grad"] * v * h
    dtype = {4: "fp32", 2: "16-bit"}[e]
    before = _task_head_terms(cfg, st, e, mask, r, stat)
    if not fused:
        kept = {
            **before,
            ("lm head input" if cfg.vocab_head else "classifier input"): hidden,
            "log-probabilities (fp32, loss)": 4 * sb * v,
            "targets (int64)": _target_bytes(cfg, st, sb),
        }
        if cfg.logit_softcap:  # Gemma 2: cap·tanh(logits/cap), in the activations' dtype
            kept["soft-capped logits (tanh output)"] = e * sb * v
        softmax = {"fp32 gradients of log-probabilities and logits": 2 * 4 * sb * v}
        matmuls = {"head weight's gradient (made in its backward)": weight_grad, "hidden states' gradient": hidden}
        if e != 4:  # the logits' gradient in their dtype outlives the fp32 log-probabilities, freed by then
            matmuls["logits' 16-bit gradient, less the fp32 log-probabilities"] = (e - 4) * sb * v
        return kept, softmax if sum(softmax.values()) >= sum(matmuls.values()) else matmuls
    rows = fused_head_chunk_rows(cfg, st)
    kept = {
        **before,
        "hidden states' gradient (fused head, made in its forward)": hidden,
        "targets (int64)": _target_bytes(cfg, st, sb),
    }
    tmp = {
        "fused head input (until its forward ends)": hidden,
        f"one chunk of logits ({rows} rows x {v}, {dtype})": rows * v * e,
    }
    if st.precision.endswith("-mixed"):
        tmp["16-bit copy of the fp32 head weight (the fused head's operand under autocast)"] = e * v * h
    gathered = 4 * t if t > 1 else 0  # every rank's row statistics (vocabulary-parallel)
    in_loop = {"per-row statistics (fp32)": 4 * rows * (_FUSED_ROW_FLOATS + gathered)}
    if e != 4 and st.device_type == "cpu":
        in_loop["its fp32 copy and its hidden rows' (the CPU accumulation)"] = 4 * rows * (v + h)
    if e == 4:
        tmp["head weight's gradient (fp32, made in its forward)"] = 4 * v * h
        tmp.update(in_loop)
    else:
        tmp["fp32 accumulator of the head weight's gradient"] = 4 * v * h
        ends = {"head weight's gradient in its dtype (made as its forward ends)": e * v * h}
        tmp.update(in_loop if sum(in_loop.values()) >= sum(ends.values()) else ends)
    return kept, tmp


def _target_bytes(cfg: ModelConfig, st: Settings, rows: int) -> int:
    """int64 targets the loss keeps: one a row the head reads, or question answering's start and
    end positions, two a sequence (its logits split into two softmaxes over the sequence)."""
    return 8 * (2 * st.batch if cfg.task == "question-answering" else rows)


def _task_head_terms(cfg: ModelConfig, st: Settings, e: int, mask: int, r: int, stat: int) -> dict:
    """What an encoder's task head keeps before its last matrix: a masked LM's transform (dense,
    GELU, LayerNorm: their inputs and statistics); a sequence or image classifier's first-token
    view, which keeps the last hidden states whole (BERT's pooler, DistilBERT's and ViT's classifier
    read ``hidden[:, 0]`` as a view); a token classifier's dropout mask."""
    sbh = ceil_div(st.seq * st.batch * cfg.hidden, r)
    if cfg.task == "masked-lm":
        return {
            "masked-lm transform: dense input, gelu input, norm input": 3 * e * sbh,
            "masked-lm transform: norm statistics (fp32)": ceil_div(stat * st.seq * st.batch, r),
        }
    if cfg.task in ("sequence-classification", "image-classification"):
        return {"last hidden states (the classifier reads a view of the first token)": e * sbh}
    if cfg.task == "token-classification" and cfg.hidden_dropout > 0:
        return {"classifier dropout mask": mask * sbh}
    return {}


def megatron_layer_activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> int:
    """Megatron-LM's activation bytes per transformer layer (Korthikanti et al. 2022, table 2).

    16-bit activations, 1-byte dropout masks, GELU MLP of width 4h, multi-head attention:

    - no parallelism: ``s·b·h·(34 + 5·a·s/h)``;
    - tensor parallel ``t``: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (norms, their outputs feeding
      the column-parallel layers and the dropout masks, 10·sbh, stay replicated);
    - tensor + sequence parallel: ``s·b·h·(34 + 5·a·s/h) / t``;
    - selective recompute drops the ``5·a·s²·b`` attention term: ``34·sbh/t`` (with sequence parallel);
    - full recompute keeps only the layer input: ``2·sbh`` (``/t`` with sequence parallel).

    The reference the derived model (:func:`layer_activation_terms`) is checked against; exact
    integer arithmetic when ``t`` divides the sizes.
    """
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    sbh = s * b * h
    r = t if sequence_parallel else 1
    if recompute == "full":
        return 2 * sbh // r
    scores = 0 if recompute == "selective" else 5 * a * s * s * b
    return 10 * sbh // r + (24 * sbh + scores) // t
