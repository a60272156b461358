"""llmmem's shared-memory collectives against gloo's, and their behaviour under faults.

Each world size runs all checks in one set of spawned ranks (process start-up costs seconds).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

SIZES = [1, 7, 4097, 2**20 + 3]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _segments() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("llmmem-tp-")}


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    world = dist.get_world_size()
    # the exact bits, widened to int32 (gloo has no int16)
    bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int32)
    everyone = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(everyone, bits)  # gloo: compares the exact bits
    return all(torch.equal(everyone[0], e) for e in everyone)


def _collectives_worker(rank, world):
    from llmmem.parallel import collectives

    assert collectives.get_collective_thresholds()["cpu_shm_max_bytes"] > 2**22
    # the 1 M-element case runs on 2 ranks only: on 4 ranks it adds little and costs much on a small CI box
    sizes = SIZES if world <= 2 else [n for n in SIZES if n < 2**20]
    for dtype in DTYPES:
        for n in sizes:
            g = torch.Generator().manual_seed(1000 * n + rank)
            x = (torch.randn(n, generator=g) * 4).to(dtype)
            want = x.clone()
            dist.all_reduce(want)  # gloo
            got = collectives.all_reduce_(x.clone())
            assert collectives._shm_comms, "the shared-memory engine was not used"
            # fp32 accumulation in rank order: equal to gloo up to rounding of the sum order / dtype
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 4 * world)
            if dtype == torch.float32 and world == 2:
                assert torch.equal(got, want), "two fp32 addends: the sum must equal gloo's exactly"
            assert _same_on_all_ranks(got), f"ranks disagree on all_reduce({n}, {dtype})"
            # all-gather along a middle dimension, reduce-scatter along dim 0
            m = max(1, n // 8)
            y = torch.randn(2, m, 3, generator=g).to(dtype)
            ref = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(ref, y)
            assert torch.equal(collectives.all_gather(y, 1, None), torch.cat(ref, dim=1))
            z = torch.randn(world * m, 2, generator=g).to(dtype)
            ref_rs = z.clone()
            dist.all_reduce(ref_rs)
            got_rs = collectives.reduce_scatter(z, 0, None)
            torch.testing.assert_close(
                got_rs.float(), ref_rs.chunk(world)[rank].float(), rtol=tol, atol=tol * 4 * world
            )
    # 1000 small all-reduces in a row, each checked
    for i in range(1000):
        v = torch.full((3,), float(rank + i))
        collectives.all_reduce_(v)
        expected = world * i + world * (world - 1) / 2
        assert v[0].item() == expected and v[2].item() == expected, (i, v)
    # non-contiguous and unsupported dtypes go to gloo and still work
    nc = torch.arange(8.0).view(2, 4).t()
    collectives.all_reduce_(nc)
    assert torch.equal(nc, torch.arange(8.0).view(2, 4).t() * world)
    d = torch.ones(5, dtype=torch.float64)
    assert torch.equal(collectives.all_reduce_(d), torch.full((5,), float(world), dtype=torch.float64))
    # ranks calling with different sizes: detected and reported on every rank
    from llmmem.errors import InvalidArgumentError

    try:
        collectives.all_reduce_(torch.ones(5 + rank))
        raise AssertionError("a size mismatch must raise")
    except InvalidArgumentError as exc:
        assert "disagree" in str(exc) and "all_reduce" in str(exc), str(exc)
    collectives.close_all()  # the engine is broken after a failure; set up a fresh one
    assert collectives.all_reduce_(torch.ones(4))[0].item() == world
    if world == 2:
        _check_fallback(rank, world)
    print(f"rank {rank}: collective checks passed")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_collectives_match_gloo(world_size):
    from llmmem.parallel.ranks import run_ranks

    before = _segments()
    results = run_ranks(__file__, "_collectives_worker", world_size, timeout=120)
    assert all("collective checks passed" in r.output for r in results)
    assert _segments() <= before


def _check_fallback(rank, world):
    """A group whose ranks report different hosts: every rank falls back to gloo, with one warning."""
    import warnings

    from llmmem.parallel import collectives, shm

    real = shm.host_identity
    shm.host_identity = lambda: f"host-{rank}"  # pretend the ranks are on different machines
    group = dist.new_group(list(range(world)))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                x = collectives.all_reduce_(torch.ones(10), group)
                assert x[0].item() == world
    finally:
        shm.host_identity = real
    assert collectives._shm_comms[id(group)] is None
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "spans 2 hosts" in msgs[0], msgs


def _fault_worker(rank, world):
    """First rank 1 skips a collective (rank 0 times out, rank 1 then fails too); then, on a fresh
    engine, rank 1 is killed (SIGKILL) in the middle of a 16-chunk all-reduce, after it has
    contributed its first chunk; rank 0 must notice it well before its timeout."""
    import signal
    import threading

    from llmmem.errors import StateError
    from llmmem.parallel import collectives

    for mode, timeout in (("late", 1.0), ("kill", 60.0)):
        collectives.close_all()
        collectives.set_timeout(timeout)
        x = collectives.all_reduce_(torch.ones(100))
        assert x[0].item() == world
        big = torch.ones(4 << 20)  # 16 MiB: 16 chunks of the default 1 MiB slot
        if rank == 1 and mode == "kill":
            # dies while blocked inside the collective (the GIL is released there)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if rank == 0 and mode == "kill":
            time.sleep(0.8)  # join after rank 1 has arrived at the first chunk and been killed
        if rank == 1 and mode == "late":
            time.sleep(1.5)  # miss the collective; rank 0 gives up after 1 s and tells us
        t0 = time.monotonic()
        try:
            collectives.all_reduce_(big)
            raise AssertionError("the collective must fail")
        except StateError as exc:
            elapsed = time.monotonic() - t0
            print(f"rank {rank} ({mode}): raised after {elapsed:.2f} s: {exc}", flush=True)
            assert "all_reduce" in str(exc)
            if rank == 0:
                assert ("exited" if mode == "kill" else "timed out") in str(exc), str(exc)
                assert elapsed < 30, "a dead peer must be detected well before the timeout"
        if mode == "late":
            dist.barrier()  # both ranks are past the failure before the next engine is set up
    # nothing was left in /dev/shm by this group
    assert not {n for n in os.listdir("/dev/shm") if n.startswith("llmmem-tp-")} - set(
        os.environ.get("LLMMEM_TEST_SEGMENTS_BEFORE", "").split(",")
    )
    print(f"rank {rank}: faults handled")


@pytest.mark.distributed
def test_faults_raise_and_leave_nothing_behind():
    from llmmem.parallel.ranks import run_ranks

    before = _segments()
    env = {"LLMMEM_TEST_SEGMENTS_BEFORE": ",".join(sorted(before))}
    results = run_ranks(__file__, "_fault_worker", 2, timeout=90, env=env, expect={1: -9})
    out0, out1 = results[0].output, results[1].output
    assert "rank 0 (late)" in out0 and "timed out" in out0 and "rank 1 (late)" in out1
    assert "rank 0 (kill)" in out0 and "exited" in out0 and "faults handled" in out0
    assert _segments() <= before


def _after_a_failure(rank, world):
    """Rank 1 misses a collective: rank 0 times out, rank 1 is told. Every later collective on the
    group, whatever its route, raises at once on both ranks, naming that first failure and what to
    do (was: "the communicator is broken by an earlier failure; set up a new one", naming neither,
    and for a float64 all-reduce an "all_gather" the caller never made); after close_group on every
    rank the next collective works on a new engine."""
    from llmmem.errors import StateError
    from llmmem.parallel import collectives

    collectives.set_timeout(1.0)
    assert collectives.all_reduce_(torch.ones(8))[0].item() == world
    if rank == 1:
        time.sleep(1.5)
    with pytest.raises(StateError, match="timed out" if rank == 0 else "rank 0 failed"):
        collectives.all_reduce_(torch.ones(8))
    dist.barrier()
    calls = {
        "all_reduce_": lambda: collectives.all_reduce_(torch.ones(8)),
        "all_gather": lambda: collectives.all_gather(torch.ones(8), 0),
        "reduce_scatter": lambda: collectives.reduce_scatter(torch.ones(8), 0),
        "all_reduce_ ": lambda: collectives.all_reduce_(torch.ones(8, dtype=torch.float64)),  # the fallback route
    }
    for op, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(StateError) as caught:
            call()
        msg = str(caught.value)
        assert time.monotonic() - t0 < 0.5, "a broken engine refuses at once"
        assert msg.startswith(f"llmmem.parallel.{op.strip()}: the group's shared-memory engine is broken"), msg
        assert "timed out after 1 s on rank 0 waiting for rank 1" in msg and "close_group(group)" in msg, msg
    collectives.close_group(None)
    assert collectives.all_reduce_(torch.ones(8))[0].item() == world
    collectives.close_all()
    print(f"rank {rank}: after a failure passed", flush=True)


def test_collectives_after_a_failure_name_it_and_close_group_recovers():
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_after_a_failure", 2, timeout=60)
    assert all("after a failure passed" in r.output for r in results), [r.output for r in results]
