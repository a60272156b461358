"""Ranks whose calls differ must never wait for each other in two places (issue 14, item 2).

Each case runs in its own set of gloo ranks. A case that hangs is killed by run_ranks after
RUN_TIMEOUT seconds, which fails the test; the engines' own timeout is set far above what any case
may take, so a case that passes has not waited for it either.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.distributed

RUN_TIMEOUT = 60.0  # the process group's timeout too (run_ranks)
ENGINE_TIMEOUT = 40.0  # llmmem's engines; every failure below must come much sooner


def _expect_disagreement(rank, call, *words):
    """``call()`` must raise InvalidArgumentError naming both ranks' views, well before the timeout."""
    from llmmem.errors import InvalidArgumentError

    t0 = time.monotonic()
    try:
        call()
    except InvalidArgumentError as exc:
        elapsed = time.monotonic() - t0
        msg = str(exc)
        print(f"rank {rank}: raised after {elapsed:.2f} s: {msg}", flush=True)
        assert "ranks disagree" in msg and "rank 0:" in msg and "rank 1:" in msg, msg
        for w in words:
            assert w in msg, (w, msg)
        assert elapsed < ENGINE_TIMEOUT / 2, "the mismatch was found by a timeout, not by the ranks agreeing"
        return msg
    raise AssertionError(f"rank {rank}: the call did not raise")


def _case(rank, world, name):
    from llmmem.parallel import collectives

    collectives.set_timeout(ENGINE_TIMEOUT)
    if name == "contiguity":
        # Same dtype and element count, one rank's tensor a strided view: a valid all-reduce (gloo
        # takes it), so it must give gloo's result on every rank, whatever the layout.
        base = torch.arange(16.0).view(2, 8)
        x = base[0].clone() if rank == 0 else base.t().contiguous().t()[0]  # [0..7], stride 1 or 2
        assert x.is_contiguous() == (rank == 0)
        collectives.all_reduce_(x)
        assert torch.equal(x, torch.arange(8.0) * world), x
        # and again after the engine is set up, with the layouts swapped
        y = torch.ones(4, 3)[:, 1] if rank == 0 else torch.ones(4)
        collectives.all_reduce_(y)
        assert torch.equal(y, torch.full((4,), float(world))), y
    elif name == "dtype-first-call":
        # the very first collective of the group (the engine's set-up) with a dtype the engine does not serve
        x = torch.ones(8, dtype=torch.float32 if rank == 0 else torch.float64)
        msg = _expect_disagreement(rank, lambda: collectives.all_reduce_(x), "float32", "float64")
        assert f"rank {world - 1}: all_reduce_ of 8 float64" in msg, msg
    elif name == "dtype-both-served":
        collectives.all_reduce_(torch.ones(4))  # the engine is up
        x = torch.ones(8, dtype=torch.float32 if rank == 0 else torch.bfloat16)
        _expect_disagreement(rank, lambda: collectives.all_reduce_(x), "float32", "bfloat16")
        # the broken engine was dropped on every rank: the next call works on a fresh one
        assert collectives.all_reduce_(torch.ones(3))[0].item() == world
    elif name == "size-across-threshold":
        collectives.set_collective_thresholds(cpu_shm_max_bytes=64)
        x = torch.ones(8 if rank == 0 else 32)  # 32 B: the engine; 128 B: torch.distributed
        _expect_disagreement(rank, lambda: collectives.all_reduce_(x), "8 float32", "32 float32", "cpu_shm_max_bytes")
    elif name == "all-gather-dtype":
        x = torch.ones(2, 3, dtype=torch.float32 if rank == 0 else torch.float64)
        _expect_disagreement(rank, lambda: collectives.all_gather(x, 1), "all_gather", "float64")
    elif name == "reduce-scatter-size":
        collectives.set_collective_thresholds(cpu_shm_max_bytes=64)
        x = torch.ones(world * (4 if rank == 0 else 40))
        _expect_disagreement(rank, lambda: collectives.reduce_scatter(x, 0), "reduce_scatter")
    elif name == "all-torch-distributed":
        # every rank leaves the engine: they agree, and gloo does the work
        d = torch.full((5,), float(rank + 1), dtype=torch.float64)
        assert torch.equal(collectives.all_reduce_(d), torch.full((5,), world * (world + 1) / 2, dtype=torch.float64))
        collectives.set_collective_thresholds(cpu_shm_max_bytes=64)
        big = torch.ones(100)
        assert torch.equal(collectives.all_reduce_(big), torch.full((100,), float(world)))
        g = collectives.all_gather(torch.full((40,), float(rank)), 0)
        assert torch.equal(g, torch.arange(world, dtype=torch.float32).repeat_interleave(40))
        e = collectives.all_gather(torch.ones(0), 0)  # empty: never an engine call
        assert e.shape == (0,)
        assert collectives.all_reduce_(torch.ones(4))[0].item() == world  # the engine still works
        # ... but ranks that leave it with different calls are told so, with each rank's call
        z = torch.ones(30, dtype=torch.float64 if rank == 0 else torch.int64)
        _expect_disagreement(rank, lambda: collectives.all_reduce_(z), "float64", "int64")
    else:
        raise AssertionError(name)
    print(f"rank {rank}: case {name} passed", flush=True)


CASES = [
    ("contiguity", 2),
    ("dtype-first-call", 2),
    ("dtype-first-call", 3),
    ("dtype-both-served", 2),
    ("size-across-threshold", 2),
    ("all-gather-dtype", 2),
    ("reduce-scatter-size", 2),
    ("all-torch-distributed", 2),
]


@pytest.mark.parametrize("name,world", CASES, ids=[f"{n}-{w}ranks" for n, w in CASES])
def test_mismatched_calls_fail_fast_on_every_rank(name, world):
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_case", world, args=(name,), timeout=RUN_TIMEOUT, grace=5)
    for r in results:
        assert f"case {name} passed" in r.output, r.output


