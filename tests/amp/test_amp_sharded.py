"""GradScaler on DTensor gradients, 2 gloo ranks: under FSDP2 (``fully_shard``) and torch's tensor
parallelism (``parallelize_module``), an inf in one element of one rank's shard of one gradient
skips the step on every rank and ``overflowed_params`` names that parameter alone, the same list on
every rank (it named every parameter of the dtype group: 39 of 39 on this Llama). No test helper
imports here: the ranks load this file by path."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.distributed


def _llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def _on_every_rank(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _scaled_step(model, opt, scaler, loss_of, poison: dict, rank: int):
    """One step; ``poison``: rank -> parameter name whose local gradient shard gets one inf."""
    scaler.scale(loss_of(model)).backward()
    params = dict(model.named_parameters())
    if rank in poison:
        grad = params[poison[rank]].grad.to_local()
        grad.view(-1)[grad.numel() // 2] = float("inf")
    before = [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for p in params.values()]
    scaler.step(opt)
    scaler.update()
    after = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params.values()]
    stepped = [not torch.equal(a, b) for a, b in zip(before, after)]
    opt.zero_grad(set_to_none=True)
    return scaler.overflowed_params(model), stepped


def _check(model, opt, loss_of, rank, culprits):
    import llmmem

    scaler = llmmem.GradScaler("cpu", init_scale=4.0)
    names, stepped = _scaled_step(model, opt, scaler, loss_of, {}, rank)
    assert names == [] and all(stepped) and scaler.get_scale() == 4.0 and not scaler.last_step_skipped()
    for poison in ({1: culprits[0]}, {0: culprits[0], 1: culprits[1]}):
        names, stepped = _scaled_step(model, opt, scaler, loss_of, poison, rank)
        want = [n for n, _ in model.named_parameters() if n in poison.values()]
        assert names == want, (rank, names, want)
        assert _on_every_rank(names) == [want] * 2  # the same list on both ranks
        assert not any(stepped) and scaler.last_step_skipped()  # skipped on the rank without the inf too
    assert scaler.get_scale() == 1.0 and scaler.skipped_steps() == 2


def _fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))

    def loss_of(model):
        return model(input_ids=ids, labels=ids).loss

    culprits = ["model.layers.2.mlp.up_proj.weight", "model.embed_tokens.weight"]
    # fp32 and fp16 compute (FSDP2's mixed precision: fp16 parameters gathered, fp32 sharded gradients)
    for mp in (MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.float16)):
        model = _llama()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert len(list(model.parameters())) == 39
        _check(model, opt, loss_of, rank, culprits)


def _tensor_parallel(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from llmmem.models.gpt import GPT, GPTConfig

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, layers=2, heads=4, hidden=32, dropout=0.0))
    for block in model.blocks:  # the MLPs split (the up-projection's bias too, the down's replicated)
        parallelize_module(block.mlp, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    _check(model, opt, lambda m: m(idx, targets=idx)[1], rank, ["blocks.1.mlp.fc.weight", "blocks.0.mlp.proj.weight"])


def test_fsdp2_overflow_names_the_one_parameter_on_every_rank():
    pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (optional)")
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_fsdp2", 2, timeout=240)


def test_tensor_parallel_overflow_names_the_one_parameter_on_every_rank():
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_tensor_parallel", 2, timeout=180)


def _ranks_disagree(rank, world):
    """Ranks that hold gradients for different DTensor parameters (one missing on one rank, or all):
    the agreement is built from the parameters, so every rank runs the same collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import llmmem

    mesh = init_device_mesh("cpu", (world,))
    torch.set_num_threads(2)  # the C walk pipelines from 256 parameters on with more than one thread
    for case, plain in (("one missing", 0), ("none here", 0), ("one missing", 300), ("none here", 300)):
        # `plain` ordinary parameters first: the C walk unscales them and hands the DTensors over
        lead = [torch.nn.Parameter(torch.ones(3)) for _ in range(plain)]
        for p in lead:
            p.grad = torch.ones(3)
        params = [torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])) for _ in range(3)]
        for p in params:
            p.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        if rank == 1 and case == "one missing":
            params[0].grad = None
            params[1].grad.to_local().fill_(float("inf"))
        if rank == 1 and case == "none here":
            for p in params:
                p.grad = None
        if rank == 0 and case == "none here":
            params[2].grad.to_local()[0, 0] = float("inf")
        opt = torch.optim.SGD(lead + params, lr=0.1)
        scaler = llmmem.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.tensor(1.0))
        scaler.unscale_(opt)
        found = sum(float(v) for v in scaler._found_inf_per_device(opt).values())
        named = scaler.overflowed_params()
        want = [(0, plain + 1)] if case == "one missing" else [(0, plain + 2)]
        assert all(float(p.grad[0]) == 0.25 for p in lead)  # unscaled once, by 1/4
        assert found == 1.0 and named == want, (rank, case, found, named)
        assert _on_every_rank(named) == [want] * world


def test_ranks_with_different_gradients_agree_without_waiting():
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_ranks_disagree", 2, timeout=120)


def _tensor_parallel_layers(rank, world):
    """llmmem's tensor-parallel layers (plain tensors, each rank its slice): an inf in one rank's
    slice skips the step on every rank, so the replicated weights stay equal (before: the other rank
    stepped, and they drifted apart)."""
    import torch.distributed as dist

    import llmmem
    import llmmem.parallel as tp

    tp.init(tensor_parallel_size=world)
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8)  # replicated
    up = tp.ColumnParallelLinear(8, 16, gather_output=False)
    down = tp.RowParallelLinear(16, 8, input_is_parallel=True)
    params = list(norm.parameters()) + list(up.parameters()) + list(down.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = llmmem.GradScaler("cpu", init_scale=4.0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    scaler.scale(down(up(norm(x))).pow(2).sum()).backward()
    if rank == 1:
        down.weight.grad[0, 0] = float("inf")
    before = norm.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped(), rank
    assert torch.equal(norm.weight, before)
    assert scaler.get_scale() == 2.0
    both = [None] * world
    dist.all_gather_object(both, norm.weight.detach())
    assert torch.equal(both[0], both[1])
    tp.destroy()


def test_tensor_parallel_layers_skip_together():
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_tensor_parallel_layers", 2, timeout=120)
