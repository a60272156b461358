"""How much accelerator memory will training take, and what makes it fit?

``llmmem.estimate(model, batch=..., seq=..., ...)`` returns an :class:`Estimate`: a per-device
breakdown in bytes (not elements) of parameters, gradients, master weights, optimizer state,
activations and the largest transient buffer. Given ``device_memory`` it says whether that fits
and which combination of activation checkpointing, ZeRO stage, tensor/sequence parallelism and
fused attention fits with the least expected slowdown. Pure arithmetic: naming a model imports
neither torch nor the C core.

Model state, bytes per parameter (Rajbhandari et al. 2020, "ZeRO", section 3.1: mixed-precision
Adam needs ``2Ψ + 2Ψ + KΨ`` bytes with ``K = 12``, i.e. 16 bytes per parameter):

================  =====  =====  ======  ============================================
precision         param  grad   master  optimizer state per moment
================  =====  =====  ======  ============================================
``fp32``          4      4      0       4 (fp32)
``fp16-mixed``    2      2      4       4 (fp32 moments beside the fp32 master copy)
``bf16-mixed``    2      2      4       4
``bf16`` (pure)   2      2      0       2 (bf16 moments, no fp32 copy)
================  =====  =====  ======  ============================================

Moments per parameter: ``sgd`` 0, ``sgd-momentum`` 1, ``adam``/``adamw`` 2 (Kingma & Ba 2015), so
Adam's state is 8 bytes per parameter in fp32 and mixed-precision Adam totals 2+2+4+8 = 16.
(``torch.autocast`` with fp32 parameters also totals 16 with Adam, as 4+4+0+8, and has 16-bit
activations like the ``*-mixed`` modes.)

ZeRO partitioning over ``N_d`` data-parallel ranks (Rajbhandari et al. 2020, section 5): stage 1
divides the optimizer state and master weights by ``N_d``, stage 2 also the gradients, stage 3
also the parameters. Tensor parallelism (Shoeybi et al. 2019) divides every weight matrix and the
vocabulary by ``t``; norms and row-parallel biases are replicated (see :mod:`llmmem.estimation.model_configs`).

Activations: see :func:`layer_activation_terms` (derived from what each op saves for backward;
Megatron-LM's ``s·b·h·(34 + 5·a·s/h)`` is its 16-bit special case, :func:`megatron_layer_activation_bytes`)
and :func:`other_activation_terms` (embeddings, final norm, head and loss).

Assumptions: every quantity is per device and summed at once (activations are at their peak at the
start of backward, when gradients start to appear), which is conservative; no pipeline parallelism,
no CPU offload; ``batch`` is the micro-batch per data-parallel rank; ``device_memory`` is what the
process may allocate, so leave room yourself for the CUDA context (~0.5-1 GiB), NCCL buffers and
allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from llmmem.estimation import model_configs
from llmmem.estimation.model_configs import ModelConfig, choice, positive_int
from llmmem.units import format_bytes, parse_bytes

__all__ = [
    "estimate",
    "Estimate",
    "Recommendation",
    "ModelConfig",
    "layer_activation_terms",
    "other_activation_terms",
    "megatron_layer_activation_bytes",
    "PRECISIONS",
    "OPTIMIZERS",
]

# bytes per parameter (see the module docstring) and per activation element
PRECISIONS = {
    "fp32": {"param": 4, "grad": 4, "master": 0, "moment": 4, "activation": 4},
    "fp16-mixed": {"param": 2, "grad": 2, "master": 4, "moment": 4, "activation": 2},
    "bf16-mixed": {"param": 2, "grad": 2, "master": 4, "moment": 4, "activation": 2},
    "bf16": {"param": 2, "grad": 2, "master": 0, "moment": 2, "activation": 2},
}
OPTIMIZERS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}  # optimizer moments per parameter
DEVICE_TYPES = ("cuda", "cpu")

# --- the slowdown model (fractions of one training step; assumptions, not measurements) --------
# Recompute costs are FLOP ratios computed per model (see _slowdown). Communication costs depend on
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
MAX_TENSOR_PARALLEL = 8
# The recommendation first searches the user's device count (data_parallel x tensor_parallel); if
# nothing fits it doubles the device count up to this many.
MAX_DEVICES = 4096


# =================================================================================================
# input validation
# =================================================================================================
def _parse_checkpointing(value) -> str:
    """``"none" | "selective" | "full" | "every-K"`` from a string or an int ``K`` (``K = 1`` is full)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        k = positive_int(value, "checkpointing")
    elif isinstance(value, str):
        key = value.strip().lower()
        if key in ("none", "selective", "full"):
            return key
        if not key.startswith("every-") or not key[6:].isdigit():
            raise ValueError(
                f"checkpointing: unknown value {value!r}; use none, selective, full, "
                "every-K (K a positive integer) or an integer K"
            )
        k = positive_int(int(key[6:]), "checkpointing")
    else:
        raise ValueError(f"checkpointing: expected none, selective, full, every-K or an integer, got {value!r}")
    return "full" if k == 1 else f"every-{k}"


