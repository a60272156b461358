"""Tensor-parallel layers against their single-process torch equivalents (gloo on CPU, spawned ranks).

Each world size runs every check in one set of spawned processes (`_layers_worker`), because a
process start with torch costs seconds. Every rank builds the single-process reference with the
same seed, so the sharded outputs and gradients can be compared locally with that reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

TOL = dict(rtol=1e-5, atol=1e-5)


def _close(name, got, want):
    if not torch.allclose(got, want, **TOL):
        raise AssertionError(
            f"{name}: max abs diff {(got - want).abs().max().item():.3g}, shapes "
            f"{tuple(got.shape)} vs {tuple(want.shape)}"
        )


def _shard(t, w, r, dim):
    return t.chunk(w, dim=dim)[r]


def _check_mlp(rank, world, *, gather_output, skip_bias_add, sequence_parallel, sequence_dim=0):
    """Column -> GELU -> Row against nn.Linear -> GELU -> nn.Linear, forward and backward."""
    import llmmem
    from llmmem.parallel import allreduce_sequence_parallel_grads

    h, f, s, b = 8, 16, 4, 3
    torch.manual_seed(7)
    ref1, ref2 = nn.Linear(h, f), nn.Linear(f, h)
    torch.manual_seed(7)
    fc1 = llmmem.ColumnParallelLinear(
        h,
        f,
        gather_output=gather_output,
        skip_bias_add=skip_bias_add,
        sequence_parallel=sequence_parallel,
        sequence_dim=sequence_dim,
    )
    fc2 = llmmem.RowParallelLinear(
        f,
        h,
        input_is_parallel=not gather_output,
        skip_bias_add=skip_bias_add,
        sequence_parallel=sequence_parallel,
        sequence_dim=sequence_dim,
    )
    # same seed -> the shards are exactly the slices of the reference weights
    assert torch.equal(fc1.weight, _shard(ref1.weight, world, rank, 0))
    assert torch.equal(fc1.bias, _shard(ref1.bias, world, rank, 0))
    assert torch.equal(fc2.weight, _shard(ref2.weight, world, rank, 1))
    assert torch.equal(fc2.bias, ref2.bias)

    shape = (s, b, h) if sequence_dim == 0 else (b, s, h)
    x = torch.randn(*shape, requires_grad=True)
    g = torch.randn(*shape)  # upstream gradient of the output
    y_ref = ref2(F.gelu(ref1(x)))
    (y_ref * g).sum().backward()

    xin = (_shard(x.detach(), world, rank, sequence_dim) if sequence_parallel else x.detach()).clone()
    xin.requires_grad_(True)
    hidden = fc1(xin)
    if skip_bias_add:
        hidden, b1 = hidden
        hidden = hidden + b1
    out = fc2(F.gelu(hidden))
    if skip_bias_add:
        out, b2 = out
        out = out + b2
    want_out = _shard(y_ref.detach(), world, rank, sequence_dim) if sequence_parallel else y_ref.detach()
    gin = _shard(g, world, rank, sequence_dim) if sequence_parallel else g
    _close("mlp output", out, want_out)
    (out * gin).sum().backward()
    if sequence_parallel:
        allreduce_sequence_parallel_grads(fc2)
        _close("input grad", xin.grad, _shard(x.grad, world, rank, sequence_dim))
    else:
        _close("input grad", xin.grad, x.grad)
    _close("fc1.weight grad", fc1.weight.grad, _shard(ref1.weight.grad, world, rank, 0))
    _close("fc1.bias grad", fc1.bias.grad, _shard(ref1.bias.grad, world, rank, 0))
    _close("fc2.weight grad", fc2.weight.grad, _shard(ref2.weight.grad, world, rank, 1))
    _close("fc2.bias grad", fc2.bias.grad, ref2.bias.grad)
    # gathered back, the weights are the reference's
    assert torch.equal(fc1.full_weight(), ref1.weight.detach())
    assert torch.equal(fc1.full_bias(), ref1.bias.detach())
    assert torch.equal(fc2.full_weight(), ref2.weight.detach())


class _RefAttention(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):  # (b, s, h)
        b, s, h = x.shape
        split = lambda t: t.view(b, s, self.heads, -1).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


def _check_attention(rank, world):
    """Heads split across ranks: q/k/v column-parallel, output projection row-parallel."""
    import llmmem

    h, heads, b, s = 8, 4, 2, 5
    torch.manual_seed(3)
    ref = _RefAttention(h, heads)
    tp = {name: llmmem.ColumnParallelLinear.from_linear(getattr(ref, name)) for name in "qkv"}
    proj = llmmem.RowParallelLinear.from_linear(ref.proj, input_is_parallel=True)
    x = torch.randn(b, s, h, requires_grad=True)
    g = torch.randn(b, s, h)
    (ref(x) * g).sum().backward()
    xin = x.detach().clone().requires_grad_(True)
    local_heads = heads // world
    split = lambda t: t.view(b, s, local_heads, -1).transpose(1, 2)  # noqa: E731
    y = F.scaled_dot_product_attention(*(split(tp[n](xin)) for n in "qkv"), is_causal=True)
    out = proj(y.transpose(1, 2).reshape(b, s, h // world))
    _close("attention output", out, ref(x).detach())
    (out * g).sum().backward()
    _close("attention input grad", xin.grad, x.grad)
    for n in "qkv":
        _close(f"{n}.weight grad", tp[n].weight.grad, _shard(getattr(ref, n).weight.grad, world, rank, 0))
        _close(f"{n}.bias grad", tp[n].bias.grad, _shard(getattr(ref, n).bias.grad, world, rank, 0))
    _close("proj.weight grad", proj.weight.grad, _shard(ref.proj.weight.grad, world, rank, 1))
    _close("proj.bias grad", proj.bias.grad, ref.proj.bias.grad)


def _check_embedding_and_loss(rank, world):
    import llmmem
    from llmmem.parallel import vocab_parallel_cross_entropy

    V, D = 16, 6
    for padding_idx in (None, 5):
        torch.manual_seed(11)
        ref = nn.Embedding(V, D, padding_idx=padding_idx)
        torch.manual_seed(11)
        emb = llmmem.VocabParallelEmbedding(V, D, padding_idx=padding_idx)
        assert torch.equal(emb.weight, _shard(ref.weight, world, rank, 0))
        ids = torch.tensor([[0, 5, 15, 7], [8, 3, 5, 12]])
        g = torch.randn(2, 4, D)
        (ref(ids) * g).sum().backward()
        out = emb(ids)
        _close("embedding output", out, ref(ids).detach())
        (out * g).sum().backward()
        _close("embedding weight grad", emb.weight.grad, _shard(ref.weight.grad, world, rank, 0))
        assert torch.equal(emb.full_weight(), ref.weight.detach())
    # sequence parallel: the sum over ranks is reduce-scattered along the sequence (dim 1 of (b, s))
    torch.manual_seed(12)
    ref = nn.Embedding(V, D)
    sp = llmmem.VocabParallelEmbedding.from_embedding(ref, sequence_parallel=True, sequence_dim=1)
    ids = torch.randint(0, V, (2, 4))
    g = torch.randn(2, 4, D)
    (ref(ids) * g).sum().backward()
    out = sp(ids)
    _close("sequence-parallel embedding", out, _shard(ref(ids).detach(), world, rank, 1))
    (out * _shard(g, world, rank, 1)).sum().backward()
    _close("sequence-parallel embedding grad", sp.weight.grad, _shard(ref.weight.grad, world, rank, 0))
    try:
        emb(torch.tensor([V]))
        raise AssertionError("an id >= num_embeddings must raise")
    except IndexError as exc:
        assert "out of range" in str(exc)

    # loss: logits split along the vocabulary vs F.cross_entropy on the full logits
    N = 10
    logits = torch.randn(N, V, requires_grad=True)
    target = torch.randint(0, V, (N,))
    target[3] = -100
    for reduction in ("mean", "sum", "none"):
        logits.grad = None
        ref_loss = F.cross_entropy(logits, target, reduction=reduction)
        gl = torch.randn(ref_loss.shape)
        (ref_loss * gl).sum().backward()
        local = _shard(logits.detach(), world, rank, 1).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, reduction=reduction)
        _close(f"cross-entropy ({reduction})", loss, ref_loss.detach())
        (loss * gl).sum().backward()
        _close(f"cross-entropy grad ({reduction})", local.grad, _shard(logits.grad, world, rank, 1))

    # a vocab-parallel head on (b, s, h) activations, as a GPT's output layer
    torch.manual_seed(5)
    head_ref = nn.Linear(D, V, bias=False)
    head = llmmem.ColumnParallelLinear.from_linear(head_ref)
    x = torch.randn(2, 3, D, requires_grad=True)
    tgt = torch.randint(0, V, (2, 3))
    ref_loss = F.cross_entropy(head_ref(x).reshape(-1, V), tgt.reshape(-1))
    ref_loss.backward()
    xin = x.detach().clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(head(xin), tgt)
    _close("head loss", loss, ref_loss.detach())
    loss.backward()
    _close("head input grad", xin.grad, x.grad)
    _close("head weight grad", head.weight.grad, _shard(head_ref.weight.grad, world, rank, 0))


def _check_gpt(rank, world):
    """The tensor-parallel GPT made from a GPT: same loss, same gradients (shards of them)."""
    from llmmem.models.gpt import GPT, GPTConfig
    from llmmem.parallel.gpt import TensorParallelGPT

    for attention in ("explicit", "sdpa"):
        torch.manual_seed(2)
        cfg = GPTConfig(layers=2, hidden=16, heads=4, seq_len=8, vocab_size=32, dropout=0.0, attention=attention)
        ref = GPT(cfg)
        model = TensorParallelGPT.from_gpt(ref)
        idx = torch.randint(0, 32, (2, 8))
        tgt = torch.randint(0, 32, (2, 8))
        ref_logits, ref_loss = ref(idx, tgt)
        ref_loss.backward()
        logits, loss = model(idx, tgt)
        _close("gpt logits", logits, _shard(ref_logits.detach(), world, rank, -1))
        _close("gpt loss", loss, ref_loss.detach())
        loss.backward()
        _close("tied embedding grad", model.tok_emb.weight.grad, _shard(ref.tok_emb.weight.grad, world, rank, 0))
        _close("pos emb grad", model.pos_emb.weight.grad, ref.pos_emb.weight.grad)
        _close("ln1 grad", model.blocks[0].ln1.weight.grad, ref.blocks[0].ln1.weight.grad)
        _close(
            "mlp fc grad", model.blocks[1].mlp.fc.weight.grad, _shard(ref.blocks[1].mlp.fc.weight.grad, world, rank, 0)
        )
        _close(
            "attn proj grad",
            model.blocks[0].attn.proj.weight.grad,
            _shard(ref.blocks[0].attn.proj.weight.grad, world, rank, 1),
        )
        _close("attn proj bias grad", model.blocks[0].attn.proj.bias.grad, ref.blocks[0].attn.proj.bias.grad)
        assert model.head.weight is model.tok_emb.weight


def _check_bad_input(rank, world):
    import llmmem

    if world > 1:
        for make, words in (
            (lambda: llmmem.ColumnParallelLinear(4, 2 * world + 1), ("out_features", str(2 * world + 1), str(world))),
            (lambda: llmmem.RowParallelLinear(2 * world + 1, 4), ("in_features", str(2 * world + 1), str(world))),
            (lambda: llmmem.VocabParallelEmbedding(2 * world + 1, 4), ("num_embeddings", str(2 * world + 1))),
        ):
            try:
                make()
                raise AssertionError("a size not divisible by the TP size must raise")
            except ValueError as exc:
                assert all(w in str(exc) for w in words), str(exc)
    fc = llmmem.ColumnParallelLinear(4, 2 * world)
    for bad in (torch.randn(3, 5), torch.randn(3)):
        try:
            fc(bad)
            raise AssertionError("a wrong input width must raise")
        except RuntimeError as exc:  # what nn.Linear raises
            assert "shapes cannot be multiplied" in str(exc)
    try:
        llmmem.ColumnParallelLinear(4, 2 * world, gather_output=True, sequence_parallel=True)
        raise AssertionError("gather_output + sequence_parallel must raise")
    except ValueError as exc:
        assert "gather_output" in str(exc)
    try:
        llmmem.RowParallelLinear(2 * world, 4, input_is_parallel=False, sequence_parallel=True)
        raise AssertionError("sequence_parallel without input_is_parallel must raise")
    except ValueError as exc:
        assert "input_is_parallel" in str(exc)
    try:
        llmmem.ColumnParallelLinear.from_linear(nn.Linear(4, 2 * world), bias=False)
        raise AssertionError("from_linear takes the bias from the nn.Linear")
    except TypeError as exc:
        assert "bias" in str(exc)


def _layers_worker(rank, world):
    for gather_output in (False, True):
        for skip_bias_add in (False, True):
            _check_mlp(rank, world, gather_output=gather_output, skip_bias_add=skip_bias_add, sequence_parallel=False)
    for skip_bias_add in (False, True):
        _check_mlp(rank, world, gather_output=False, skip_bias_add=skip_bias_add, sequence_parallel=True)
    _check_mlp(rank, world, gather_output=False, skip_bias_add=False, sequence_parallel=True, sequence_dim=1)
    _check_attention(rank, world)
    _check_embedding_and_loss(rank, world)
    _check_bad_input(rank, world)
    _check_gpt(rank, world)
    if world == 4:
        _check_tp_dp(rank, world)
    if world == 2:
        _check_tp_size_one(rank, world)
    print(f"rank {rank}: all layer checks passed")


def _check_tp_size_one(rank, world):
    """Tensor-parallel size 1 (every rank its own group): the layers are plain nn.Linear/nn.Embedding."""
    import llmmem.parallel as par

    par.init(tensor_parallel_size=1)
    try:
        for gather_output in (False, True):
            _check_mlp(0, 1, gather_output=gather_output, skip_bias_add=not gather_output, sequence_parallel=False)
        _check_mlp(0, 1, gather_output=False, skip_bias_add=False, sequence_parallel=True)
        _check_attention(0, 1)
        _check_embedding_and_loss(0, 1)
    finally:
        par.destroy()


def _check_tp_dp(rank, world):
    """llmmem.parallel.init inside an existing world of 4: two TP groups of 2, two DP groups of 2."""
    import torch.distributed as dist

    import llmmem.parallel as par

    tp = par.init(tensor_parallel_size=2)
    try:
        assert dist.get_world_size(tp) == 2 and dist.get_rank(tp) == rank % 2
        assert par.get_tensor_parallel_group() is tp
        dp = par.get_data_parallel_group()
        assert dist.get_world_size(dp) == 2 and dist.get_rank(dp) == rank // 2
        # layers built without process_group= now shard over the TP group only
        _check_mlp(rank % 2, 2, gather_output=False, skip_bias_add=False, sequence_parallel=False)
        _check_mlp(rank % 2, 2, gather_output=False, skip_bias_add=True, sequence_parallel=True)
        try:
            par.init(tensor_parallel_size=3)
            raise AssertionError("a TP size that does not divide the world must raise")
        except ValueError as exc:
            assert "tensor_parallel_size (3)" in str(exc) and "(4)" in str(exc)
    finally:
        par.destroy()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])  # world 2 also checks TP size 1, world 4 TP 2 x DP 2
def test_layers_match_single_process(world_size):
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_layers_worker", world_size, timeout=120)
    assert all("all layer checks passed" in r.output for r in results)


def test_no_process_group_says_what_to_call():
    import torch.distributed as dist

    import llmmem

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        llmmem.ColumnParallelLinear(4, 4)
    with pytest.raises(RuntimeError, match="torchrun"):
        llmmem.parallel.init(tensor_parallel_size=1)


def test_public_names():
    import llmmem

    assert llmmem.ColumnParallelLinear is llmmem.parallel.ColumnParallelLinear
    assert llmmem.RowParallelLinear.__module__ == "llmmem.parallel.layers"
    assert callable(llmmem.VocabParallelEmbedding)
    usable, detail = llmmem.parallel.feature_status()
    assert usable and "torch.distributed" in detail
