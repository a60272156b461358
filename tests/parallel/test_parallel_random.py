"""Dropout streams of a tensor-parallel model: llmmem.parallel.random and its use in TensorParallelGPT.

Single-process tests cover the tracker itself (fork semantics, misuse) and its replay under
activation checkpointing. The distributed ones (gloo, spawned ranks) check, on a TP GPT with
dropout > 0: (a) exact correspondence: with every dropout mask recorded on the TP ranks and the
split-region masks gathered, the single-process GPT given those masks computes the same loss and
gradients; (b) the stream properties: replicated-region masks identical across TP ranks,
split-region masks different across TP ranks, identical across data-parallel replicas and across
runs with the same seed; (c) gradients equal with and without llmmem.checkpoint on the blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import llmmem
from llmmem.parallel.random import RNGStatesTracker

TOL = dict(rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# the tracker, one process


def test_fork_swaps_the_default_generator_and_keeps_the_stream():
    tracker = RNGStatesTracker()
    tracker.add("s", 1234)
    torch.manual_seed(0)
    outside_want = torch.rand(8)
    torch.manual_seed(0)
    with tracker.fork("s"):
        a = torch.rand(5)
    outside = torch.rand(8)
    with tracker.fork("s"):
        b = torch.rand(3)
    # the block's draws did not move the default generator on ...
    assert torch.equal(outside, outside_want)
    # ... and the stream continued where it stopped: two forks draw what one generator seeded
    # with the stream's seed draws in a row
    g = torch.Generator().manual_seed(1234)
    assert torch.equal(torch.cat([a, b]), torch.rand(8, generator=g))


def test_fork_restores_the_default_generator_on_error():
    tracker = RNGStatesTracker()
    tracker.add("s", 5)
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    with pytest.raises(ZeroDivisionError):
        with tracker.fork("s"):
            torch.rand(100)
            1 / 0
    assert torch.equal(torch.rand(4), want)
    with tracker.fork("s"):  # not left marked as forked
        pass


def test_tracker_misuse():
    tracker = RNGStatesTracker()
    with pytest.raises(RuntimeError, match="model_parallel_manual_seed"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(TypeError, match="seed"):
        tracker.add("c", 1.5)
    with pytest.raises(TypeError, match="name"):
        tracker.add("", 7)
    with tracker.fork("a"):
        with pytest.raises(RuntimeError, match="nested"):
            with tracker.fork("a"):
                pass
        with pytest.raises(RuntimeError, match="forked"):
            tracker.set_states({})
    with pytest.raises(TypeError, match="get_states"):
        tracker.set_states([1])


def test_get_set_states_round_trip():
    tracker = RNGStatesTracker()
    tracker.add("s", 9)
    saved = tracker.get_states()
    with tracker.fork("s"):
        first = torch.rand(6)
    tracker.set_states(saved)
    with tracker.fork("s"):
        again = torch.rand(6)
    assert torch.equal(first, again)
    tracker.reset()
    assert not tracker.is_initialized("s")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_replays_the_tracker(use_reentrant):
    """A dropout under fork inside a checkpointed region: the recompute must draw the forward's mask
    (gradients equal to the plain run), and must not move the stream on."""
    tracker = RNGStatesTracker()
    w = torch.randn(64, 64)

    def region(x):
        h = x @ w
        with tracker.fork("s"):
            h = F.dropout(h, p=0.5)
        return F.dropout(h, p=0.3).tanh()  # and one on the default generator

    grads = []
    after = []
    for ckpt in (False, True):
        tracker.reset()
        tracker.add("s", 77)
        torch.manual_seed(0)
        x = torch.randn(8, 64, requires_grad=True)
        y = llmmem.checkpoint(region, x, use_reentrant=use_reentrant) if ckpt else region(x)
        with tracker.fork("s"):  # the stream moves on between forward and backward
            torch.rand(10)
        y.square().sum().backward()
        grads.append(x.grad)
        with tracker.fork("s"):
            after.append(torch.rand(4))
    assert torch.allclose(grads[0], grads[1], **TOL)
    assert torch.equal(after[0], after[1])


@pytest.mark.cuda
def test_fork_swaps_the_cuda_generator_and_checkpoint_replays_it():
    """On CUDA: the current device's generator is swapped (dropout on a CUDA tensor draws from the
    stream), the default CUDA generator is left as it was, and llmmem.checkpoint replays the stream."""
    dev = torch.device("cuda", torch.cuda.current_device())
    tracker = RNGStatesTracker()
    tracker.add("s", 31)
    torch.cuda.manual_seed(0)
    want = torch.rand(16, device=dev)
    torch.cuda.manual_seed(0)
    with tracker.fork("s"):
        a = torch.rand(16, device=dev)
    assert torch.equal(torch.rand(16, device=dev), want)
    with tracker.fork("s"):
        b = torch.rand(16, device=dev)
    # (CUDA generators advance by a per-kernel offset: compare call for call, not one rand(32))
    g = torch.Generator(device=dev).manual_seed(31)
    assert torch.equal(a, torch.rand(16, device=dev, generator=g))
    assert torch.equal(b, torch.rand(16, device=dev, generator=g))

    w = torch.randn(64, 64, device=dev)

    def region(x):
        with tracker.fork("s"):
            return F.dropout(x @ w, p=0.5).tanh()

    grads = []
    for ckpt in (False, True):
        tracker.reset()
        tracker.add("s", 32)
        x = torch.randn(8, 64, device=dev, generator=torch.Generator(device=dev).manual_seed(1), requires_grad=True)
        y = llmmem.checkpoint(region, x, use_reentrant=False) if ckpt else region(x)
        with tracker.fork("s"):
            torch.rand(10, device=dev)
        y.square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


# --------------------------------------------------------------------------------------------
# TensorParallelGPT on gloo ranks


class _Record(nn.Module):
    """Wraps a dropout module: draws exactly what it draws (same shape, same generator) and keeps
    the mask (already scaled by 1/(1-p)), so that the applied mask can be compared and replayed."""

    def __init__(self, dropout: nn.Module, log: list, kind: str) -> None:
        super().__init__()
        self.dropout, self.log, self.kind = dropout, log, kind

    def forward(self, x):
        mask = self.dropout(torch.ones_like(x))
        self.log.append((self.kind, mask))
        return x * mask


class _Fixed(nn.Module):
    """Applies masks recorded elsewhere, in order (none in eval mode, as dropout)."""

    def __init__(self, masks: list) -> None:
        super().__init__()
        self.masks = masks

    def forward(self, x):
        return x * self.masks.pop(0) if self.training else x


def _instrument_tp(model, log):
    model.drop = _Record(model.drop, log, "replicated")
    for blk in model.blocks:
        blk.attn.attn_dropout = _Record(blk.attn.attn_dropout, log, "split")
        blk.attn.resid_dropout = _Record(blk.attn.resid_dropout, log, "replicated")
        blk.mlp.dropout = _Record(blk.mlp.dropout, log, "replicated")


def _gpt_cfg(attention="explicit"):
    from llmmem.models.gpt import GPTConfig

    return GPTConfig(layers=2, hidden=16, heads=4, seq_len=8, vocab_size=32, dropout=0.3, attention=attention)


def _batch():
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _tp_run(ref, seed, *, checkpoint=False, log=None, use_reentrant=False):
    """Seed, build the TP model from ``ref``, one forward/backward; returns (loss, model)."""
    from llmmem.parallel import TensorParallelGPT, model_parallel_manual_seed

    model = TensorParallelGPT.from_gpt(ref)
    if log is not None:
        _instrument_tp(model, log)
    if checkpoint:
        model.blocks = nn.ModuleList(_Checkpointed(b, use_reentrant) for b in model.blocks)
    idx, tgt = _batch()
    model_parallel_manual_seed(seed)
    _, loss = model(idx, tgt)
    loss.backward()
    return loss, model


class _Checkpointed(nn.Module):
    def __init__(self, block, use_reentrant):
        super().__init__()
        self.block, self.use_reentrant = block, use_reentrant

    def forward(self, x):
        return llmmem.checkpoint(self.block, x, use_reentrant=self.use_reentrant)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _all_gather(t, group):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _close(name, got, want):
    if not torch.allclose(got, want, **TOL):
        raise AssertionError(f"{name}: max abs diff {(got - want).abs().max().item():.3g}")


def _check_exact_correspondence(rank, world, tp_group):
    """The single-process GPT with the TP model's masks computes the TP model's loss and gradients."""
    import torch.distributed as dist

    from llmmem.models.gpt import GPT

    t, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    torch.manual_seed(4)
    ref = GPT(_gpt_cfg())
    log = []
    loss, model = _tp_run(ref, seed=1234, log=log)
    # The reference sees full-head attention masks: rank r holds heads [r*H/t, (r+1)*H/t), so the
    # ranks' masks concatenated along the head dimension (dim 1 of (b, heads, s, s)) in rank order.
    masks = [torch.cat(_all_gather(m, tp_group), dim=1) if kind == "split" else m for kind, m in log]
    ref.drop = _Fixed(masks[:1])
    for i, blk in enumerate(ref.blocks):
        blk.attn.attn_dropout = _Fixed([masks[1 + 3 * i]])
        blk.attn.resid_dropout = _Fixed([masks[2 + 3 * i]])
        blk.mlp.dropout = _Fixed([masks[3 + 3 * i]])
    idx, tgt = _batch()
    _, ref_loss = ref(idx, tgt)
    ref_loss.backward()
    _close("loss with dropout", loss.detach(), ref_loss.detach())
    shard = lambda g, dim: g.chunk(t, dim=dim)[r]  # noqa: E731
    _close("tied embedding grad", model.tok_emb.weight.grad, shard(ref.tok_emb.weight.grad, 0))
    _close("pos emb grad", model.pos_emb.weight.grad, ref.pos_emb.weight.grad)
    for i in range(2):
        tb, rb = model.blocks[i], ref.blocks[i]
        _close(f"block {i} ln1 grad", tb.ln1.weight.grad, rb.ln1.weight.grad)
        _close(f"block {i} attn proj grad", tb.attn.proj.weight.grad, shard(rb.attn.proj.weight.grad, 1))
        _close(f"block {i} mlp fc grad", tb.mlp.fc.weight.grad, shard(rb.mlp.fc.weight.grad, 0))
        _close(f"block {i} mlp proj bias grad", tb.mlp.proj.bias.grad, rb.mlp.proj.bias.grad)
    # dropout did act: a loss without it differs
    ref.eval()
    assert not torch.allclose(ref(idx, tgt)[1], ref_loss)


def _check_stream_properties(rank, world, tp_group, dp_group):
    import torch.distributed as dist

    from llmmem.models.gpt import GPT

    torch.manual_seed(4)
    ref = GPT(_gpt_cfg())
    runs = []
    for _ in range(2):
        log = []
        _tp_run(ref, seed=1234, log=log)
        runs.append(log)
    log = runs[0]
    assert [k for k, _ in log] == ["replicated"] + ["split", "replicated", "replicated"] * 2
    for i, ((kind, m), (_, again)) in enumerate(zip(log, runs[1])):
        assert torch.equal(m, again), f"mask {i} ({kind}) differs between two runs with the same seed"
        others = _all_gather(m, tp_group)
        if kind == "replicated":
            assert all(torch.equal(m, o) for o in others), f"replicated mask {i} differs across TP ranks"
        else:
            me = dist.get_rank(tp_group)
            assert not any(torch.equal(m, o) for j, o in enumerate(others) if j != me), (
                f"split mask {i} is the same on two TP ranks"
            )
            assert (m == 0).any() and (m != 0).any()
        if dp_group is not None:
            assert all(torch.equal(m, o) for o in _all_gather(m, dp_group)), (
                f"{kind} mask {i} differs across data-parallel replicas"
            )
    # a different seed: different split-region masks
    other = []
    _tp_run(ref, seed=4321, log=other)
    assert not torch.equal(other[1][1], log[1][1])


def _check_checkpoint_replay(rank, world):
    """Gradients with every block under llmmem.checkpoint equal those without (same seed)."""
    from llmmem.models.gpt import GPT

    for attention in ("explicit", "sdpa"):
        torch.manual_seed(4)
        ref = GPT(_gpt_cfg(attention))
        loss0, plain = _tp_run(ref, seed=1234)
        for use_reentrant in (False, True):
            loss1, ckpt = _tp_run(ref, seed=1234, checkpoint=True, use_reentrant=use_reentrant)
            _close(f"{attention} loss under checkpoint", loss1.detach(), loss0.detach())
            g0 = _grads(plain)
            g1 = {n.replace(".block.", "."): g for n, g in _grads(ckpt).items()}
            assert g0.keys() == g1.keys()
            for n in g0:
                _close(f"{attention} grad {n} under checkpoint (reentrant={use_reentrant})", g1[n], g0[n])


def _check_needs_seed(rank, world):
    from llmmem.models.gpt import GPT
    from llmmem.parallel import TensorParallelGPT, get_rng_tracker

    torch.manual_seed(4)
    model = TensorParallelGPT.from_gpt(GPT(_gpt_cfg()))
    get_rng_tracker().reset()
    idx, tgt = _batch()
    try:
        model(idx, tgt)
        raise AssertionError("dropout in the split region without a seeded tracker must raise")
    except RuntimeError as exc:
        assert "model_parallel_manual_seed" in str(exc)
    model.eval()
    model(idx, tgt)  # no dropout: no stream needed


def _random_worker(rank, world):
    import torch.distributed as dist

    import llmmem.parallel as par

    if world == 4:
        tp = par.init(tensor_parallel_size=2)
        dp = par.get_data_parallel_group()
    else:
        tp, dp = dist.group.WORLD, None
    try:
        _check_exact_correspondence(rank, world, tp)
        _check_stream_properties(rank, world, tp, dp)
        _check_checkpoint_replay(rank, world)
        _check_needs_seed(rank, world)
    finally:
        par.destroy()
    print(f"rank {rank}: all random-stream checks passed")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])  # 4: TP 2 x DP 2
def test_tp_gpt_dropout_streams(world_size):
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_random_worker", world_size, timeout=120)
    assert all("all random-stream checks passed" in r.output for r in results)
