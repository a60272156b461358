"""llmmem.linear_cross_entropy against F.cross_entropy(F.linear(...)): the loss within rtol 1e-5
and the gradients within 1e-4 in fp32, for every reduction, label smoothing, softcap, bias,
ignore_index (a batch that ignores every row included), chunk sizes and shapes; bf16 and fp16
within 2e-2 of fp32 math; under autocast; with no grad; the C passes against the torch-ops
reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmmem
from llmmem.head import kernels, passes
from llmmem.head.loss import _linear_cross_entropy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _torch(h, w, y, b=None, reduction="mean", label_smoothing=0.0, softcap=None, ignore_index=-100):
    logits = F.linear(h, w, b)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(
        logits.float().reshape(-1, w.shape[0]),
        y.reshape(-1),
        reduction=reduction,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
    ).reshape(y.shape if reduction == "none" else ())


def _inputs(shape=(3, 37), hidden=24, vocab=513, dtype=torch.float32, bias=False, seed=0):
    torch.manual_seed(seed)
    h = torch.randn(*shape, hidden).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(vocab) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, vocab, shape)
    y.view(-1)[1::5] = -100
    return h, w, b, y


def _grads(loss, inputs, upstream):
    return torch.autograd.grad(loss, [t for t in inputs if t is not None], upstream)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_torch(reduction, label_smoothing, softcap, bias):
    h, w, b, y = _inputs(bias=bias)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, softcap=softcap)
    ref = _torch(h, w, y, b, **kw)
    got = llmmem.linear_cross_entropy(h, w, y, bias=b, chunk_size=19, **kw)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    up = torch.randn_like(ref) if reduction == "none" else torch.tensor(0.7)
    for a, r in zip(_grads(got, (h, w, b), up), _grads(ref, (h, w, b), up)):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 10_000])
@pytest.mark.parametrize("shape", [(1,), (64,), (2, 3, 5)])
def test_chunks_and_shapes(chunk_size, shape):
    h, w, _, y = _inputs(shape=shape, vocab=2049)
    got = llmmem.linear_cross_entropy(h, w, y, chunk_size=chunk_size)
    ref = _torch(h, w, y)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, r in zip(_grads(got, (h, w), torch.tensor(1.0)), _grads(ref, (h, w), torch.tensor(1.0))):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_batch_that_ignores_every_row_gives_torchs_answer(reduction):
    h, w, _, y = _inputs(shape=(6,))
    y[:] = -100
    got = llmmem.linear_cross_entropy(h, w, y, reduction=reduction)
    ref = _torch(h, w, y, reduction=reduction)
    torch.testing.assert_close(got, ref, equal_nan=True)  # mean: 0 / 0 = NaN in both
    if reduction != "mean":
        gh, gw = _grads(got, (h, w), torch.ones_like(got))
        assert not gh.any() and not gw.any()


def test_another_ignore_index_and_every_label_in_one_row():
    h, w, _, y = _inputs(shape=(40,), vocab=7)
    y = torch.arange(40) % 7
    y[3] = 5
    got = llmmem.linear_cross_entropy(h, w, y, ignore_index=5)
    torch.testing.assert_close(got, _torch(h, w, y, ignore_index=5), rtol=1e-5, atol=1e-6)


def test_a_masked_part_of_the_vocabulary_gives_torchs_answer():
    # -inf logits from the bias (padded or banned tokens), in whole blocks of a row and scattered
    h, w, _, y = _inputs(shape=(2, 9), vocab=6000)
    for masked in (slice(2500, None), slice(1, None, 2)):
        b = torch.zeros(6000)
        b[masked] = float("-inf")
        y2 = y.clamp(min=0) // 2 * 2 if masked.step else y.clamp(min=0) % 2500
        got = llmmem.linear_cross_entropy(h, w, y2, bias=b)
        ref = _torch(h, w, y2, b)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for a, r in zip(_grads(got, (h, w), torch.tensor(1.0)), _grads(ref, (h, w), torch.tensor(1.0))):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_2e_2_of_fp32_math(dtype):
    h, w, b, y = _inputs(dtype=dtype, bias=True, vocab=1000)
    got = llmmem.linear_cross_entropy(h, w, y, bias=b)
    assert got.dtype == dtype
    ref = _torch(h.float(), w.float(), y, b.float())  # fp32 math on the same (rounded) inputs
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    ga = _grads(got, (h, w, b), torch.tensor(1.0, dtype=dtype))
    gr = _grads(_torch(h, w, y, b), (h, w, b), torch.tensor(1.0))
    for a, r in zip(ga, gr):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-2 * float(r.abs().max()))


def test_under_autocast_and_without_grad():
    h, w, _, y = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = llmmem.linear_cross_entropy(h.bfloat16(), w.bfloat16(), y)
        ref = _torch(h.bfloat16(), w.bfloat16(), y)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        got = llmmem.linear_cross_entropy(h, w, y)
    assert not got.requires_grad
    torch.testing.assert_close(got, _torch(h, w, y).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_c_passes_equal_the_torch_reference(softcap):
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(33, 3001) * 6).to(dtype)
        labels = torch.randint(-1, 3001, (33,))
        s = kernels.Settings(vocab_start=0, vocab_total=3001, ignore_index=-1, label_smoothing=0.1, softcap=softcap)
        a, r = passes.stats(logits, labels, s), kernels.stats_reference(logits, labels, s)
        for x, z in zip((a.max, a.sum, a.target, a.zsum), (r.max, r.sum, r.target, r.zsum)):
            torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-4)
        lse, scale = r.max + r.sum.log(), torch.rand(33) + 0.5
        g1, g2 = logits.clone(), logits.clone()
        passes.grad_(g1, labels, s, lse, scale)
        kernels.grad_reference_(g2, labels, s, lse, scale)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(g1.float(), g2.float(), rtol=tol, atol=1e-7)


def test_fp16_under_a_loss_scale_of_2_16_keeps_torchs_small_gradients():
    # at 2k tokens and a 32k vocabulary the logits' gradient softmax / tokens (~1.5e-8) is under
    # fp16's smallest subnormal: only the scale (2**16) keeps it, as it does in the plain head
    torch.manual_seed(0)
    n, hidden, vocab = 2048, 4, 32000
    h32, w32 = torch.randn(n, hidden), torch.randn(vocab, hidden) * 0.02
    y = torch.randint(0, vocab, (n,))
    y[::9] = -100

    def unscaled_grads(fn, dtype, scale):
        h, w = h32.to(dtype, copy=True).requires_grad_(), w32.to(dtype, copy=True).requires_grad_()
        (fn(h, w) * scale).backward()
        return [t.grad.float() / scale for t in (h, w)]

    def plain(h, w):
        return F.cross_entropy(F.linear(h, w).float(), y)

    def fused(h, w):  # patch_lm_loss's call: an fp32 loss, so 2**16 is finite upstream
        return _linear_cross_entropy(h, w, y, None, -100, "mean", 0.0, None, None, None, torch.float32)

    want = unscaled_grads(fused, torch.float32, 1.0)  # torch's within 1e-4 (above), and faster
    torchs = unscaled_grads(plain, torch.float16, 2.0**16)
    ours = unscaled_grads(fused, torch.float16, 2.0**16)
    for name, r, t, o in zip(("hidden", "weight"), want, torchs, ours):
        assert float((o == 0).float().mean()) <= float((t == 0).float().mean()) + 1e-3, name
        err, torch_err = float((o - r).norm() / r.norm()), float((t - r).norm() / r.norm())
        assert err <= 1.5 * torch_err + 1e-5, (name, err, torch_err)
