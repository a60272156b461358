"""The vocabulary-parallel head: each rank holds a shard of the weight; the loss and gradients on
2 and 4 gloo ranks equal one process's within 1e-6, the loss bitwise the same on every rank."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed


def _worker(rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F

    import llmmem

    torch.manual_seed(0)
    n, hidden, vocab = 96, 16, 4 * 250
    h_full = torch.randn(n, hidden)
    w_full = torch.randn(vocab, hidden) * 0.3
    b_full = torch.randn(vocab) * 0.1
    y = torch.randint(0, vocab, (n,))
    y[::9] = -100
    for reduction, smoothing, softcap in (("mean", 0.0, None), ("sum", 0.1, 20.0), ("none", 0.0, None)):
        h = h_full.clone().requires_grad_()
        shard = w_full.chunk(world)[rank].clone().requires_grad_()
        b = b_full.chunk(world)[rank].clone().requires_grad_()
        loss = llmmem.linear_cross_entropy(
            h,
            shard,
            y,
            bias=b,
            reduction=reduction,
            label_smoothing=smoothing,
            softcap=softcap,
            group=dist.group.WORLD,
            chunk_size=13,
        )
        up = torch.linspace(0.5, 1.5, n) if reduction == "none" else torch.tensor(1.0)
        loss.backward(up)
        # one process, the whole vocabulary
        h1 = h_full.clone().requires_grad_()
        w1 = w_full.clone().requires_grad_()
        b1 = b_full.clone().requires_grad_()
        ref = llmmem.linear_cross_entropy(
            h1, w1, y, bias=b1, reduction=reduction, label_smoothing=smoothing, softcap=softcap, chunk_size=13
        )
        ref.backward(up)
        logits = F.linear(h_full, w_full, b_full)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        torch_loss = F.cross_entropy(logits, y, reduction=reduction, label_smoothing=smoothing)
        for name, a, r in (
            ("loss", loss, ref),
            ("dh", h.grad, h1.grad),
            ("dw", shard.grad, w1.grad.chunk(world)[rank]),
            ("db", b.grad, b1.grad.chunk(world)[rank]),
        ):
            if not torch.allclose(a, r, rtol=1e-6, atol=1e-6):
                raise AssertionError(f"{reduction} {name}: max diff {(a - r).abs().max().item():.3g}")
        assert torch.allclose(loss, torch_loss, rtol=1e-5, atol=1e-6), reduction
        losses = [torch.zeros_like(loss) for _ in range(world)]
        dist.all_gather(losses, loss.detach().contiguous())
        assert all(torch.equal(losses[0], x) for x in losses), "the loss differs between ranks"


@pytest.mark.parametrize("world", [2, 4])
def test_vocabulary_parallel_equals_one_process(world):
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_worker", world, timeout=180)
