"""Megatron-style sequence parallelism for :class:`llmmem.parallel.TensorParallelGPT`:
:class:`SequenceParallelGPT` (``llmmem.parallel.SequenceParallelGPT``).

Tensor parallelism splits the attention heads and the MLP's hidden units across ranks, but leaves
the LayerNorms, dropouts and residual adds working on the whole ``(batch, seq, hidden)`` activation
on every rank. With sequence parallelism those run on this rank's slice of the sequence
(``seq / t`` positions), so what they keep for backward is divided by ``t`` too: the column-parallel
layers all-gather their input along the sequence instead of copying it, the row-parallel layers
reduce-scatter their output instead of all-reducing it (the same bytes on the wire), and the
vocabulary-parallel embedding reduce-scatters. Parameters applied to a sequence slice (LayerNorms,
the position embedding, row-parallel biases) get a partial gradient on each rank:
:func:`llmmem.parallel.allreduce_sequence_parallel_grads` sums them after backward.

``SequenceParallelGPT(tp_model)`` reuses ``tp_model``'s parameters (same ``state_dict`` keys) and
computes what it computes, given the same dropout masks. The sequence length must be divisible by
the tensor-parallel size. Dropout inside the sequence-parallel region draws from the tracker's
model-parallel stream (``llmmem.parallel.model_parallel_manual_seed`` first, as for TP dropout).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from llmmem.models.gpt import future_mask
from llmmem.parallel.cross_entropy import vocab_parallel_cross_entropy
from llmmem.parallel.gpt import TensorParallelGPT
from llmmem.parallel.random import get_rng_tracker

__all__ = ["SequenceParallelGPT"]


def _split_rng(p: float, training: bool):
    # Each rank drops out different positions: a stream that differs between TP ranks.
    return get_rng_tracker().fork() if p > 0 and training else contextlib.nullcontext()


def _mark(module: nn.Module) -> None:
    for p in module.parameters():
        p.sequence_parallel = True


class _SPAttention(nn.Module):
    def __init__(self, ref) -> None:
        super().__init__()
        self.qkv, self.proj = ref.qkv, ref.proj
        self.attn_dropout, self.resid_dropout = ref.attn_dropout, ref.resid_dropout
        self.heads_local, self.head_dim = ref.heads_local, ref.head_dim
        self.dropout_p, self.use_sdpa = ref.dropout_p, ref.use_sdpa
        for layer in (self.qkv, self.proj):
            layer.sequence_parallel, layer.sequence_dim = True, 1
        if self.proj.bias is not None:
            self.proj.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # all-gathered along the sequence: (b, s, 3 h / t)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.heads_local, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        p = self.dropout_p if self.training else 0.0
        heads_rng = get_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        if self.use_sdpa:
            with heads_rng:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            scores = scores.masked_fill(future_mask(s, x.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            with heads_rng:
                probs = self.attn_dropout(probs)
            y = probs @ v
        y = self.proj(y.transpose(1, 2).reshape(b, s, self.heads_local * self.head_dim))  # (b, s / t, h)
        with _split_rng(self.resid_dropout.p, self.training):
            return self.resid_dropout(y)


class _SPMLP(nn.Module):
    def __init__(self, ref) -> None:
        super().__init__()
        self.fc, self.proj, self.dropout = ref.fc, ref.proj, ref.dropout
        for layer in (self.fc, self.proj):
            layer.sequence_parallel, layer.sequence_dim = True, 1
        if self.proj.bias is not None:
            self.proj.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(F.gelu(self.fc(x)))
        with _split_rng(self.dropout.p, self.training):
            return self.dropout(y)


class _SPBlock(nn.Module):
    def __init__(self, ref) -> None:
        super().__init__()
        self.ln1, self.ln2 = ref.ln1, ref.ln2
        _mark(self.ln1)
        _mark(self.ln2)
        self.attn, self.mlp = _SPAttention(ref.attn), _SPMLP(ref.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SequenceParallelGPT(nn.Module):
    """``tp_model`` (a :class:`~llmmem.parallel.TensorParallelGPT`) with sequence parallelism on.

    ``forward(idx, targets=None)`` takes the whole ``(batch, seq)`` token ids on every rank of the
    tensor-parallel group and returns ``(logits, loss)``: ``logits`` this rank's vocabulary slice
    over the whole sequence ``(b, s, V / t)``, ``loss`` the mean over all tokens. Memory: the
    activations between the parallel layers are ``1 / t`` of TP's.
    """

    def __init__(self, tp_model: TensorParallelGPT) -> None:
        super().__init__()
        if not isinstance(tp_model, TensorParallelGPT):
            raise TypeError(f"SequenceParallelGPT: expected a TensorParallelGPT, got {type(tp_model).__name__}")
        self.cfg, self.process_group = tp_model.cfg, tp_model.process_group
        self.tp_size = dist.get_world_size(self.process_group)
        self.tp_rank = dist.get_rank(self.process_group)
        self.tok_emb, self.pos_emb, self.drop = tp_model.tok_emb, tp_model.pos_emb, tp_model.drop
        self.tok_emb.sequence_parallel, self.tok_emb.sequence_dim = True, 1
        _mark(self.pos_emb)
        self.blocks = nn.ModuleList(_SPBlock(b) for b in tp_model.blocks)
        self.ln_f, self.head = tp_model.ln_f, tp_model.head
        _mark(self.ln_f)
        self.head.sequence_parallel, self.head.sequence_dim = True, 1

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.dim() != 2:
            raise ValueError(f"SequenceParallelGPT: idx must have shape (batch, seq), got {tuple(idx.shape)}")
        s = idx.shape[1]
        if s > self.cfg.seq_len or s % self.tp_size != 0:
            raise ValueError(
                f"SequenceParallelGPT: sequence length {s} must be at most cfg.seq_len={self.cfg.seq_len} "
                f"and divisible by the tensor-parallel size {self.tp_size}"
            )
        chunk = s // self.tp_size
        x = self.tok_emb(idx)  # reduce-scattered: this rank's positions (b, s / t, h)
        pos = torch.arange(self.tp_rank * chunk, (self.tp_rank + 1) * chunk, device=idx.device)
        x = x + self.pos_emb(pos)
        with _split_rng(self.drop.p, self.training):
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # all-gathered along the sequence: (b, s, V / t)
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, process_group=self.process_group)
        return logits, loss

    def num_parameters(self) -> int:
        """Parameters held by this rank (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())
