"""CPU pools and the machine they run on: a pool never hands out memory the system cannot back,
what it reports as reserved is resident, and its address-space reservations leave room for the rest
of the process (under ``ulimit -v``, and with thousands of pools).

Sizes are taken from this machine at test time (/proc/meminfo); nothing large is ever touched: a
refused request maps nothing. The address-space cases run in their own interpreter, since they
lower its limits or fill its address space.
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

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc: Linux only")

_LLMMEM_PARENT = str(pathlib.Path(llmmem.__file__).resolve().parents[1])


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _machine_bytes() -> int:
    """All the memory this machine has: RAM + swap."""
    m = _meminfo()
    return m["MemTotal"] + m.get("SwapTotal", 0)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _isolated(body: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_LLMMEM_PARENT, os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(body)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=cwd,
        )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_a_tensor_larger_than_the_machine_is_refused_with_both_figures():
    torch = pytest.importorskip("torch")
    too_much = _machine_bytes() + (1 << 30)
    pool = llmmem.MemoryPool(device="cpu")
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        pool.empty(too_much, dtype=torch.uint8)
    msg = str(info.value)
    assert f"{too_much} bytes" in msg and "available" in msg, msg
    assert isinstance(info.value, MemoryError)
    s = pool.stats()
    assert s["reserved_bytes.current"] == 0 and s["num_ooms"] >= 1
    small = pool.empty(1 << 20, dtype=torch.uint8)  # the pool still works
    small.fill_(1)
    assert int(small.sum()) == 1 << 20


@pytest.mark.parametrize("size", ["50TB", "machine"])
def test_an_initial_size_the_machine_cannot_hold_is_refused(size):
    initial = 2 * _machine_bytes() if size == "machine" else size
    with pytest.raises(llmmem.OutOfMemoryError, match="available"):
        llmmem.MemoryPool(initial, device="cpu")


def test_reserved_memory_is_resident():
    before = _resident_bytes()
    pool = llmmem.MemoryPool("64MiB", device="cpu")
    grew = _resident_bytes() - before
    assert pool.stats()["reserved_bytes.current"] == 64 << 20
    assert grew >= 60 << 20, f"the pool reserved 64 MiB, but the process's resident memory grew by {grew} bytes"
    pool.close()


def test_pools_work_under_an_address_space_limit():
    # RLIMIT_AS a few GiB above what the process maps already: every pool used to reserve 64 GiB
    # of address space, so none could be made. Pools must work, large requests fail cleanly, and
    # the process keeps address space for torch's own allocations.
    out = _isolated(
        """
        import resource
        import torch
        import llmmem

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        limit = mapped + (3 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        pools = [llmmem.MemoryPool(device="cpu") for _ in range(4)]
        pools += [llmmem.MemoryPool(max_size="256MiB", device="cpu") for _ in range(4)]
        tensors = [p.empty(16 << 20, dtype=torch.uint8) for p in pools]
        for t in tensors:
            t.fill_(7)
        grown = pools[0].empty(200 << 20, dtype=torch.uint8)  # more than the first segment
        grown.fill_(1)
        try:
            pools[1].empty(8 << 30, dtype=torch.uint8)
            print("8 GiB: allocated")
        except llmmem.OutOfMemoryError as e:
            print("8 GiB: OutOfMemoryError")
        plain = torch.empty(256 << 20, dtype=torch.uint8)  # torch still has address space
        plain.fill_(3)
        print("ok", sum(int(t[0]) for t in tensors), int(grown[-1]), int(plain[-1]))
        """
    )
    assert "8 GiB: OutOfMemoryError" in out, out
    assert "ok 56 1 3" in out, out


def test_thousands_of_pools_fit_in_one_process():
    # Each pool used to reserve 64 GiB of address space, so about 2000 filled the 128 TiB of x86-64
    # user space; the next pool, and any other large mapping of the process, then failed.
    out = _isolated(
        """
        import torch
        import llmmem

        pools = []
        for i in range(2100):
            pools.append(llmmem.MemoryPool(4096, device="cpu"))
        t = pools[-1].empty(1000, dtype=torch.uint8)
        t.fill_(5)
        plain = torch.empty(64 << 20, dtype=torch.uint8)
        plain.fill_(1)
        print("ok", len(pools), int(t.sum()), int(plain[-1]))
        """
    )
    assert "ok 2100 5000 1" in out, out


def test_a_shape_beyond_any_address_space_names_itself():
    torch = pytest.importorskip("torch")
    pool = llmmem.MemoryPool(device="cpu")
    for shape in [(2**62,), (2**40, 2**40)]:
        with pytest.raises(llmmem.OutOfMemoryError, match=r"MemoryPool\.empty: shape .* bytes") as info:
            pool.empty(shape, dtype=torch.float32)
        assert not isinstance(info.value, OverflowError)


def test_host_memory_is_what_the_pool_checks():
    # llmmem.pool.host_memory() reads the C core's figures (the ones a host pool refuses memory by),
    # so a command can refuse work before it starts: under RLIMIT_DATA that limit bounds them.
    out = _isolated(
        """
        import resource
        from llmmem.pool import host_memory

        free = host_memory()
        assert free["available"] > 0 and free["total"] >= free["available"], free
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (used + (256 << 20), resource.RLIM_INFINITY))
        limited = host_memory()
        print(limited["bound"], limited["available"] <= 256 << 20, limited["total"] == used + (256 << 20))
        """
    )
    assert "RLIMIT_DATA True True" in out, out
