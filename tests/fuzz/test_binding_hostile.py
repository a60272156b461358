"""Hostile arguments for every entry point of the C binding (llmmem._C).

Each case runs in its own interpreter, so that a crash fails the test instead of killing pytest.
The hostile values are ints and floats whose conversion (``__index__``, ``__float__``) or a dict
key whose ``__eq__`` runs code that empties the containers the binding is reading, closes the pool
or communicator it is about to use, or raises. Every call must either work or raise an ordinary
exception; on a binding that reads through borrowed pointers the planner's cases crash.

The second half checks that integers too large for C (2**70, -1 where a size is due) give an error
naming the argument, never ``OverflowError`` from CPython's converters nor a silently truncated value.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import pytest

import llmmem
from llmmem import _C

# The child imports the llmmem this process tests (installed or built in place), not whatever
# its working directory would put first on sys.path.
_LLMMEM_PARENT = str(pathlib.Path(llmmem.__file__).resolve().parents[1])

# Shared by every isolated case. churn() allocates objects of the sizes just freed, so that a read
# through a dangling pointer meets other data (and crashes) instead of the old, intact bytes.
PRELUDE = textwrap.dedent(
    """
    import os
    from llmmem import _C

    def chain(L=4, K=1):
        return {"fwd_time": [[1.0] * K for _ in range(L)], "bwd_time": [[2.0] * K for _ in range(L)],
                "input_bytes": [8] * (L + 1), "saved_bytes": [[8] * K for _ in range(L)]}

    def churn():
        return [[object()] * 8 for _ in range(2000)] + [(1, 2), (3, 4)] * 500

    class Hook:
        # an int (and float) whose conversion first runs `action`
        def __init__(self, action, value=1):
            self.action, self.value = action, value
        def __index__(self):
            self.action()
            churn()
            return self.value
        def __float__(self):
            self.action()
            churn()
            return float(self.value)

    def interrupt():
        raise KeyboardInterrupt

    def outcome(label, f):
        try:
            r = f()
            print(label, "ok", type(r).__name__, flush=True)
        except BaseException as e:
            print(label, "raised", type(e).__name__, str(e)[:160].replace("\\n", " "), flush=True)
    """
)


def _isolated(body: str) -> dict[str, str]:
    """Runs PRELUDE + body in a fresh interpreter; returns {label: outcome} of its outcome() lines."""
    code = PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_LLMMEM_PARENT, os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
        )
    assert proc.returncode == 0, (
        f"the interpreter died (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    results = {}
    for line in proc.stdout.splitlines():
        label, _, rest = line.partition(" ")
        results[label] = rest
    return results


def _clean(result: str, *allowed: str) -> bool:
    """ok, or raised one of the allowed exception classes."""
    kind, _, rest = result.partition(" ")
    return kind == "ok" or (kind == "raised" and rest.split(" ", 1)[0] in allowed)


def test_plan_solve_survives_values_that_empty_the_chain():
    r = _isolated(
        """
        c = chain(L=6, K=2)
        rows = c["fwd_time"]
        rows[0][0] = Hook(lambda: (rows[0].clear(), rows.clear()), 1)  # __float__ empties what is read
        outcome("rows", lambda: _C.plan_solve(c, 10**6, 100))
        c = chain(L=6, K=2)
        c["bwd_time"][2][1] = Hook(lambda: c.clear(), 2)
        outcome("dict", lambda: _C.plan_solve(c, 10**6, 100))
        c = chain()
        outcome("budget", lambda: _C.plan_solve(c, Hook(lambda: c.clear(), 10**6), 100))
        outcome("slots", lambda: _C.plan_solve(chain(), 10**6, Hook(interrupt, 100)))
        """
    )
    assert _clean(r["rows"], "ValueError"), r
    assert _clean(r["dict"], "ValueError"), r
    assert r["budget"].startswith("raised ValueError") and "fwd_time" in r["budget"], r  # read after the hook
    assert r["slots"].startswith("raised KeyboardInterrupt"), r


def test_plan_min_budget_survives_a_key_whose_eq_clears_the_chain():
    r = _isolated(
        """
        c = chain(L=64)
        class Key:
            # same hash as an optional key looked up after another one was fetched
            def __hash__(self):
                return hash("fwd_tmp_bytes")
            def __eq__(self, other):
                c.clear()
                churn()
                return False
        c["fwd_nostore_time"] = [float(i) for i in range(64)]
        c[Key()] = 0
        outcome("key", lambda: _C.plan_min_budget(c))
        c = chain(L=8)
        c["saved_bytes"][3][0] = Hook(lambda: c["saved_bytes"].clear(), 8)
        outcome("index", lambda: _C.plan_min_budget(c))
        """
    )
    assert _clean(r["key"], "ValueError"), r
    assert r["index"].startswith("ok"), r  # the snapshot holds the rows it read


def test_plan_simulate_survives_regions_and_modes_that_empty_themselves():
    r = _isolated(
        """
        regions = []
        regions.append((0, Hook(lambda: regions.clear(), 1)))
        regions.append((2, 3))
        outcome("regions", lambda: _C.plan_simulate(chain(), [0] * 4, regions))
        modes = [0, 0, 0, 0]
        modes[1] = Hook(lambda: modes.clear(), 0)
        outcome("modes", lambda: _C.plan_simulate(chain(), modes, []))
        outcome("interrupt", lambda: _C.plan_simulate(chain(), [0, Hook(interrupt, 0), 0, 0], []))
        """
    )
    assert r["regions"].startswith("ok"), r
    assert r["modes"].startswith("ok"), r
    assert r["interrupt"].startswith("raised KeyboardInterrupt"), r


def test_plan_checkpoints_with_a_hostile_profile():
    r = _isolated(
        """
        import llmmem
        from llmmem.checkpointing.profile import ChainProfile
        L = 5
        fwd = [[1.0] for _ in range(L)]
        fwd[0][0] = Hook(lambda: fwd.clear(), 1)
        p = ChainProfile(modes=("store-all",), fwd_time=fwd, fwd_nostore_time=[1.0] * L, bwd_time=[[2.0]] * L,
                         input_bytes=[100] * (L + 1), saved_bytes=[[100]] * L, fwd_tmp_bytes=[0] * L,
                         bwd_tmp_bytes=[[0]] * L)
        outcome("profile", lambda: llmmem.plan_checkpoints(None, profile=p, budget=1.0))
        """
    )
    assert _clean(r["profile"], "ValueError"), r


def test_pool_entry_points_with_hooks_that_close_the_pool():
    r = _isolated(
        """
        def pool():
            return _C.pool_create("cpu", -1, 0, 0, 0)
        p = pool()
        outcome("alloc", lambda: _C.pool_alloc(p, Hook(lambda: _C.pool_close(p), 4096)))
        p = pool()
        outcome("alloc_stream", lambda: _C.pool_alloc(p, 4096, Hook(lambda: _C.pool_close(p), 0)))
        p = pool()
        a = _C.pool_alloc(p, 4096)
        outcome("free", lambda: _C.pool_free(p, Hook(lambda: _C.pool_free(p, a), a)))
        p = pool()
        outcome("buffer", lambda: _C.pool_buffer(p, Hook(lambda: _C.pool_close(p), 4096)))
        outcome("create", lambda: _C.pool_create("cpu", -1, Hook(interrupt, 0), 0, 0))
        p = pool()
        slot = _C.pool_bind_slot(p)
        outcome("slot_alloc", lambda: _C.pool_slot_alloc(slot, Hook(lambda: _C.pool_unbind_slot(slot), 512), 0))
        outcome("slot_free", lambda: _C.pool_slot_free(slot, Hook(lambda: _C.pool_close(p), 0), 0, 0))
        outcome("unbind", lambda: _C.pool_unbind_slot(Hook(lambda: _C.pool_close(p), slot)))
        outcome("stats", lambda: _C.pool_stats(p))
        """
    )
    for label in ("alloc", "alloc_stream", "buffer"):
        assert r[label].startswith("raised ValueError") and "closed" in r[label], (label, r)
    assert _clean(r["free"], "InvalidArgumentError"), r  # the hook freed it first: a double free, refused
    assert r["create"].startswith("raised KeyboardInterrupt"), r
    for label in ("slot_alloc", "slot_free", "unbind", "stats"):
        assert _clean(r[label], "ValueError", "StateError", "InvalidArgumentError"), (label, r)


def test_collective_entry_points_with_hooks_that_close_the_communicator():
    r = _isolated(
        """
        import array
        name = "llmmem-hostile-%d" % os.getpid()
        buf = array.array("f", [1.0, 2.0, 3.0])
        addr = buf.buffer_info()[0]
        c = _C.shm_comm_open(name, 0, 1, 4096, 5.0)
        outcome("all_reduce", lambda: _C.shm_all_reduce(c, addr, addr, Hook(lambda: _C.shm_comm_close(c), 3), 0))
        c = _C.shm_comm_open(name, 0, 1, 4096, 5.0)
        outcome("all_gather", lambda: _C.shm_all_gather(c, Hook(lambda: _C.shm_comm_close(c), addr), addr, 3, 0))
        c = _C.shm_comm_open(name, 0, 1, 4096, 5.0)
        outcome("reduce_scatter", lambda: _C.shm_reduce_scatter(c, addr, addr, 3, Hook(lambda: _C.shm_comm_close(c), 0)))
        c = _C.shm_comm_open(name, 0, 1, 4096, 5.0)
        outcome("timeout", lambda: _C.shm_comm_set_timeout(c, Hook(lambda: _C.shm_comm_close(c), 2)))
        outcome("open", lambda: _C.shm_comm_open(name, Hook(interrupt, 0), 1, 4096, 5.0))
        outcome("cuda_ar", lambda: _C.cuda_ar_create(0, 0, 1, Hook(interrupt, 4096), 1.0))
        """
    )
    for label in ("all_reduce", "all_gather", "reduce_scatter", "timeout"):
        assert r[label].startswith("raised ValueError") and "closed" in r[label], (label, r)
    assert r["open"].startswith("raised KeyboardInterrupt"), r
    assert r["cuda_ar"].startswith("raised KeyboardInterrupt"), r


def test_error_entry_points_with_hooks():
    r = _isolated(
        """
        outcome("strerror", lambda: _C.strerror(Hook(lambda: None, 2)))
        outcome("raise", lambda: _C._raise_status(Hook(lambda: None, 2), "detail"))
        outcome("interrupt", lambda: _C.strerror(Hook(interrupt, 2)))
        """
    )
    assert r["strerror"] == "ok str", r
    assert r["raise"].startswith("raised OutOfMemoryError"), r
    assert r["interrupt"].startswith("raised KeyboardInterrupt"), r


# ---- integers that do not fit -------------------------------------------------------------------

HUGE = 2**70


def _plan_chain():
    return {"fwd_time": [[1.0]] * 2, "bwd_time": [[1.0]] * 2, "input_bytes": [8] * 3, "saved_bytes": [[8]] * 2}


def _pool():
    return _C.pool_create("cpu", -1, 0, 0, 0)


# (call, the argument name the error must give, the exception classes allowed)
CASES = {
    "plan_solve budget": (lambda: _C.plan_solve(_plan_chain(), HUGE, 10), "budget_bytes", ValueError),
    "plan_solve slots": (lambda: _C.plan_solve(_plan_chain(), 100, HUGE), "slots", ValueError),
    "plan chain bytes": (
        lambda: _C.plan_min_budget(dict(_plan_chain(), input_bytes=[8, HUGE, 8])),
        "input_bytes",
        ValueError,
    ),
    "plan chain time": (
        lambda: _C.plan_min_budget(dict(_plan_chain(), fwd_time=[[1.0], [10**400]])),
        "fwd_time",
        ValueError,
    ),
    "plan regions": (lambda: _C.plan_simulate(_plan_chain(), [0, 0], [(0, HUGE)]), "regions", ValueError),
    "plan modes": (lambda: _C.plan_simulate(_plan_chain(), [0, HUGE], []), "modes", ValueError),
    "pool_create initial": (lambda: _C.pool_create("cpu", -1, 2**64 + 4096, 0, 0), "initial_size", ValueError),
    "pool_create max": (lambda: _C.pool_create("cpu", -1, 0, HUGE, 0), "max_size", ValueError),
    "pool_create growth": (lambda: _C.pool_create("cpu", -1, 0, 0, -1), "growth_size", ValueError),
    "pool_create device": (lambda: _C.pool_create("cuda", HUGE, 0, 0, 0), "device", ValueError),
    "pool_alloc size": (lambda: _C.pool_alloc(_pool(), HUGE), "size", MemoryError),
    "pool_alloc negative": (lambda: _C.pool_alloc(_pool(), -1), "size", ValueError),
    "pool_alloc stream": (lambda: _C.pool_alloc(_pool(), 512, -1), "stream", ValueError),
    "pool_free address": (lambda: _C.pool_free(_pool(), HUGE), "address", ValueError),
    "pool_buffer nbytes": (lambda: _C.pool_buffer(_pool(), HUGE), "nbytes", MemoryError),
    "pool_unbind_slot": (lambda: _C.pool_unbind_slot(HUGE), "slot", ValueError),
    "pool_slot_alloc": (lambda: _C.pool_slot_alloc(0, HUGE, 0), "size", MemoryError),
    "pool_slot_free": (lambda: _C.pool_slot_free(0, 0, 0, HUGE), "device", ValueError),
    "shm_comm_open rank": (lambda: _C.shm_comm_open("llmmem-x", HUGE, 1, 4096, 1.0), "rank", ValueError),
    "shm_comm_open slot": (lambda: _C.shm_comm_open("llmmem-x", 0, 1, -4096, 1.0), "slot_bytes", ValueError),
    "shm_comm_open timeout": (lambda: _C.shm_comm_open("llmmem-x", 0, 1, 4096, 10**400), "timeout_s", ValueError),
    "shm_all_reduce count": (lambda: _C.shm_all_reduce(None, 0, 0, HUGE, 0), "count", ValueError),
    "cuda_ar_create max_bytes": (lambda: _C.cuda_ar_create(0, 0, 1, HUGE, 1.0), "max_bytes", ValueError),
    "cuda_ar_all_reduce stream": (lambda: _C.cuda_ar_all_reduce(None, 0, 0, 0, 0, -1), "stream", ValueError),
    "cuda_ar_check stream": (lambda: _C.cuda_ar_check(None, HUGE), "stream", ValueError),
    "strerror": (lambda: _C.strerror(HUGE), "status", ValueError),
    "_raise_status": (lambda: _C._raise_status(HUGE, "x"), "status", ValueError),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_out_of_range_integers_name_the_argument(case):
    call, name, allowed = CASES[case]
    with pytest.raises(allowed) as info:
        call()
    assert not isinstance(info.value, OverflowError), info.value
    assert name in str(info.value), info.value


def test_values_that_were_silently_truncated_are_refused():
    # 2**64 + 4096 used to become 4096 bytes (a masked conversion); 2**32 a device of 0.
    with pytest.raises(ValueError, match="initial_size"):
        _C.pool_create("cpu", -1, 2**64 + 4096, 0, 0)
    with pytest.raises(ValueError, match="dtype"):
        _C.shm_all_reduce(None, 0, 0, 0, 2**32)


def test_planner_size_errors_state_the_real_figures():
    # The refusals of chains too long to plan used to print their figures after the chain was
    # freed ("0 heterogeneous blocks").
    L = 3000
    chain = {
        "fwd_time": [[1.0 + i % 7] for i in range(L)],
        "bwd_time": [[2.0]] * L,
        "input_bytes": [10] * (L + 1),
        "saved_bytes": [[1 + i % 5] for i in range(L)],
    }
    with pytest.raises(ValueError, match=f"{L} heterogeneous blocks: at most"):
        _C.plan_min_budget(chain)
    with pytest.raises(ValueError, match=f"{L} heterogeneous blocks with 100000 slots"):
        _C.plan_solve(chain, 10**9, 100000)
