"""Tensor parallelism on CUDA: layers at world size 1 equal nn.Linear, and the IPC all-reduce between
two processes that share one GPU (what the one lent GPU can check; NVLink speed needs several)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]


def _layers_cuda_worker(rank, world):
    import llmmem

    dev = torch.device("cuda", 0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        torch.manual_seed(0)
        ref1, ref2 = nn.Linear(64, 256, device=dev, dtype=dtype), nn.Linear(256, 64, device=dev, dtype=dtype)
        torch.manual_seed(0)
        fc1 = llmmem.ColumnParallelLinear(64, 256, device=dev, dtype=dtype)
        fc2 = llmmem.RowParallelLinear(256, 64, device=dev, dtype=dtype)
        assert torch.equal(fc1.weight, ref1.weight) and torch.equal(fc2.bias, ref2.bias)
        x = torch.randn(8, 64, device=dev, dtype=dtype, requires_grad=True)
        xin = x.detach().clone().requires_grad_(True)
        ref2(F.gelu(ref1(x))).sum().backward()
        out = fc2(F.gelu(fc1(xin)))
        out.sum().backward()
        torch.testing.assert_close(out, ref2(F.gelu(ref1(x))).detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(xin.grad, x.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(fc1.weight.grad, ref1.weight.grad, rtol=tol, atol=tol)
    emb_ref = nn.Embedding(100, 16, device=dev)
    emb = llmmem.VocabParallelEmbedding.from_embedding(emb_ref)
    ids = torch.randint(0, 100, (4, 5), device=dev)
    assert torch.equal(emb(ids), emb_ref(ids))
    print("cuda layers ok")


def _ipc_worker(rank, world):
    import torch.distributed as dist

    from llmmem.errors import StateError
    from llmmem.parallel import collectives
    from llmmem.parallel.cuda_ipc import CudaIpcCommunicator

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # one-shot below 256 KiB, two-shot above (65539 fp32, 150001 halves); 150001 fp32 exceeds the
        # 512 KiB threshold and goes to torch.distributed, which must give the same bits for 2 ranks
        for n in (1, 7, 4097, 65536 + 3, 150001):
            g = torch.Generator().manual_seed(rank * 1000 + n)
            host = torch.randn(n, generator=g).to(dtype)
            everyone = [torch.empty_like(host) for _ in range(world)]
            dist.all_gather(everyone, host)
            want = sum(e.float() for e in everyone).to(dtype)  # fp32 sum in rank order, rounded once
            x = host.to(dev)
            collectives.all_reduce_(x)  # routed to the IPC engine (small CUDA message)
            assert collectives._cuda_comms and all(c is not None for c in collectives._cuda_comms.values())
            assert torch.equal(x.cpu(), want), (dtype, n)
    # many small all-reduces in a row, slots reused
    for i in range(200):
        v = torch.full((5,), float(rank + i), device=dev)
        collectives.all_reduce_(v)
        assert v[0].item() == world * i + 1
    # a rank that never arrives: the kernel gives up after the timeout and check() says so
    comm = CudaIpcCommunicator.setup(dist.group.WORLD, dev, timeout=1.0, max_bytes=4096)
    if rank == 0:
        comm.all_reduce_(torch.ones(4, device=dev))
        try:
            comm.check()
            raise AssertionError("a missing peer must be reported")
        except StateError as exc:
            assert "timed out" in str(exc)
        try:  # and the communicator refuses further work instead of reducing stale data
            comm.all_reduce_(torch.ones(4, device=dev))
            raise AssertionError("a timed-out communicator must refuse new calls")
        except StateError as exc:
            assert "earlier call" in str(exc)
    dist.barrier()
    comm.close()
    print("ipc ok")


def _ipc_fault_worker(rank, world):
    """Faults of the IPC engine: queued kernels stop at once after a timeout (not each after its own),
    the failure reaches the host as an error naming the collective, results are NaN rather than a
    partial sum, peers learn of it, and ranks that disagree on size or dtype are detected."""
    import time

    import torch.distributed as dist

    from llmmem.errors import InvalidArgumentError, StateError
    from llmmem.parallel.cuda_ipc import CudaIpcCommunicator

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    timeout = 2.0
    comm = CudaIpcCommunicator.setup(dist.group.WORLD, dev, timeout=timeout, max_bytes=1 << 20)
    if rank == 0:
        xs = [torch.ones(4, device=dev) for _ in range(5)]
        t0 = time.monotonic()
        for x in xs:  # rank 1 never comes; five kernels queued behind each other
            comm.all_reduce_(x)
        try:
            comm.check()
            raise AssertionError("a missing peer must be reported")
        except StateError as exc:
            assert "all_reduce" in str(exc) and "timed out" in str(exc) and "rank 1" in str(exc), str(exc)
        elapsed = time.monotonic() - t0
        assert elapsed < 2.5 * timeout, f"the queued kernels each waited out the timeout: {elapsed:.1f} s"
        assert all(torch.isnan(x).all().item() for x in xs), "a timed-out call must not leave a partial sum"
        try:
            comm.all_reduce_(torch.ones(4, device=dev))
            raise AssertionError("a failed communicator must refuse new calls")
        except StateError as exc:
            assert "earlier call" in str(exc) and "timed out" in str(exc), str(exc)
    dist.barrier()
    if rank == 1:  # rank 0 gave up and said so: this rank's next call stops at once, naming rank 0
        y = torch.ones(4, device=dev)
        t0 = time.monotonic()
        comm.all_reduce_(y)
        try:
            comm.check()
            raise AssertionError("the peer's failure must be reported")
        except StateError as exc:
            assert "rank 0 failed" in str(exc) and "all_reduce" in str(exc), str(exc)
        assert time.monotonic() - t0 < timeout
        assert torch.isnan(y).all().item()
    dist.barrier()
    comm.close()
    # ranks that disagree: element count (one-shot both), dtype at equal bytes, one-shot vs two-shot
    cases = [
        ((1000, torch.float32), (2000, torch.float32)),
        ((2000, torch.float32), (4000, torch.bfloat16)),
        ((1000, torch.float32), (70000, torch.float32)),
        ((0, torch.float32), (1000, torch.float32)),
    ]  # an empty call takes part too
    for mine0, mine1 in cases:
        comm = CudaIpcCommunicator.setup(dist.group.WORLD, dev, timeout=30.0, max_bytes=1 << 20)
        n, dtype = mine0 if rank == 0 else mine1
        t0 = time.monotonic()
        comm.all_reduce_(torch.ones(n, device=dev, dtype=dtype))
        try:
            comm.check()
            raise AssertionError(f"ranks that disagree must be told: {mine0} vs {mine1}")
        except InvalidArgumentError as exc:
            assert "disagree" in str(exc) and "all_reduce" in str(exc), str(exc)
        assert time.monotonic() - t0 < 10, "a disagreement is found at the first barrier, not by the timeout"
        dist.barrier()
        comm.close()
    print("ipc faults ok")


def test_layers_on_cuda_world_size_one():
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_layers_cuda_worker", 1, timeout=120)
    assert "cuda layers ok" in results[0].output


def test_ipc_all_reduce_two_processes_one_gpu():
    from llmmem._native import native

    if not native.build_info().get("cuda_built"):
        pytest.skip("llmmem was built without CUDA")
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_ipc_worker", 2, timeout=180, env={"LLMMEM_TP_CUDA_IPC": "1"})
    assert all("ipc ok" in r.output for r in results)


def test_ipc_all_reduce_faults_two_processes_one_gpu():
    from llmmem._native import native

    if not native.build_info().get("cuda_built"):
        pytest.skip("llmmem was built without CUDA")
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_ipc_fault_worker", 2, timeout=180)
    assert all("ipc faults ok" in r.output for r in results)