def _late_setup(rank, world):
    """Rank 1 reaches the group's first collective long after the engine's timeout: rank 0 must give
    up after that timeout (not the process group's), with an error that says what it waited for."""
    from llmmem.errors import StateError
    from llmmem.parallel import collectives

    timeout = 2.0
    collectives.set_timeout(timeout)
    if rank == 1:
        time.sleep(4 * timeout)
    t0 = time.monotonic()
    try:
        collectives.all_reduce_(torch.ones(8))
        outcome = "returned"
    except StateError as exc:
        outcome = f"StateError: {exc}"
    except RuntimeError as exc:  # rank 1 finds rank 0 gone (gloo's error)
        outcome = f"RuntimeError: {exc}"
    print(f"rank {rank}: after {time.monotonic() - t0:.2f} s: {outcome}", flush=True)
    if rank == 0:
        assert outcome.startswith("StateError") and "set-up" in outcome and "timed out" in outcome, outcome
        assert time.monotonic() - t0 < 3 * timeout, "the set-up waited for the process group, not the engine"
    else:
        assert outcome != "returned", "rank 0 gave up: rank 1 cannot have completed the set-up"
    print(f"rank {rank}: late set-up case passed", flush=True)


def test_engine_setup_is_bounded_by_the_engine_timeout():
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_late_setup", 2, timeout=RUN_TIMEOUT, grace=20)
    assert "StateError" in results[0].output
    assert all("late set-up case passed" in r.output for r in results)


def _mapped_segments() -> int:
    """Shared mappings of /dev/shm files in this process (the engine's segments are created
    unnamed and mapped; nothing else in these ranks maps /dev/shm)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if " rw-s " in line and "/dev/shm/" in line)


def _repeated_init(rank, world):
    """init() again and again without destroy(): the number of engines (shared segments mapped into
    this process) stays that of one init; another size frees the old groups' engines."""
    from llmmem.parallel import collectives, groups

    assert _mapped_segments() == 0
    counts = []
    for _ in range(4):
        tp = groups.init(tensor_parallel_size=world)
        collectives.all_reduce_(torch.ones(4), tp)
        counts.append(_mapped_segments())
    assert counts == [counts[0]] * 4 and counts[0] >= 1, counts
    first = groups.init(tensor_parallel_size=world)
    assert groups.init(tensor_parallel_size=world) is first
    tp1 = groups.init(tensor_parallel_size=1)  # another size: new groups, the old ones' engines freed
    assert tp1 is not first
    collectives.all_reduce_(torch.ones(4), groups.get_data_parallel_group())
    assert _mapped_segments() == counts[0], (_mapped_segments(), counts)
    groups.destroy()
    assert _mapped_segments() == 0
    print(f"rank {rank}: repeated init passed {counts}", flush=True)


def test_repeated_init_keeps_one_engine_per_group():
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_repeated_init", 2, timeout=RUN_TIMEOUT)
    assert all("repeated init passed" in r.output for r in results)


def _destroyed_groups(rank, world):
    """A group destroyed with torch.distributed.destroy_process_group releases its engine (the
    shared segment mapped into this process): at once when it is dropped (garbage-collected);
    while still referenced, at the next engine set-up or release_destroyed_groups(); the world
    group too, when it is destroyed."""
    import gc

    import torch.distributed as dist

    from llmmem.parallel import collectives

    ranks = list(range(world))
    assert _mapped_segments() == 0
    g = dist.new_group(ranks)
    collectives.all_reduce_(torch.ones(4), g)
    one = _mapped_segments()
    assert one >= 1
    (comm,) = collectives._shm_comms.values()
    dist.destroy_process_group(g)
    del g
    gc.collect()
    assert comm.closed and _mapped_segments() == 0, _mapped_segments()
    assert not collectives._shm_comms and not collectives._group_sizes

    held = dist.new_group(ranks)
    collectives.all_reduce_(torch.ones(4), held)
    dist.destroy_process_group(held)
    other = dist.new_group(ranks)
    x = collectives.all_reduce_(torch.ones(4), other)  # sets up other's engine, releases held's
    assert x.tolist() == [world] * 4
    assert id(held) not in collectives._shm_comms and _mapped_segments() == one, _mapped_segments()
    from llmmem.errors import StateError

    # calls on the destroyed group name the cause (was torch's "Group ... is not registered")
    for call in (
        lambda: collectives.all_reduce_(torch.ones(4), held),
        lambda: collectives.all_gather(torch.ones(4), 0, held),
        lambda: collectives.reduce_scatter(torch.ones(4), 0, held),
    ):
        with pytest.raises(StateError, match=r"llmmem.parallel.\w+: its process group was destroyed"):
            call()

    collectives.all_reduce_(torch.ones(4))  # the world group's engine
    assert _mapped_segments() == 2 * one
    dist.destroy_process_group()  # every group, the world's included
    gc.collect()  # the world group is dropped by torch: its engine goes with it
    assert _mapped_segments() == one, _mapped_segments()
    assert collectives.release_destroyed_groups() == 1  # other: destroyed, still referenced here
    assert _mapped_segments() == 0 and not collectives._shm_comms
    for group in (None, other):  # was torch's "Default process group has not been initialized"
        with pytest.raises(StateError, match=r"llmmem.parallel.all_reduce_: torch.distributed is not initialized"):
            collectives.all_reduce_(torch.ones(4), group)
    print(f"rank {rank}: destroyed groups passed", flush=True)


def test_destroyed_groups_release_their_engines():
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_destroyed_groups", 2, timeout=RUN_TIMEOUT)
    assert all("destroyed groups passed" in r.output for r in results)
