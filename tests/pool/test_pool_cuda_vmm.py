"""MemoryPool(device="cuda", expandable=True) on a GPU (skipped without one): the virtual-memory
backend (cuMemAddressReserve + cuMemCreate/cuMemMap) grows one region in place, gives back hole
pages and free ends, and maps them again when reused. These are the checks that validate the
backend on hardware; it was written without a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.cuda import CudaArray

import llmmem
from llmmem._native import native

pytestmark = pytest.mark.cuda
MiB = 1 << 20


def _bytes(addr: int, n: int) -> torch.Tensor:
    return torch.as_tensor(CudaArray(addr, n, "|u1"), device="cuda")


def _vmm_pool(**kw) -> llmmem.MemoryPool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = llmmem.MemoryPool(device="cuda", expandable=True, **kw)
    if pool.backend != "cuda_vmm":
        # the fallback must have said why
        assert any("virtual memory" in str(w.message) or "driver" in str(w.message) for w in caught)
        pytest.skip(f"this driver/GPU has no virtual memory management: {[str(w.message) for w in caught]}")
    assert pool.expandable and pool.stats()["backend"] == "cuda_vmm"
    return pool


def _segments(pool):
    return [(s["address"], s["total_size"]) for s in pool.snapshot()]


def test_growth_is_in_place_inside_one_reserved_range_and_keeps_data():
    pool = _vmm_pool()
    cap = pool._cap()
    a = native.pool_alloc(cap, 8 * MiB)
    _bytes(a, 8 * MiB).fill_(7)
    b = native.pool_alloc(cap, 16 * MiB)  # does not fit: the region grows, nothing moves
    _bytes(b, 16 * MiB).fill_(9)
    segs = _segments(pool)
    assert len(segs) == 1 and b == a + 8 * MiB
    base, size = segs[0]
    assert base <= a and b + 16 * MiB <= base + size
    torch.cuda.synchronize()
    assert int(_bytes(a, 8 * MiB).sum()) == 7 * 8 * MiB  # the first block survived the growth
    assert int(_bytes(b, 16 * MiB).sum()) == 9 * 16 * MiB
    s = pool.stats()
    assert s["segment.current"] == 1 and s["reserved_bytes.current"] == 24 * MiB
    assert s["num_device_alloc"] == 2  # one reserve, one in-place growth
    native.pool_free(cap, a)
    native.pool_free(cap, b)
    torch.cuda.synchronize()
    pool.close()


def test_holes_are_unmapped_while_growing_and_mapped_again_when_reused():
    pool = _vmm_pool()
    cap = pool._cap()
    a = native.pool_alloc(cap, 8 * MiB)
    b = native.pool_alloc(cap, 3 * MiB // 2)
    native.pool_free(cap, a)  # an 8 MiB hole, freed on the default stream
    torch.cuda.synchronize()  # its free event completes: the hole is idle
    c = native.pool_alloc(cap, 10 * MiB)  # grows past the hole, whose 4 pages are unmapped
    s = pool.stats()
    assert s["segment.current"] == 1 and c == a + 8 * MiB + 3 * MiB // 2
    assert s["decommitted_bytes"] == 8 * MiB and s["reserved_bytes.current"] == 12 * MiB
    d = native.pool_alloc(cap, 3 * MiB)  # into the hole: two pages mapped again
    assert d == a
    _bytes(d, 3 * MiB).fill_(5)
    torch.cuda.synchronize()
    assert int(_bytes(d, 3 * MiB).sum()) == 5 * 3 * MiB
    assert pool.stats()["decommitted_bytes"] == 4 * MiB
    for p in (b, c, d):
        native.pool_free(cap, p)
    torch.cuda.synchronize()
    pool.close()


def test_empty_cache_gives_the_memory_back_to_the_device():
    pool = _vmm_pool(initial_size="4MiB")
    cap = pool._cap()
    ptrs = [native.pool_alloc(cap, 64 * MiB) for _ in range(4)]
    for p in ptrs:
        _bytes(p, 64 * MiB).fill_(1)
    torch.cuda.synchronize()
    reserved = pool.stats()["reserved_bytes.current"]
    assert reserved >= 256 * MiB and pool.stats()["segment.current"] == 1
    for p in ptrs:
        native.pool_free(cap, p)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    released = pool.empty_cache()
    free_after = torch.cuda.mem_get_info()[0]
    s = pool.stats()
    assert released == reserved - 4 * MiB and s["reserved_bytes.current"] == 4 * MiB  # initial_size stays
    # the device really got it back (other processes could only make this smaller: allow 32 MiB)
    assert free_after - free_before >= released - 32 * MiB
    p = native.pool_alloc(cap, 64 * MiB)  # and the region grows again afterwards
    _bytes(p, 64 * MiB).fill_(2)
    torch.cuda.synchronize()
    assert int(_bytes(p, 64 * MiB)[:1024].sum()) == 2048
    native.pool_free(cap, p)
    torch.cuda.synchronize()
    pool.close()


def test_blocks_are_reused_and_stats_add_up():
    pool = _vmm_pool(initial_size="32MiB")
    cap = pool._cap()
    a = native.pool_alloc(cap, 5 * MiB)
    native.pool_free(cap, a)
    again = native.pool_alloc(cap, 5 * MiB)  # same (default) stream: at once, same block
    assert again == a
    s = pool.stats()
    assert s["allocated_bytes.current"] == 5 * MiB
    assert s["free_bytes"] + s["allocated_bytes.current"] == s["reserved_bytes.current"] == 32 * MiB
    assert s["largest_free_block"] <= s["free_bytes"]
    native.pool_free(cap, again)
    torch.cuda.synchronize()
    assert pool.stats()["num_device_alloc"] == 1  # all within the initial region
    pool.close()


def test_use_pool_routes_into_the_expandable_region():
    pool = _vmm_pool()
    with llmmem.use_pool(pool):
        xs = [torch.randn(3 * MiB, device="cuda") for _ in range(4)]  # 12 MiB each: growth
        y = sum(xs)
    segs = _segments(pool)
    assert len(segs) == 1
    base, size = segs[0]
    for t in xs + [y]:
        assert base <= t.data_ptr() < base + size
    assert torch.isfinite(y).all()
    del xs, y


def test_reuse_across_two_streams_waits_for_the_free_event():
    pool = _vmm_pool(initial_size="64MiB")
    cap = pool._cap()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = native.pool_alloc(cap, 4 * MiB, s1.cuda_stream)
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)
        _bytes(a, 4 * MiB).fill_(1)
    native.pool_free(cap, a, s1.cuda_stream)
    other = native.pool_alloc(cap, 4 * MiB, s2.cuda_stream)
    assert other != a  # s1 has not reached the free
    native.pool_free(cap, other, s2.cuda_stream)
    torch.cuda.synchronize()
    pool.close()
