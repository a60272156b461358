"""The small GPT that tests, benchmarks and examples share."""

from __future__ import annotations

import pytest
import torch

from llmmem.models import GPT, GPTConfig


def test_forward_backward_shapes_and_param_count():
    cfg = GPTConfig(layers=2, hidden=64, heads=4, seq_len=32, vocab_size=100, dropout=0.1)
    model = GPT(cfg)
    idx = torch.randint(0, 100, (3, 32))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 32, 100)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    h, f, v, s = 64, 256, 100, 32
    per_layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    assert model.num_parameters() == v * h + s * h + 2 * per_layer + 2 * h
    assert model.head.weight is model.tok_emb.weight


def test_explicit_and_sdpa_attention_agree_without_dropout():
    torch.manual_seed(1)
    a = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab_size=50, dropout=0.0))
    b = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab_size=50, dropout=0.0, attention="sdpa"))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 50, (2, 12))
    torch.testing.assert_close(a(idx)[0], b(idx)[0], rtol=1e-5, atol=1e-5)


def test_causality():
    model = GPT(GPTConfig(layers=1, hidden=32, heads=2, seq_len=8, vocab_size=20, dropout=0.0)).eval()
    idx = torch.randint(0, 20, (1, 8))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 20
    torch.testing.assert_close(model(idx)[0][:, :-1], model(changed)[0][:, :-1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden": 30, "heads": 4}, "heads"),
        ({"layers": 0}, "layers"),
        ({"dropout": 1.0}, "dropout"),
        ({"attention": "flash"}, "attention"),
        ({"vocab_size": -1}, "vocab_size"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_bad_input():
    model = GPT(GPTConfig(layers=1, hidden=32, heads=2, seq_len=8, vocab_size=20))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, seq"):
        model(torch.zeros(9, dtype=torch.long))
