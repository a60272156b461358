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


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_no_seq_by_seq_buffer(attention):
    # The report: a seq x seq causal mask per layer (10 GB at seq 100000) was built at construction,
    # even for sdpa, which masks with is_causal. Here seq 2048: 4 MiB a layer before.
    cfg = GPTConfig(layers=2, hidden=32, heads=2, seq_len=2048, vocab_size=50, dropout=0.0, attention=attention)
    model = GPT(cfg)
    assert sum(b.numel() for b in model.buffers()) < cfg.seq_len
    logits, _ = model(torch.randint(0, 50, (1, 16)))
    assert logits.shape == (1, 16, 50)


@pytest.mark.parametrize("s", [16, 11])
def test_the_causal_mask_made_per_call_changes_nothing(s, monkeypatch):
    """Bit for bit the outputs, loss and gradients of the former mask (a seq_len x seq_len lower
    triangle, sliced to s and inverted), with dropout on: the mask draws no random numbers."""
    import llmmem.models.gpt as gpt

    cfg = GPTConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab_size=50, dropout=0.1)
    idx = torch.randint(0, 50, (3, s))

    def run():
        torch.manual_seed(7)
        model = GPT(cfg)
        logits, loss = model(idx, idx)
        loss.backward()
        return logits.detach(), loss.detach(), [p.grad for p in model.parameters()]

    got = run()
    former = ~torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
    assert torch.equal(gpt.future_mask(s), former[:s, :s])
    monkeypatch.setattr(
        gpt,
        "future_mask",
        lambda n, device=None: ~torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool, device=device).tril()[:n, :n],
    )
    want = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
