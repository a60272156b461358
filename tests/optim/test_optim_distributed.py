"""llmmem.optim.AdamW inside the engines it is composed with, on 2 gloo ranks (CPU): torch's
ZeroRedundancyOptimizer (ZeRO-1), DDP, FSDP2 (fully_shard: DTensor parameters, the local shard
is stepped) and llmmem's tensor-parallel layers. Each rank also trains the same model in one
process with the same optimizer and compares."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.distributed


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))


def _data(step, rank=None, world=1):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)
    if rank is None:
        return x, y
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _reference(fmt, steps):
    import llmmem.optim as lo

    m = _model()
    opt = lo.AdamW(m.parameters(), lr=1e-2, state_dtype=fmt, min_quantized_numel=256, seed=5)
    for s in range(steps):
        opt.zero_grad()
        _loss(m, *_data(s)).backward()
        opt.step()
    return m


def _close(name, a, b, tol):
    if not torch.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"{name}: max abs diff {(a - b).abs().max().item():.3g}")


def _check_zero(rank, world):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import llmmem.optim as lo

    for fmt in ("fp32", "int8"):
        m = _model()
        opt = ZeroRedundancyOptimizer(
            m.parameters(), optimizer_class=lo.AdamW, lr=1e-2, state_dtype=fmt, min_quantized_numel=256, seed=5
        )
        for s in range(4):
            opt.zero_grad()
            _loss(m, *_data(s)).backward()  # every rank the whole batch: no gradient averaging needed
            opt.step()
        ref = _reference(fmt, 4)
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            # each rank steps its partition with the same kernel (same seeds: the per-parameter
            # seed follows the position in the local optimizer, so compare fp32 exactly only)
            _close(f"zero {fmt} {n}", p, q, 0 if fmt == "fp32" else 5e-2)
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            sd = opt.state_dict()
            assert len(sd["state"]) == len(list(m.parameters()))
        dist.barrier()


def _check_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import llmmem.optim as lo

    m = DDP(_model())
    opt = lo.AdamW(m.parameters(), lr=1e-2, min_quantized_numel=256, seed=5)
    for s in range(4):
        opt.zero_grad()
        _loss(m, *_data(s, rank, world)).backward()  # DDP averages the halves: the whole batch's gradient
        opt.step()
    ref = _reference("fp32", 4)
    for (n, p), q in zip(m.module.named_parameters(), ref.parameters()):
        _close(f"ddp {n}", p, q, 1e-5)


def _check_fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import llmmem.optim as lo

    mesh = init_device_mesh("cpu", (world,))
    for fmt in ("fp32", "bf16", "int8"):
        m = _model()
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in m.parameters())
        opt = lo.AdamW(m.parameters(), lr=1e-2, state_dtype=fmt, min_quantized_numel=256, seed=5)
        for s in range(4):
            opt.zero_grad()
            _loss(m, *_data(s, rank, world)).backward()
            opt.step()
        ref = _reference(fmt, 4)
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            full = p.full_tensor()
            _close(f"fsdp2 {fmt} {n}", full, q, 1e-5 if fmt == "fp32" else 5e-2)
        if fmt != "int8":  # unquantized moments are DTensors laid out as their parameters
            w = next(m.parameters())
            assert isinstance(opt.state[w]["exp_avg"], DTensor), type(opt.state[w]["exp_avg"])
        sd = opt.state_dict()  # and a saved state loads back into a new optimizer on the same mesh
        opt2 = lo.AdamW(m.parameters(), lr=1e-2, state_dtype=fmt, min_quantized_numel=256, seed=5)
        opt2.load_state_dict(sd)
        for p in m.parameters():
            a, b = opt.state[p], opt2.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                ta = a[key].to_local() if isinstance(a[key], DTensor) else a[key]
                tb = b[key].to_local() if isinstance(b[key], DTensor) else b[key]
                assert torch.equal(ta, tb), key


def _check_tensor_parallel(rank, world):
    import llmmem
    import llmmem.optim as lo

    torch.manual_seed(3)
    fc1 = llmmem.ColumnParallelLinear(32, 64, gather_output=False)
    fc2 = llmmem.RowParallelLinear(64, 32, input_is_parallel=True)
    params = list(fc1.parameters()) + list(fc2.parameters())
    opt = lo.AdamW(params, lr=1e-2, state_dtype="int8", min_quantized_numel=256)
    before = [p.detach().clone() for p in params]
    x = torch.randn(4, 32)
    fc2(torch.nn.functional.gelu(fc1(x))).square().mean().backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
    assert opt.state[fc1.weight]["exp_avg"].numel() == fc1.weight.numel()  # the local shard's state


def _worker(rank, world):
    _check_zero(rank, world)
    _check_ddp(rank, world)
    _check_fsdp2(rank, world)
    _check_tensor_parallel(rank, world)


def test_zero_ddp_fsdp2_and_tensor_parallel_on_two_ranks():
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_worker", 2, timeout=240)


def _ddp_in_backward_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import llmmem.optim as lo

    m = DDP(_model())
    try:
        lo.step_in_backward(m, lo.AdamW(m.parameters()))
    except NotImplementedError as e:
        assert "DistributedDataParallel" in str(e) and "drift" in str(e)
    else:
        raise AssertionError("step_in_backward accepted a DDP model")


def test_step_in_backward_refuses_ddp():
    # its hook would step each rank on its own gradient before DDP averages it (a new user's finding)
    from llmmem.parallel.ranks import run_ranks

    run_ranks(__file__, "_ddp_in_backward_worker", 2, timeout=120)
