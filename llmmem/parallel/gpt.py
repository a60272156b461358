"""A tensor-parallel version of :class:`llmmem.models.gpt.GPT`, made from a (pretrained) GPT.

``TensorParallelGPT.from_gpt(gpt)`` splits every large matrix of the model across the tensor-
parallel group, Megatron style: attention heads are divided among ranks (q/k/v column-parallel,
output projection row-parallel), the MLP is Column -> GELU -> Row, the token embedding and the
tied output head are split along the vocabulary, and the loss is the vocab-parallel cross-entropy,
so logits are never gathered. LayerNorms and the position embedding are replicated. The model must
hold the same values on every rank (build it with the same seed, or load the same checkpoint).

``forward(idx, targets=None)`` returns ``(logits, loss)`` like GPT, with ``logits`` this rank's
vocabulary slice ``(b, s, V/t)``.

Dropout (see :mod:`llmmem.parallel.random`): the attention-probability dropout acts on this rank's
heads only, so it draws from the tracker's model-parallel stream (``get_rng_tracker().fork()``),
different on every TP rank and the same on data-parallel replicas; the embedding, residual and MLP
dropouts act on replicated activations (after the all-reduce of a row-parallel layer), so they
draw from the default generators, which must be seeded alike on every TP rank. Training with
dropout > 0 therefore needs ``llmmem.parallel.model_parallel_manual_seed(seed)`` on every rank
first (forward raises otherwise). The masks are not the single-device model's (that one draws the
attention dropout from the default generator), but given the same masks the two compute the same
thing. Checkpoint blocks with ``llmmem.checkpoint``, which replays the tracker's stream.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmmem.models.gpt import GPT, GPTConfig, future_mask
from llmmem.parallel.cross_entropy import vocab_parallel_cross_entropy
from llmmem.parallel.groups import get_tensor_parallel_group
from llmmem.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from llmmem.parallel.random import get_rng_tracker


def _qkv_master_by_rank(w: torch.Tensor, heads: int, t: int) -> torch.Tensor:
    """Reorders the rows of GPT's fused qkv weight (or bias) so that chunk r of t holds, for each
    of q, k, v, the heads of rank r: (3, heads, hd, ...) -> (t, 3, heads/t, hd, ...)."""
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    v = w.reshape(3, t, heads // t, hd, *rest).transpose(0, 1)
    return v.reshape(w.shape).contiguous()


class _TPAttention(nn.Module):
    def __init__(self, ref, cfg: GPTConfig, group, t: int) -> None:
        super().__init__()
        self.heads_local, self.head_dim = cfg.heads // t, cfg.hidden // cfg.heads
        w = _qkv_master_by_rank(ref.qkv.weight.detach(), cfg.heads, t)
        b = _qkv_master_by_rank(ref.qkv.bias.detach(), cfg.heads, t) if ref.qkv.bias is not None else None
        self.qkv = ColumnParallelLinear(
            cfg.hidden,
            3 * cfg.hidden,
            bias=b is not None,
            process_group=group,
            device=w.device,
            dtype=w.dtype,
            _master=(w, b),
        )
        self.proj = RowParallelLinear.from_linear(ref.proj, process_group=group, input_is_parallel=True)
        self.attn_dropout, self.resid_dropout = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        self.dropout_p, self.use_sdpa = cfg.dropout, cfg.attention == "sdpa"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads_local, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        p = self.dropout_p if self.training else 0.0
        # This rank's heads only: a mask independent of the other ranks' (model-parallel stream).
        # No dropout, no fork, so eval and dropout=0 need no seeding.
        split_rng = get_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        if self.use_sdpa:
            with split_rng:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            scores = scores.masked_fill(future_mask(s, x.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            with split_rng:
                probs = self.attn_dropout(probs)
            y = probs @ v
        # after the row-parallel all-reduce the activation is replicated: default generators
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, s, self.heads_local * self.head_dim)))


class _TPMLP(nn.Module):
    def __init__(self, ref, group) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear.from_linear(ref.fc, process_group=group)
        self.proj = RowParallelLinear.from_linear(ref.proj, process_group=group, input_is_parallel=True)
        self.dropout = nn.Dropout(ref.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class _TPBlock(nn.Module):
    def __init__(self, ref, cfg, group, t) -> None:
        super().__init__()
        self.ln1, self.ln2 = _clone(ref.ln1), _clone(ref.ln2)
        self.attn = _TPAttention(ref.attn, cfg, group, t)
        self.mlp = _TPMLP(ref.mlp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _clone(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


class TensorParallelGPT(nn.Module):
    """See the module docstring. Build with :meth:`from_gpt`."""

    def __init__(self, gpt: GPT, process_group=None) -> None:
        super().__init__()
        import torch.distributed as dist

        cfg = gpt.cfg
        group = get_tensor_parallel_group(process_group)
        t = dist.get_world_size(group)
        for name, value in (("heads", cfg.heads), ("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size)):
            if value % t != 0:
                raise ValueError(
                    f"TensorParallelGPT: {name} ({value}) must be divisible by the tensor-parallel size ({t})"
                )
        self.cfg, self.process_group = cfg, group
        self.tok_emb = VocabParallelEmbedding.from_embedding(gpt.tok_emb, process_group=group)
        self.pos_emb = _clone(gpt.pos_emb)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_TPBlock(b, cfg, group, t) for b in gpt.blocks)
        self.ln_f = _clone(gpt.ln_f)
        tied = gpt.head.weight is gpt.tok_emb.weight
        self.head = ColumnParallelLinear.from_linear(gpt.head, process_group=group)
        if tied:
            self.head.weight = self.tok_emb.weight  # both split the (V, h) table by rows the same way

    @classmethod
    def from_gpt(cls, gpt: GPT, process_group=None) -> TensorParallelGPT:
        if not isinstance(gpt, GPT):
            raise TypeError(f"TensorParallelGPT.from_gpt: expected llmmem.models.gpt.GPT, got {type(gpt).__name__}")
        return cls(gpt, process_group)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.dim() != 2:
            raise ValueError(f"TensorParallelGPT: idx must have shape (batch, seq), got {tuple(idx.shape)}")
        s = idx.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"TensorParallelGPT: sequence length {s} exceeds cfg.seq_len={self.cfg.seq_len}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(s, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        # the head is column-parallel without gather: copy_to sums the head's input gradient over ranks
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, process_group=self.process_group)
        return logits, loss
