"""The model state of training one device holds: optimizer moments (torch's optimizers, or
:mod:`llmmem.optim`'s fp32 / bf16 / int8 / int4 formats), master weights and gradients, counted
per parameter tensor.

Pure Python (no torch): the arithmetic of :mod:`llmmem.optim.formats`, which its tests compare
with the bytes a real :class:`llmmem.optim.AdamW` holds.

llmmem's formats keep, per tensor of ``n`` elements (block ``B``, ``min_quantized_numel`` ``q``):

==========  ==============================================  =======================
format      two moments                                     tensors with ``n < q``
==========  ==============================================  =======================
``fp32``    ``8n``                                          (the same)
``bf16``    ``4n``                                          (the same)
``int8``    ``2n + 8·ceil(n / B)`` (one fp32 scale a block)  fp32: ``8n``
``int4``    ``2·ceil(n / 2) + 8·ceil(n / B)``               fp32: ``8n``
==========  ==============================================  =======================

The per-parameter ``step`` counter is a host scalar and is not device memory. The tensors of a
model described by a config (not an ``nn.Module``) are :func:`config_tensors`.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from llmmem.estimation.model_configs import ModelConfig

__all__ = [
    "TORCH_OPTIMIZERS",
    "LLMMEM_OPTIMIZERS",
    "DEFAULT_BLOCK",
    "MIN_QUANTIZED_NUMEL",
    "MIN_BLOCK",
    "MAX_BLOCK",
    "QUANTIZED",
    "moment_bytes",
    "StateCount",
    "llmmem_state",
    "config_tensors",
    "sharded_tensors",
]

# torch's optimizers: moments per parameter, kept in the dtype the precision table gives
TORCH_OPTIMIZERS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
# llmmem.optim's Adam / AdamW: name -> state_dtype (two moments in that format)
LLMMEM_OPTIMIZERS = {
    f"{kind}-{dtype}": dtype for kind in ("adamw", "adam") for dtype in ("fp32", "bf16", "int8", "int4")
}
# as llmmem.optim.formats: elements per scale, the threshold below which fp32 moments are kept
DEFAULT_BLOCK = {"int8": 256, "int4": 128}
MIN_QUANTIZED_NUMEL = 4096
MIN_BLOCK, MAX_BLOCK = 32, 4096
QUANTIZED = ("int8", "int4")


def moment_bytes(state_dtype: str, numel: int, block: int | None = None) -> int:
    """Bytes of both moments of an ``numel``-element tensor in ``state_dtype``, scales included."""
    if state_dtype == "fp32":
        return 8 * numel
    if state_dtype == "bf16":
        return 4 * numel
    block = block or DEFAULT_BLOCK[state_dtype]
    values = numel if state_dtype == "int8" else (numel + 1) // 2
    return 2 * (values + 4 * -(-numel // block))


@dataclass(frozen=True)
class StateCount:
    """llmmem's moments over a list of tensors: ``bytes`` in all; ``kept_fp32`` tensors (and
    ``kept_fp32_numel`` elements) below ``min_quantized_numel`` that keep fp32 moments."""

    bytes: int
    kept_fp32: int = 0
    kept_fp32_numel: int = 0


def llmmem_state(state_dtype: str, numels, block: int | None = None, min_quantized_numel: int = MIN_QUANTIZED_NUMEL):
    """The :class:`StateCount` of ``llmmem.optim.AdamW(state_dtype=..., block_size=block,
    min_quantized_numel=...)`` over tensors of ``numels`` elements."""
    total = kept = kept_numel = 0
    for n, count in Counter(numels).items():  # a model repeats its layers' sizes: count each once
        if state_dtype in QUANTIZED and n < min_quantized_numel:
            total += count * moment_bytes("fp32", n)
            kept += count
            kept_numel += count * n
        else:
            total += count * moment_bytes(state_dtype, n, block)
    return StateCount(total, kept, kept_numel)


@functools.lru_cache(maxsize=256)  # the recommendation search asks for the same few thousands of times
def _config_tensors(cfg: ModelConfig, seq: int, tensor_parallel: int) -> tuple[int, ...]:
    return tuple(_layout(cfg, seq, tensor_parallel))


def config_tensors(cfg: ModelConfig, seq: int = 0, tensor_parallel: int = 1) -> list[int]:
    """The element counts of the parameter tensors one tensor-parallel rank holds for ``cfg``,
    laid out as the common implementations are: one fused Q/K/V matrix for GPT-2-style models
    (learned positions: Hugging Face's GPT-2, llmmem's GPT), separate Q, K, V otherwise (LLaMA);
    separate gate and up matrices of a SwiGLU MLP; Megatron's split (column-parallel weights and
    biases, row-parallel weights divided by ``t``; row-parallel biases and norms replicated;
    the embedding vocabulary-parallel). Their sum is ``cfg.parameters(seq, tensor_parallel)``."""
    return list(_config_tensors(cfg, seq, tensor_parallel))


def _layout(cfg: ModelConfig, seq: int, t: int) -> list[int]:
    h = cfg.hidden
    width, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    fused_qkv = cfg.positions == "learned" and cfg.architecture == "decoder"  # GPT-2's c_attn
    norm = [h, h] if cfg.norm == "layernorm" and cfg.norm_bias else [h]
    layer: list[int] = []
    if fused_qkv:
        layer.append(h * (width + 2 * kv) // t)
        layer += [(width + 2 * kv) // t] if cfg.bias or cfg.qkv_bias else []
    else:
        layer += [h * width // t, h * kv // t, h * kv // t]
        layer += [width // t, kv // t, kv // t] if cfg.bias or cfg.qkv_bias else []
    attention = list(layer)
    layer.append(width * h // t)  # attention output (row-parallel)
    layer += [h] if cfg.bias else []
    layer += norm * cfg.layer_norms
    if cfg.qk_norm != "none":  # the query and key norms: of a head, or of all the heads
        q, k = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (width, kv)
        layer += [q, k] * (2 if cfg.norm == "layernorm" else 1)
    dense = layer + _mlp_layout(cfg, cfg.ffn, t)
    out = dense * (cfg.layers - cfg.moe_layers)
    if cfg.decoder_layers:  # an encoder-decoder's decoder: a cross-attention beside the self-attention
        cross = attention + [width * h // t] + ([h] if cfg.bias else []) + norm
        out += (dense + cross) * cfg.decoder_layers
    if cfg.moe_layers:
        # the router, then each projection of all the experts as one tensor (Hugging Face's
        # [experts, out, in] parameters), then the shared experts and their gate
        moe = layer + [h * cfg.experts] + [cfg.experts * n for n in _mlp_layout(cfg, cfg.expert_ffn, t)]
        if cfg.shared_ffn:
            moe += _mlp_layout(cfg, cfg.shared_ffn, t) + ([h] if cfg.shared_gate else [])
        out += moe * cfg.moe_layers
    out += norm * cfg.stacks
    vocab_rows = -(-cfg.vocab // t)
    if vocab_rows:
        out += [vocab_rows * h] * (1 if cfg.tied_embeddings or not cfg.vocab_head else 2)
    if cfg.positions == "learned":
        out += [max(cfg.max_positions, seq) * h] * cfg.stacks
    return out + list(cfg.extra_tensors)


def _mlp_layout(cfg: ModelConfig, f: int, t: int) -> list[int]:
    h = cfg.hidden
    up = 1 if cfg.mlp == "gelu" else 2  # GELU: up; SwiGLU: gate and up
    out = [h * f // t] * up + [f * h // t]
    out += ([f // t] * up + [h]) if cfg.bias else []
    return out


def sharded_tensors(shapes, tensor_parallel: int = 1) -> list[int]:
    """Element counts of a module's parameter tensors (their ``shapes``) on one tensor-parallel
    rank: matrices divided by ``t`` (rounded up), vectors (norms, biases) replicated. An
    approximation of how a model is split: a module does not say how it would be."""
    out = []
    for shape in shapes:
        n = math.prod(shape)
        out.append(-(-n // tensor_parallel) if len(shape) >= 2 else n)
    return out
