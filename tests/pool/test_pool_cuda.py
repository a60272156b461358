"""MemoryPool on a GPU (skipped without one): use_pool routing and statistics, nesting,
stream-ordered reuse across two streams, CUDA graph capture, install_allocator in a subprocess."""

from __future__ import annotations

import pytest
import torch
from support.cuda import CudaArray
from support.pool import inside
from support.procs import run_python

import llmmem
from llmmem._native import native

pytestmark = pytest.mark.cuda
MiB = 1 << 20


def test_use_pool_routes_allocations_and_torch_statistics_keep_working():
    pool = llmmem.MemoryPool(initial_size="64MiB", device="cuda")
    outside_before = torch.empty(1000, device="cuda")
    with llmmem.use_pool(pool):
        small = torch.empty(1000, device="cuda")
        big = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
        out = small * 2  # operator outputs too
    outside_after = torch.empty(1000, device="cuda")
    assert inside(pool, small) and inside(pool, big) and inside(pool, out)
    assert not inside(pool, outside_before) and not inside(pool, outside_after)
    s = pool.stats()
    assert s["allocated_bytes.current"] >= 5 * MiB  # PyTorch's segments, taken from the pool
    assert s["reserved_bytes.current"] >= 64 * MiB
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] >= 5 * MiB + 8000
    assert torch.cuda.memory_allocated() > 0
    del small, big, out


def test_nesting_and_switching_pools():
    a = llmmem.MemoryPool(initial_size="32MiB", device="cuda")
    b = llmmem.MemoryPool(initial_size="32MiB", device="cuda")
    with llmmem.use_pool(a):
        x = torch.empty(4096, device="cuda")
        with llmmem.use_pool(b):
            y = torch.empty(4096, device="cuda")
        z = torch.empty(4096, device="cuda")
    assert inside(a, x) and inside(b, y) and inside(a, z)
    assert not inside(a, y) and not inside(b, x)


def test_empty_on_a_cuda_pool_and_results_are_right():
    pool = llmmem.MemoryPool(initial_size="16MiB", device="cuda")
    t = pool.empty((256, 256), dtype=torch.float16)
    assert t.is_cuda and t.shape == (256, 256) and inside(pool, t)
    t.copy_(torch.ones(256, 256, dtype=torch.float16, device="cuda"))
    assert float(t.float().sum()) == 65536.0


def test_reuse_across_two_streams_waits_for_the_free_event():
    pool = llmmem.MemoryPool(initial_size="64MiB", device="cuda")
    cap = pool._cap()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    n = MiB  # floats: 4 MiB
    a = native.pool_alloc(cap, 4 * n, s1.cuda_stream)
    with torch.cuda.stream(s1):
        ta = torch.as_tensor(CudaArray(a, n), device="cuda")
        torch.cuda._sleep(200_000_000)  # keep s1 busy well past the next host steps
        ta.fill_(1.0)
    del ta
    native.pool_free(cap, a, s1.cuda_stream)
    same_stream = native.pool_alloc(cap, 4 * n, s1.cuda_stream)
    assert same_stream == a  # same stream: reused at once, the queue orders it
    native.pool_free(cap, same_stream, s1.cuda_stream)
    other = native.pool_alloc(cap, 4 * n, s2.cuda_stream)
    assert other != a  # s1 has not reached the free: the block must not go to s2
    native.pool_free(cap, other, s2.cuda_stream)
    s1.synchronize()
    s2.synchronize()
    again = native.pool_alloc(cap, 4 * n, s2.cuda_stream)
    assert again in (a, other)
    native.pool_free(cap, again, s2.cuda_stream)
    torch.cuda.synchronize()
    assert pool.empty_cache() >= 0
    assert pool.stats()["active_bytes.current"] == 0


def test_cuda_graph_capture_inside_use_pool_works_or_is_refused_clearly():
    pool = llmmem.MemoryPool(initial_size="64MiB", device="cuda")
    with llmmem.use_pool(pool):
        static_in = torch.ones(1024, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                static_out = static_in * 3
        except RuntimeError as exc:
            assert "capture" in str(exc).lower() or "graph" in str(exc).lower()
            return
    static_in.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert float(static_out.sum()) == 6.0 * 1024


def test_oom_inside_use_pool_is_torch_out_of_memory():
    pool = llmmem.MemoryPool(initial_size="32MiB", max_size="32MiB", device="cuda")
    with llmmem.use_pool(pool):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert pool.stats()["num_ooms"] >= 1


def test_install_allocator_in_a_subprocess():
    r = run_python("""
        import torch, llmmem
        pool = llmmem.MemoryPool(initial_size="64MiB", max_size="64MiB", device="cuda")
        llmmem.install_allocator(pool)
        x = torch.randn(1000, device="cuda")
        y = (x * 2).sum()
        assert pool.stats()["allocation.current"] >= 2
        try:
            torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
        except RuntimeError as exc:
            assert "out of memory" in str(exc), str(exc)
            assert "largest free block" in str(exc) and "max_size" in str(exc), str(exc)  # the pool's summary
        else:
            raise SystemExit("no OOM")
        try:
            with llmmem.torch_oom_errors():
                torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            assert "llmmem pool" in str(exc), str(exc)
        else:
            raise SystemExit("torch_oom_errors did not convert the OOM")
        del x, y
        torch.cuda.synchronize()
        print("OK", pool.stats()["num_ooms"])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK")


def test_install_allocator_after_the_first_cuda_allocation_says_so():
    r = run_python("""
        import torch, llmmem
        pool = llmmem.MemoryPool(initial_size="8MiB", device="cuda")
        torch.empty(10, device="cuda")
        try:
            llmmem.install_allocator(pool)
        except RuntimeError as exc:
            assert "before the first CUDA allocation" in str(exc), str(exc)
            print("REFUSED")
    """)
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout


def test_pinned_pool_gives_page_locked_tensors():
    pool = llmmem.MemoryPool(initial_size="8MiB", device="pinned")
    t = pool.empty((1024,), dtype=torch.float32)
    assert t.is_pinned()
    g = t.cuda(non_blocking=True)
    torch.cuda.synchronize()
    assert g.shape == (1024,)
