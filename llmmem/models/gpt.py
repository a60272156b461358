"""A small decoder-only GPT (GPT-2 layout) used by llmmem's tests, benchmarks and examples.

It is written for measuring memory, so the activations it keeps are the textbook ones that
Megatron-LM's per-layer estimate counts (Korthikanti et al. 2022, section 4.1): the attention
is computed explicitly (QK^T, softmax, dropout on the probabilities, probabilities x V) unless
``attention="sdpa"`` asks for PyTorch's fused kernel. Blocks live in ``model.blocks`` (an
``nn.ModuleList``) so they can be checkpointed or planned one by one; each block maps a
``(batch, seq, hidden)`` tensor to one of the same shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Dimensions of :class:`GPT`. ``ffn_hidden`` defaults to ``4 * hidden``."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_len: int = 128
    vocab_size: int = 512
    ffn_hidden: int | None = None
    dropout: float = 0.1
    attention: str = "explicit"  # "explicit" (QK^T / softmax / dropout kept) or "sdpa" (fused)
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.hidden % self.heads != 0:
            raise ValueError(f"GPTConfig: heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden
        if not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0:
            raise ValueError(f"GPTConfig: ffn_hidden must be a positive int, got {self.ffn_hidden!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if self.attention not in ("explicit", "sdpa"):
            raise ValueError(f"GPTConfig: attention must be 'explicit' or 'sdpa', got {self.attention!r}")


def future_mask(s: int, device=None) -> torch.Tensor:
    """The ``(s, s)`` bool mask of what causal attention hides from position ``i``: every ``j > i``.

    Made per call, not kept as a ``seq_len x seq_len`` buffer per layer: ``masked_fill`` keeps its
    mask for backward either way (``s²`` bytes a layer, beside the ``4·a·s²·b`` of the scores it
    masks), and the fused kernel (``is_causal``) needs none.
    """
    i = torch.arange(s, device=device)
    return i[None, :] > i[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout_p = cfg.dropout
        self.use_sdpa = cfg.attention == "sdpa"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        # (b, s, 3h) -> three (b, heads, s, head_dim)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.use_sdpa:
            p = self.dropout_p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (b, heads, s, s)
            scores = scores.masked_fill(future_mask(s, x.device), float("-inf"))
            probs = self.attn_dropout(torch.softmax(scores, dim=-1))
            y = probs @ v
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``cfg.layers`` blocks, a final LayerNorm and a tied LM head.

    ``forward(idx, targets=None)`` takes token ids ``(batch, seq)`` and returns
    ``(logits, loss)``; ``loss`` is ``None`` without targets.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(b, s)`` to the first block's input ``(b, s, hidden)``."""
        if idx.dim() != 2:
            raise ValueError(f"GPT: idx must have shape (batch, seq), got {tuple(idx.shape)}")
        s = idx.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence length {s} exceeds cfg.seq_len={self.cfg.seq_len}")
        pos = torch.arange(s, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        """Parameters counted once (the tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())
