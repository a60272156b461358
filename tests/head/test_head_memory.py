"""The fused head's peak against torch's plain head (measured: live tensor bytes on the CPU), and
that it never holds more than one chunk of logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmmem
from llmmem.diagnostics.live import LiveBytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _peak(fn, *inputs) -> int:
    with LiveBytes() as live:
        live.track(inputs)
        base = live.allocated()
        fn()
        return live.max_allocated() - base


def _plain(h, w, y):
    F.cross_entropy(F.linear(h, w), y).backward()


def test_peak_of_forward_and_backward_is_at_most_a_fifth_of_torchs():
    torch.manual_seed(0)
    n, hidden, vocab = 2048, 128, 16000
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.1).requires_grad_()
    y = torch.randint(0, vocab, (n,))
    torch_peak = _peak(lambda: _plain(h, w, y), h, w, y)
    h.grad = w.grad = None
    ours = _peak(lambda: llmmem.linear_cross_entropy(h, w, y).backward(), h, w, y)
    logits = n * vocab * 4
    assert torch_peak >= 2 * logits  # torch holds the logits and their gradient (or log-softmax) at once
    assert ours <= 0.2 * torch_peak, (ours, torch_peak)
    # what it does hold: the two gradients it returns and one chunk of logits (32 MiB at most here)
    grads = h.numel() * 4 + w.numel() * 4
    assert ours <= grads + (32 << 20) + (1 << 20), (ours, grads)


def test_a_given_chunk_size_bounds_the_logits_held():
    torch.manual_seed(0)
    h = torch.randn(512, 64, requires_grad=True)
    w = torch.randn(20000, 64, requires_grad=True)
    y = torch.randint(0, 20000, (512,))
    peaks = {}
    for rows in (8, 256):
        h.grad = w.grad = None
        peaks[rows] = _peak(
            lambda rows=rows: llmmem.linear_cross_entropy(h, w, y, chunk_size=rows).backward(), h, w, y
        )
    grads = (h.numel() + w.numel()) * 4
    for rows, peak in peaks.items():  # the gradients it returns and one chunk of logits, nothing more
        assert peak <= grads + rows * 20000 * 4 + (256 << 10), (rows, peak, grads)
    assert peaks[256] - peaks[8] >= (256 - 8) * 20000 * 4 * 0.9


def test_chunk_rows_follow_the_memory_target_but_are_never_fewer_than_256():
    from llmmem.head.chunks import chunk_rows

    assert chunk_rows(4096, 32000, 4096 * 256 * 4, None) == 262  # 32 MiB of fp32 logits
    assert chunk_rows(16384, 128256, 16384 * 4096 * 2, None) == 261  # the hidden states' 128 MiB
    assert chunk_rows(8192, 128256, 8192 * 256 * 4, None) == 256  # 32 MiB would be 65 rows
    assert chunk_rows(100, 128256, 100 * 256 * 4, None) == 100  # at most every row
    assert chunk_rows(8192, 128256, 0, 7) == 7


def test_backward_twice_is_refused_clearly():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    loss = llmmem.linear_cross_entropy(h, w, torch.randint(0, 10, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="reduction='none'.*remove the patch"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_is_refused_clearly(reduction):
    # create_graph=True would get gradients without a graph: the passes are not differentiable
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    loss = llmmem.linear_cross_entropy(h, w, torch.randint(0, 10, (4,)), reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="create_graph=True.*remove the patch"):
        torch.autograd.grad(loss, [w], create_graph=True)