@dataclass(frozen=True)
class _Settings:
    """Validated, normalised run settings (everything but the model)."""

    batch: int
    seq: int
    precision: str
    optimizer: str
    zero_stage: int
    data_parallel: int
    tensor_parallel: int
    sequence_parallel: bool
    checkpointing: str
    attention: str
    device_type: str

    def recomputed_layers(self, layers: int) -> int:
        """Layers whose activations are dropped and recomputed (full or every-K recompute)."""
        if self.checkpointing == "full":
            return layers
        if self.checkpointing.startswith("every-"):
            return -(-layers // int(self.checkpointing[6:]))  # layers 0, K, 2K, ...
        return 0

    @property
    def devices(self) -> int:
        return self.data_parallel * self.tensor_parallel

    def public(self) -> dict:
        return dataclasses.asdict(self)


def _settings(
    cfg: ModelConfig,
    *,
    batch,
    seq,
    precision,
    optimizer,
    zero_stage,
    data_parallel,
    tensor_parallel,
    sequence_parallel,
    checkpointing,
    attention,
    device_type,
) -> _Settings:
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, numbers.Integral) or not 0 <= zero_stage <= 3:
        raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel: must be True or False, got {sequence_parallel!r}")
    st = _Settings(
        batch=positive_int(batch, "batch"),
        seq=positive_int(seq, "seq"),
        precision=choice(precision, "precision", PRECISIONS),
        optimizer=choice(optimizer, "optimizer", OPTIMIZERS),
        zero_stage=int(zero_stage),
        data_parallel=positive_int(data_parallel, "data_parallel"),
        tensor_parallel=positive_int(tensor_parallel, "tensor_parallel"),
        sequence_parallel=sequence_parallel,
        checkpointing=_parse_checkpointing(checkpointing),
        attention=cfg.attention
        if attention is None
        else choice(attention, "attention", model_configs.ATTENTION_KINDS),
        device_type=choice(device_type, "device_type", DEVICE_TYPES),
    )
    _check_tensor_parallel(cfg, st.tensor_parallel)
    return st


def _tp_indivisible(cfg: ModelConfig, t: int) -> tuple[str, int] | None:
    """The first of heads, kv_heads, ffn that ``t`` does not divide, as (name, size); None if all.
    Megatron splits attention by heads and the MLP by columns: each rank needs whole heads."""
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffn", cfg.ffn)):
        if n % t:
            return what, n
    return None


def _check_tensor_parallel(cfg: ModelConfig, t: int) -> None:
    bad = _tp_indivisible(cfg, t)
    if bad is not None:
        raise ValueError(f"tensor_parallel: size {t} does not divide {bad[0]} ({bad[1]})")


