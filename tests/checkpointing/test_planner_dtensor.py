"""auto_checkpoint on DTensor parameters, 2 gloo ranks: a Hugging Face Llama planned after FSDP2's
``fully_shard`` trains with the loss and gradients of the same model planned before sharding,
bitwise; a chain of blocks under torch's tensor parallelism (``parallelize_module``) plans and
trains as planned before it. Profiling accounts the local shard (it used to crash reading a
DTensor's storage)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.distributed


def _llama(seed=0):
    import transformers

    torch.manual_seed(seed)
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


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, 256, (2, 32), generator=g)
    return {"input_ids": ids, "labels": ids}


def _step(model, batch):
    torch.manual_seed(1)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def _measured_peak(model, batch) -> int:
    from llmmem.checkpointing.meters import ActivationMeter

    for p in model.parameters():
        p.grad = None
    with ActivationMeter(list(model.parameters())) as meter:
        _step(model, batch)
    return meter.peak


def _fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import llmmem

    mesh = init_device_mesh("cpu", (world,))
    batch = _batch(rank)
    results = []
    for order in ("plan, shard", "shard, plan"):
        model = _llama()
        if order == "plan, shard":
            plan = llmmem.auto_checkpoint(model, budget=0.6, sample=batch, repeats=0)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        if order == "shard, plan":
            plan = llmmem.auto_checkpoint(model, budget=0.6, sample=batch, repeats=0)
        assert plan.active and (plan.regions or any(m != "store-all" for m in plan.modes)), plan.modes
        loss = _step(model, batch)
        results.append((loss, [p.grad.to_local().clone() for p in model.parameters()], plan))
    (loss_a, grads_a, plan_a), (loss_b, grads_b, plan_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    # the profile of the sharded model counts the activations, which sharding does not change
    # sharded, the step also holds the parameters a layer gathers: the profile counts them
    assert plan_b.plan.no_checkpoint_peak_bytes > plan_a.plan.no_checkpoint_peak_bytes
    peak = _measured_peak(model, batch)
    assert peak <= 1.05 * plan_b.budget_bytes, (peak, plan_b.budget_bytes)


class _Block(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _tensor_parallel(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import llmmem

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(4))
    grads = []
    for plan_first in (True, False):
        model = _Chain()
        if plan_first:
            plan = llmmem.auto_checkpoint(model, budget=0.5, sample=x, repeats=0)
        for b in model.blocks:
            parallelize_module(b, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if not plan_first:
            plan = llmmem.auto_checkpoint(model, budget=0.5, sample=x, repeats=0)
        assert plan.regions or any(m != "store-all" for m in plan.modes), plan.modes
        torch.manual_seed(1)
        model(x).backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _worker(rank, world):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    warnings.filterwarnings("ignore")
    _fsdp(rank, world)
    _tensor_parallel(rank, world)


def test_plans_on_dtensor_parameters_as_before_sharding():
    pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (optional)")
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_worker", 2, timeout=240)
