"""Small real models of the tests."""

from __future__ import annotations


def gpt_block(dropout: float = 0.1, attention: str = "explicit"):
    """One block of a small llmmem GPT (hidden 32, 4 heads, 16 positions), the same weights each call."""
    import torch

    from llmmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(layers=1, hidden=32, heads=4, seq_len=16, vocab_size=64, dropout=dropout, attention=attention)
    return GPT(config).blocks[0]