# =================================================================================================
# activations
# =================================================================================================
def _div(x: int, t: int) -> int:
    return -(-x // t)  # ceil: a rank holds whole elements


def _materialises_scores(cfg: ModelConfig, st: _Settings) -> bool:
    """Whether attention keeps ``s x s`` tensors for backward.

    Explicit attention does. A fused kernel (flash / memory-efficient SDPA) does not, except that
    PyTorch's CPU flash kernel has no dropout, so SDPA on CPU with dropout > 0 falls back to the math
    path, which saves the same ``s x s`` tensors as explicit attention (checked with saved_tensors_hooks
    on torch 2.11).
    """
    if st.attention == "explicit":
        return True
    return st.device_type == "cpu" and cfg.dropout > 0


def _element_bytes(cfg: ModelConfig, st: _Settings) -> tuple[int, int, int, int]:
    """``(e, m, r, stat)``: bytes per activation element; per dropout-mask element (a CUDA dropout
    keeps a bool mask, a CPU one a noise tensor of the activation dtype); the divisor of the
    activations outside the tensor-parallel regions (``t`` with sequence parallelism, else 1); and
    the fp32 norm statistics per token (mean and rstd for LayerNorm, rstd only for RMSNorm)."""
    e = PRECISIONS[st.precision]["activation"]
    mask = 1 if st.device_type == "cuda" else e
    r = st.tensor_parallel if st.sequence_parallel else 1
    stat = 8 if cfg.norm == "layernorm" else 4
    return e, mask, r, stat


# Terms that hold s x s tensors: what Megatron's selective recompute drops.
_SCORE_TERMS = ("attention probabilities (softmax output)", "attention dropout mask", "attention dropout output")


def layer_activation_terms(cfg: ModelConfig, st: _Settings) -> dict:
    """Bytes one transformer layer saves for backward on one device, term by term (no recompute).

    Derived from what each op of a pre-norm layer saves in PyTorch's autograd, with ``s`` sequence,
    ``b`` micro-batch, ``h`` hidden, ``a`` heads, ``k`` kv heads of size ``d = h/a``, ``f`` MLP width,
    ``e`` bytes per activation element (4 fp32, 2 fp16/bf16), ``m`` bytes per dropout-mask element,
    ``t`` tensor-parallel size and ``r = t`` with sequence parallelism, else 1:

    ==============================================  ===========================  ==========
    term                                            bytes                        Megatron
    ==============================================  ===========================  ==========
    two norm inputs                                 ``2·e·sbh / r``              4sbh
    norm statistics (fp32 mean+rstd / rstd)         ``2·8·sb / r`` / ``2·4·sb/r``  (omitted)
    Q/K/V projection input                          ``e·sbh / r``                2sbh
    Q, K, V (inputs of QK^T and of P·V)             ``e·sb·(h + 2kd) / t``       6sbh
    softmax output                                  ``e·a·s²·b / t``             2as²b
    attention dropout mask, dropout output          ``(m + e)·a·s²·b / t``       3as²b
    attention output projection input               ``e·sbh / t``                2sbh
    residual dropout mask after attention           ``m·sbh / r``                sbh
    MLP input                                       ``e·sbh / r``                2sbh
    GELU input and output (down-projection input)   ``2·e·sbf / t``              16sbh
    (SwiGLU: gate out, SiLU out, up out, product)   ``4·e·sbf / t``
    residual dropout mask after the MLP             ``m·sbh / r``                sbh
    ==============================================  ===========================  ==========

    With ``e = 2``, ``m = 1`` (a CUDA dropout keeps a bool mask), ``f = 4h``, ``k = a`` and dropout,
    the sum is ``sbh·(34 + 5as/h)/t``-shaped exactly as Megatron-LM's formula (Korthikanti et al.
    2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1 and table 2;
    see :func:`megatron_layer_activation_bytes`) plus the small norm statistics it omits. On CPU,
    PyTorch's dropout multiplies by a noise tensor of the activation dtype instead, so ``m = e``.
    Without dropout (LLaMA) the masks and the dropout output vanish and P·V reads the softmax output.
    A fused attention kernel (``attention="sdpa"`` on CUDA) keeps no ``s x s`` tensor; besides Q, K, V
    it saves its output, which it lays out as ``(b, s, a, d)`` so that the output projection's input is
    a view of the same storage (counted once, as the projection input), and the fp32 log-sum-exp,
    ``4·a·s·b/t``.

    Not counted: explicit attention with ``masked_fill`` also saves the ``s x s`` bool causal mask
    (``s²`` bytes per layer, independent of batch and heads), which a fused scale-mask-softmax
    (Megatron) does not.
    """
    s, b, h, t = st.seq, st.batch, cfg.hidden, st.tensor_parallel
    e, mask, r, stat = _element_bytes(cfg, st)
    sbh, a, f = s * b * h, cfg.heads, cfg.ffn
    dropout = cfg.dropout > 0

    terms = {
        "norm inputs (2)": _div(2 * e * sbh, r),
        "norm statistics (fp32)": _div(2 * stat * s * b, r),
        "q/k/v projection input": _div(e * sbh, r),
        "q, k, v": _div(e * s * b * (h + 2 * cfg.kv_heads * cfg.head_dim), t),
    }
    if _materialises_scores(cfg, st):
        terms["attention probabilities (softmax output)"] = _div(e * a * s * s * b, t)
        if dropout:
            terms["attention dropout mask"] = _div(mask * a * s * s * b, t)
            terms["attention dropout output"] = _div(e * a * s * s * b, t)
    else:
        terms["attention log-sum-exp (fp32)"] = _div(4 * a * s * b, t)
    terms["attention projection input"] = _div(e * sbh, t)
    if dropout:
        terms["attention residual dropout mask"] = _div(mask * sbh, r)
    terms["mlp input"] = _div(e * sbh, r)
    if cfg.mlp == "gelu":
        terms["gelu input"] = _div(e * s * b * f, t)
        terms["mlp down-projection input (gelu output)"] = _div(e * s * b * f, t)
    else:
        terms["gate projection output (silu input)"] = _div(e * s * b * f, t)
        terms["silu output"] = _div(e * s * b * f, t)
        terms["up projection output"] = _div(e * s * b * f, t)
        terms["mlp down-projection input (silu·up)"] = _div(e * s * b * f, t)
    if dropout:
        terms["mlp residual dropout mask"] = _div(mask * sbh, r)
    return terms


def other_activation_terms(cfg: ModelConfig, st: _Settings) -> dict:
    """Bytes saved for backward outside the transformer layers, on one device.

    Token ids and targets are int64 (``8·sb``); a learned position table also saves its ids
    (``8·s``); the embedding dropout keeps a mask (``m·sbh/r``); the final norm keeps its input and
    statistics and the LM head its input (``e·sbh/r`` each). The loss is computed in fp32 in every
    precision (Megatron and Hugging Face upcast the logits for a stable softmax): the cross entropy's
    log-softmax keeps its fp32 output, ``4·s·b·V/t`` bytes (vocabulary-parallel with TP). Full
    recompute keeps all of these: they are outside the checkpointed layers.
    """
    s, b, h, t = st.seq, st.batch, cfg.hidden, st.tensor_parallel
    e, mask, r, stat = _element_bytes(cfg, st)
    terms = {"token ids (int64)": 8 * s * b}
    if cfg.positions == "learned":
        terms["position ids (int64)"] = 8 * s
    if cfg.dropout > 0:
        terms["embedding dropout mask"] = _div(mask * s * b * h, r)
    terms["final norm input"] = _div(e * s * b * h, r)
    terms["final norm statistics (fp32)"] = _div(stat * s * b, r)
    terms["lm head input"] = _div(e * s * b * h, r)
    terms["log-probabilities (fp32, loss)"] = 4 * s * b * _div(cfg.vocab, t)
    terms["targets (int64)"] = 8 * s * b
    return terms


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


# =================================================================================================
# the estimate
# =================================================================================================
def _flops(cfg: ModelConfig, st: _Settings) -> tuple[int, int, int]:
    """(layer forward, attention-core forward, whole step) FLOPs, 2 per multiply-add.

    Layer: ``2sb·(h(h + 2kd) + h² + n·h·f)`` for the projections (``n`` = 2 GELU, 3 SwiGLU) plus
    ``4·s²·b·h`` for QK^T and P·V. Step = 3 x forward (backward ≈ 2 x forward; Kaplan et al. 2020),
    forward = layers + the LM head ``2·s·b·h·V``.
    """
    s, b, h, f = st.seq, st.batch, cfg.hidden, cfg.ffn
    n = 2 if cfg.mlp == "gelu" else 3
    core = 4 * s * s * b * h
    layer = 2 * s * b * (h * (h + 2 * cfg.kv_heads * cfg.head_dim) + h * h + n * h * f) + core
    step = 3 * (cfg.layers * layer + 2 * s * b * h * cfg.vocab)
    return layer, core, step


def _slowdown(cfg: ModelConfig, st: _Settings) -> dict:
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
    layer, core, step = _flops(cfg, st)
    parts = {}
    n_r = st.recomputed_layers(cfg.layers)
    if n_r:
        parts["recompute"] = n_r * layer / step
    elif st.checkpointing == "selective" and _materialises_scores(cfg, st):
        parts["selective recompute"] = cfg.layers * core / step
    if st.zero_stage == 3 and st.data_parallel > 1:
        parts["ZeRO-3 parameter gathers"] = ZERO3_SLOWDOWN
    if st.tensor_parallel > 1:
        parts["tensor-parallel collectives"] = TP_SLOWDOWN_PER_DOUBLING * math.log2(st.tensor_parallel)
    return parts


def _compute(cfg: ModelConfig, counted: int | None, st: _Settings) -> dict:
    """Every number of an :class:`Estimate`, in bytes per device."""
    t, n_d = st.tensor_parallel, st.data_parallel
    prec = PRECISIONS[st.precision]
    total_params = cfg.parameters(seq=st.seq)
    device_params = cfg.parameters(seq=st.seq, tensor_parallel=t)
    if counted is not None:  # an nn.Module: its real count, split across TP as the formula splits
        device_params = _div(counted * device_params, total_params)
        total_params = counted

    def part(per_param: int, sharded: bool) -> int:
        return _div(device_params * per_param, n_d if sharded else 1)

    out = {
        "parameters": part(prec["param"], st.zero_stage >= 3),
        "gradients": part(prec["grad"], st.zero_stage >= 2),
        "master_weights": part(prec["master"], st.zero_stage >= 1),
        "optimizer_state": part(prec["moment"] * OPTIMIZERS[st.optimizer], st.zero_stage >= 1),
    }

    layer_terms = layer_activation_terms(cfg, st)
    full_layer = sum(layer_terms.values())
    score_bytes = sum(layer_terms.get(k, 0) for k in _SCORE_TERMS)
    stored_layer = full_layer - score_bytes if st.checkpointing == "selective" else full_layer
    # A recomputed layer keeps only its input, e·sbh (divided by t with sequence parallelism).
    e, _, r, _ = _element_bytes(cfg, st)
    layer_input = _div(e * st.seq * st.batch * cfg.hidden, r)
    n_r = st.recomputed_layers(cfg.layers)
    other_terms = other_activation_terms(cfg, st)
    out["activations_per_layer"] = full_layer
    out["activations_layers"] = n_r * layer_input + (cfg.layers - n_r) * stored_layer
    out["activations_other"] = sum(other_terms.values())
    out["activations"] = out["activations_layers"] + out["activations_other"]

    # Largest transient buffer, beyond what is stored: either the loss backward (fp32 gradients of the
    # log-probabilities and of the logits, alive together) or one layer's backward: the gradients of the
    # s x s probabilities and scores (explicit attention), the activations it recomputes, and under
    # ZeRO-3 its gathered parameters (one layer; prefetching more is not counted).
    s, b = st.seq, st.batch
    loss_tmp = {"fp32 gradients of log-probabilities and logits": 2 * 4 * s * b * _div(cfg.vocab, t)}
    layer_tmp = {}
    if score_bytes:
        layer_tmp["gradients of attention probabilities and scores"] = 2 * _div(e * cfg.heads * s * s * b, t)
    if n_r:
        layer_tmp["one recomputed layer's activations"] = full_layer
    elif st.checkpointing == "selective" and score_bytes:
        layer_tmp["one layer's recomputed attention scores"] = score_bytes
    if st.zero_stage == 3 and n_d > 1:
        layer_tmp["one layer's gathered parameters (ZeRO-3)"] = cfg.layer_parameters(t) * prec["param"]
    tmp = loss_tmp if sum(loss_tmp.values()) >= sum(layer_tmp.values()) else layer_tmp
    out["temporary"] = sum(tmp.values())
    out["total"] = sum(
        out[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state", "activations", "temporary")
    )
    slow = _slowdown(cfg, st)
    return {
        "bytes": out,
        "layer_terms": layer_terms,
        "other_terms": other_terms,
        "temporary_terms": tmp,
        "parameter_count": total_params,
        "parameters_per_device": device_params,
        "slowdown": sum(slow.values()),
        "slowdown_terms": slow,
    }


@dataclass(frozen=True)
class Recommendation:
    """The cheapest settings that fit: what to change, on how many devices, at what expected cost.

    ``settings`` holds the full settings; ``changes`` only those that differ from the request;
    ``estimate`` is the :class:`Estimate` for them (its ``total`` fits ``device_memory``);
    ``slowdown`` is its expected extra step time as a fraction (see ``_slowdown``).
    """

    settings: dict
    changes: dict
    devices: int
    slowdown: float
    estimate: Estimate

    def describe(self) -> str:
        changes = ", ".join(f"{k}={v}" for k, v in self.changes.items()) or "no change"
        return (
            f"{changes}  ->  {format_bytes(self.estimate.total)} per device on {self.devices} device(s), "
            f"expected slowdown {_pct(self.slowdown)}"
        )

    def to_dict(self) -> dict:
        return {
            "settings": dict(self.settings),
            "changes": dict(self.changes),
            "devices": self.devices,
            "slowdown": self.slowdown,
            "total": self.estimate.total,
        }


def _pct(x: float) -> str:
    return f"+{100 * x:.1f}%"


class Estimate:
    """A per-device memory estimate (bytes). Build it with :func:`estimate`.

    Attributes (bytes unless said otherwise): ``parameters``, ``gradients``, ``master_weights``,
    ``optimizer_state``, ``activations`` (= ``activations_layers`` + ``activations_other``),
    ``activations_per_layer`` (one layer without recompute), ``activations_layers`` (all layers,
    under the chosen checkpointing), ``activations_other`` (embeddings, head, loss),
    ``temporary`` (largest transient buffer), ``total``; ``layer_terms``, ``other_terms`` and
    ``temporary_terms`` break those down; ``parameter_count`` (elements, whole model),
    ``slowdown`` (fraction); with ``device_memory``: ``fits`` (bool), ``recommendation``
    (:class:`Recommendation` or None) and ``advice`` (one line).
    """

    def __init__(self, cfg: ModelConfig, st: _Settings, numbers_: dict, device_memory: int | None = None) -> None:
        self.model = cfg
        self.settings = st
        self.parameter_count = numbers_["parameter_count"]
        self.parameters_per_device = numbers_["parameters_per_device"]
        for key, value in numbers_["bytes"].items():
            setattr(self, key, value)
        self.layer_terms = numbers_["layer_terms"]
        self.other_terms = numbers_["other_terms"]
        self.temporary_terms = numbers_["temporary_terms"]
        self.slowdown = numbers_["slowdown"]
        self.slowdown_terms = numbers_["slowdown_terms"]
        self.device_memory = device_memory
        self.fits = None if device_memory is None else self.total <= device_memory
        self.recommendation: Recommendation | None = None
        self.advice = ""

    _ROWS = ("parameters", "gradients", "master_weights", "optimizer_state", "activations", "temporary", "total")

    def to_dict(self) -> dict:
        """Every number, in bytes (fractions for slowdowns), JSON-ready."""
        return {
            "model": {
                **{f.name: getattr(self.model, f.name) for f in dataclasses.fields(self.model)},
                "parameter_count": self.parameter_count,
                "parameters_per_device": self.parameters_per_device,
            },
            "settings": self.settings.public(),
            "bytes": {
                k: getattr(self, k)
                for k in self._ROWS + ("activations_per_layer", "activations_layers", "activations_other")
            },
            "layer_terms": dict(self.layer_terms),
            "other_terms": dict(self.other_terms),
            "temporary_terms": dict(self.temporary_terms),
            "slowdown": self.slowdown,
            "slowdown_terms": dict(self.slowdown_terms),
            "device_memory": self.device_memory,
            "fits": self.fits,
            "recommendation": None if self.recommendation is None else self.recommendation.to_dict(),
            "advice": self.advice,
        }

    def __str__(self) -> str:
        cfg, st = self.model, self.settings
        prec = PRECISIONS[st.precision]
        moments = OPTIMIZERS[st.optimizer]
        sp = ", sequence parallel" if st.sequence_parallel and st.tensor_parallel > 1 else ""
        lines = [
            f"{cfg.name}: {self.parameter_count / 1e9:.3g} B parameters ({cfg.describe()})",
            f"batch {st.batch} x seq {st.seq}, {st.precision}, {st.optimizer}, ZeRO stage {st.zero_stage} over "
            f"{st.data_parallel} data-parallel rank(s), tensor parallel {st.tensor_parallel}{sp}, "
            f"checkpointing {st.checkpointing}, {st.attention} attention ({st.device_type})",
            "",
            f"{'per device':<44}{'':>12}{'bytes':>20}",
        ]

        def row(label: str, value: int, note: str = "") -> None:
            lines.append(f"  {label:<42}{format_bytes(value):>12} {value:>19,}" + (f"  {note}" if note else ""))

        row("parameters", self.parameters, f"{prec['param']} B/param")
        row("gradients", self.gradients, f"{prec['grad']} B/param")
        row("master weights", self.master_weights, f"{prec['master']} B/param")
        row("optimizer state", self.optimizer_state, f"{moments} x {prec['moment']} B/param")
        row("activations", self.activations)
        row("  per layer (no recompute)", self.activations_per_layer)
        row(f"  all {cfg.layers} layers ({st.checkpointing})", self.activations_layers)
        row("  embeddings, head, loss", self.activations_other)
        row("largest temporary", self.temporary, "; ".join(self.temporary_terms))
        row("total", self.total)
        if self.slowdown_terms:
            parts = ", ".join(f"{k} {_pct(v)}" for k, v in self.slowdown_terms.items())
            lines.append(f"expected slowdown {_pct(self.slowdown)} ({parts})")
        if self.device_memory is not None:
            lines.append("")
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(
                f"device memory {format_bytes(self.device_memory)} ({self.device_memory:,} bytes): {verdict} "
                f"({format_bytes(abs(self.device_memory - self.total))} "
                f"{'free' if self.fits else 'short'})"
            )
            if self.advice:
                lines.append(self.advice)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Estimate {self.model.name}: total {format_bytes(self.total)} per device>"


# =================================================================================================
# the fit recommendation
# =================================================================================================
def _checkpointing_options(layers: int) -> list[str]:
    """none, selective, full, and every-K for each K giving a distinct number of recomputed layers."""
    options, seen = ["none", "selective", "full"], {0, layers}
    for k in range(2, layers + 1):
        n = -(-layers // k)
        if n not in seen:
            seen.add(n)
            options.append(f"every-{k}")
    return options


def _candidates(cfg: ModelConfig, st: _Settings, devices: int):
    """All settings on ``devices`` devices that change only memory techniques (never precision,
    optimizer, batch or sequence: those change the training itself)."""
    attentions = [st.attention] + (["sdpa"] if st.attention == "explicit" else [])
    ckpts = _checkpointing_options(cfg.layers)
    for t in (1, 2, 4, 8):
        if t > MAX_TENSOR_PARALLEL or devices % t or _tp_indivisible(cfg, t) is not None:
            continue
        n_d = devices // t
        for sp in (False, True) if t > 1 else (False,):
            for zero in range(4) if n_d > 1 else (0,):
                for attention in attentions:
                    for ckpt in ckpts:
                        yield dataclasses.replace(
                            st,
                            tensor_parallel=t,
                            data_parallel=n_d,
                            sequence_parallel=sp,
                            zero_stage=zero,
                            attention=attention,
                            checkpointing=ckpt,
                        )


def _changes(old: _Settings, new: _Settings) -> dict:
    return {k: v for k, v in new.public().items() if getattr(old, k) != v}


def _best_fit(cfg: ModelConfig, counted: int | None, st: _Settings, devices: int, budget: int):
    """``((slowdown, number of changes, total), settings)`` of the cheapest fitting candidate, or None.

    Ties in slowdown go to fewer changes, then to less memory.
    """
    best = None
    for cand in _candidates(cfg, st, devices):
        nums = _compute(cfg, counted, cand)
        total = nums["bytes"]["total"]
        if total > budget:
            continue
        key = (round(nums["slowdown"], 9), len(_changes(st, cand)), total)
        if best is None or key < best[0]:
            best = (key, cand)
    return best


def _recommend(est: Estimate, counted: int | None) -> None:
    cfg, st, budget = est.model, est.settings, est.device_memory
    devices = st.devices
    while devices <= MAX_DEVICES:
        best = _best_fit(cfg, counted, st, devices, budget)
        if best is not None:
            break
        devices *= 2
    else:
        est.advice = (
            f"impossible: no combination of checkpointing, ZeRO, tensor/sequence parallelism and fused "
            f"attention fits {format_bytes(budget)} per device on up to {MAX_DEVICES} devices"
        )
        return
    (slowdown, _, _), cand = best
    if est.fits and slowdown >= est.slowdown - 1e-9:
        est.advice = "the requested settings are already the cheapest that fit"
        return
    rec_est = Estimate(cfg, cand, _compute(cfg, counted, cand), budget)
    est.recommendation = Recommendation(
        settings=cand.public(),
        changes=_changes(st, cand),
        devices=devices,
        slowdown=rec_est.slowdown,
        estimate=rec_est,
    )
    if est.fits:
        head = "fits; a faster combination that also fits"
    elif devices == st.devices:
        head = "to fit"
    else:
        head = (
            f"cannot fit on {st.devices} device(s) with any combination; smallest set-up that fits "
            f"uses {devices} devices"
        )
    est.advice = f"recommendation ({head}): {est.recommendation.describe()}"


def estimate(
    model,
    *,
    batch: int = 1,
    seq: int = 2048,
    precision: str = "bf16-mixed",
    optimizer: str = "adam",
    zero_stage: int = 0,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    checkpointing="none",
    attention: str | None = None,
    device_type: str = "cuda",
    device_memory=None,
) -> Estimate:
    """Estimate the per-device memory of training ``model``; optionally, what makes it fit.

    :param model: a name (``llama-7b``, ``llama-13b``, ``llama-70b``, ``gpt2``, ``gpt2-medium``,
        ``gpt2-large``, ``gpt2-xl``; case-insensitive), a dict or dataclass of dimensions
        (``layers, hidden, heads, vocab`` and optionally ``kv_heads, ffn, mlp ("gelu"|"swiglu"),
        norm, tied_embeddings, positions, max_positions, bias, dropout, attention``; see
        :class:`llmmem.estimation.model_configs.ModelConfig`), or an ``nn.Module`` whose parameters are counted
        and whose ``cfg``/``config`` gives the dimensions.
    :param batch: micro-batch per data-parallel rank. :param seq: sequence length.
    :param precision: ``fp32``; ``fp16-mixed`` / ``bf16-mixed`` (16-bit parameters, gradients and
        activations with an fp32 master copy and fp32 optimizer state); ``bf16`` (pure bf16, no
        fp32 copy).
    :param optimizer: ``sgd``, ``sgd-momentum``, ``adam``, ``adamw``.
    :param zero_stage: 0-3, over ``data_parallel`` ranks. :param tensor_parallel: Megatron TP size;
        must divide heads, kv_heads and ffn. :param sequence_parallel: also split the norm/dropout
        activations by ``t`` (no effect when ``t = 1``).
    :param checkpointing: ``"none"``; ``"selective"`` (recompute the attention core, Megatron);
        ``"full"`` (every layer keeps only its input); ``"every-K"`` or an int ``K``: layers
        0, K, 2K, ... are recomputed and the others keep their activations (``K = 1`` is full).
    :param attention: ``"explicit"`` or ``"sdpa"`` (fused kernel); default: the model's.
    :param device_type: ``"cuda"`` (dropout keeps 1-byte masks) or ``"cpu"`` (dropout keeps a noise
        tensor of the activation dtype).
    :param device_memory: bytes per device (``80e9``, ``"80GB"``, ``"80GiB"``); when given, the
        estimate says whether it fits and recommends the combination with the least expected
        slowdown (see ``_slowdown`` for the cost model).
    :raises ValueError: naming the argument, for any invalid input.
    """
    cfg, counted = model_configs.resolve(model)
    st = _settings(
        cfg,
        batch=batch,
        seq=seq,
        precision=precision,
        optimizer=optimizer,
        zero_stage=zero_stage,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        checkpointing=checkpointing,
        attention=attention,
        device_type=device_type,
    )
    budget = None
    if device_memory is not None:
        budget = parse_bytes(device_memory, "device_memory")
        if budget == 0:
            raise ValueError("device_memory: must be more than 0 bytes")
    est = Estimate(cfg, st, _compute(cfg, counted, st), budget)
    if budget is not None:
        _recommend(est, counted)
    return est
