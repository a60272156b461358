"""Shared-memory engine faults that need real processes and signals: rank 0 killed during set-up
(no /dev/shm name may survive it) and Ctrl-C while a rank waits for a peer (KeyboardInterrupt
must arrive promptly, not after the 300 s default timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from support.parallel import shm_name

from llmmem._native import native

pytestmark = pytest.mark.distributed


def _spawn(code: str) -> subprocess.Popen:
    # The child imports the llmmem this test imports (installed, or found through PYTHONPATH), not
    # the source tree: run it away from the checkout, whose llmmem/ may hold no built _C.
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tempfile.gettempdir(),
    )


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the child exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _creator_killed_during_setup(name: str) -> None:
    """Rank 0 of 2 creates `name` and waits for rank 1; it is SIGKILLed while it waits."""
    proc = _spawn(f"""
        from llmmem._native import native
        native.shm_comm_open({name!r}, 0, 2, 0, 300.0)
    """)
    try:
        _wait_for(lambda: os.path.exists(f"/dev/shm/{name}"), 60, "rank 0 to create its segment", proc)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_rank0_killed_during_setup_a_late_peer_fails_fast_and_removes_the_segment():
    from llmmem.errors import StateError

    name = shm_name()
    _creator_killed_during_setup(name)
    assert os.path.exists(f"/dev/shm/{name}")  # what the crash leaves behind ...
    t0 = time.monotonic()
    with pytest.raises(StateError, match=r"rank 0 \(pid \d+\).*exited before every rank joined"):
        native.shm_comm_open(name, 1, 2, 0, 10.0)  # short: a failure here must not wait long
    assert time.monotonic() - t0 < 5
    assert not os.path.exists(f"/dev/shm/{name}")  # ... and the peer that found it removed it


def test_rank0_killed_during_setup_the_next_setup_sweeps_the_segment():
    name = shm_name()
    _creator_killed_during_setup(name)
    assert os.path.exists(f"/dev/shm/{name}")  # nobody else came: left behind ...
    comm = native.shm_comm_open(shm_name(), 0, 1, 0, 5.0)  # any later set-up on this host (rank 0) ...
    native.shm_comm_close(comm)
    assert not os.path.exists(f"/dev/shm/{name}")  # ... removes it: its creator is dead


def test_sigint_interrupts_setup_wait_promptly():
    name = shm_name()
    proc = _spawn(f"""
        import time
        from llmmem._native import native
        t0 = time.monotonic()
        try:
            native.shm_comm_open({name!r}, 0, 2, 0, 300.0)  # rank 1 never comes
        except KeyboardInterrupt:
            print(f"KeyboardInterrupt after {{time.monotonic() - t0:.2f}} s", flush=True)
    """)
    try:
        _wait_for(lambda: os.path.exists(f"/dev/shm/{name}"), 60, "rank 0 to create its segment", proc)
        time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 5, out
    finally:
        proc.kill()
    assert "KeyboardInterrupt after" in out, out
    assert proc.returncode == 0, out
    assert not os.path.exists(f"/dev/shm/{name}")


def test_sigint_interrupts_collective_wait_promptly_and_the_peer_is_told():
    from llmmem.errors import StateError

    name = shm_name()
    # the child is rank 0; it reduces while this process (rank 1) does not: it waits for us
    proc = _spawn(f"""
        import time, torch
        from llmmem._native import native
        comm = native.shm_comm_open({name!r}, 0, 2, 0, 300.0)
        x = torch.ones(1000)
        print("waiting", flush=True)
        t0 = time.monotonic()
        try:
            native.shm_all_reduce(comm, x.data_ptr(), x.data_ptr(), x.numel(), 0)
        except KeyboardInterrupt:
            print(f"KeyboardInterrupt after {{time.monotonic() - t0:.2f}} s", flush=True)
    """)
    try:
        _wait_for(lambda: os.path.exists(f"/dev/shm/{name}"), 60, "rank 0 to create its segment", proc)
        comm = native.shm_comm_open(name, 1, 2, 0, 300.0)
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 5, out
    finally:
        proc.kill()
    assert "KeyboardInterrupt after" in out, out
    import torch

    x = torch.ones(1000)
    t0 = time.monotonic()
    with pytest.raises(StateError, match=r"rank 0 failed: .*all_reduce: interrupted on rank 0"):
        native.shm_all_reduce(comm, x.data_ptr(), x.data_ptr(), x.numel(), 0)
    assert time.monotonic() - t0 < 5
    native.shm_comm_close(comm)


def test_close_from_a_signal_handler_during_a_wait_is_deferred_and_stops_the_wait():
    # The wait poll runs Python signal handlers in the middle of a collective; one that closes the
    # communicator must not unmap the segment under the waiting C code (that was a segfault).
    proc = _spawn(f"""
        import signal, threading, time, torch
        from llmmem._native import native
        from llmmem.errors import StateError
        name = {shm_name()!r}
        peer = []
        t = threading.Thread(target=lambda: peer.append(native.shm_comm_open(name, 1, 2, 0, 30.0)))
        t.start()
        comm = native.shm_comm_open(name, 0, 2, 0, 30.0)
        t.join()
        signal.signal(signal.SIGALRM, lambda *a: native.shm_comm_close(comm))
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        x = torch.ones(1000)
        t0 = time.monotonic()
        try:
            native.shm_all_reduce(comm, x.data_ptr(), x.data_ptr(), x.numel(), 0)  # rank 1 never comes
        except StateError as e:
            print(f"StateError after {{time.monotonic() - t0:.2f}} s: {{e}}", flush=True)
        try:
            native.shm_all_reduce(comm, x.data_ptr(), x.data_ptr(), x.numel(), 0)
        except ValueError as e:
            print("then:", e, flush=True)
        native.shm_comm_close(peer[0])
    """)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "StateError after" in out and "interrupted on rank 0" in out, out
    assert float(out.split("StateError after ")[1].split(" s")[0]) < 5, out
    assert "then: llmmem: the communicator is closed" in out, out


def test_overlapping_calls_on_one_communicator_are_refused():
    # A second collective on a communicator whose first one is still waiting (here from a signal
    # handler run by the wait poll; another thread is the same) would advance the barrier epoch
    # under it: refused at once instead.
    proc = _spawn(f"""
        import signal, threading, time, torch
        from llmmem._native import native
        name = {shm_name()!r}
        peer = []
        t = threading.Thread(target=lambda: peer.append(native.shm_comm_open(name, 1, 2, 0, 3.0)))
        t.start()
        comm = native.shm_comm_open(name, 0, 2, 0, 3.0)
        t.join()
        x = torch.ones(1000)
        signal.signal(signal.SIGALRM, lambda *a: native.shm_all_reduce(comm, x.data_ptr(), x.data_ptr(), 1000, 0))
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        try:
            native.shm_all_reduce(comm, x.data_ptr(), x.data_ptr(), x.numel(), 0)  # rank 1 never comes
        except Exception as e:
            print(f"{{type(e).__name__}} after {{time.monotonic() - t0:.2f}} s: {{e}}", flush=True)
        native.shm_comm_close(comm)
        native.shm_comm_close(peer[0])
    """)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "RuntimeError after" in out and "already running" in out, out
    assert float(out.split("RuntimeError after ")[1].split(" s")[0]) < 2, out
