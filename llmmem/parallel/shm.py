"""Shared-memory collectives between the CPU ranks of one host (the Python side of csrc/parallel/shm_*.c).

Set-up is collective over the torch.distributed group: the ranks exchange their host identity
(hostname + kernel boot id), rank 0 picks a fresh segment name, every rank joins it, and all ranks
agree on the outcome, so either every rank uses the segment or none does. The segment's name is
removed as soon as every rank has mapped it, so a crash after set-up leaves nothing in /dev/shm; a
crash during set-up is cleaned up by the surviving ranks or, if none survives, by the next set-up
on the host (csrc/parallel/shm_setup.c). Waits poll for signals: Ctrl-C raises KeyboardInterrupt
within ~50 ms (the peers then fail with an error naming the interrupted rank).
"""

from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist

from llmmem._native import available, native
from llmmem.parallel.exchange import all_gather_json

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class SetupError(RuntimeError):
    """The engine cannot be used for this group (the caller falls back to torch.distributed)."""


def agree_or_raise(error, group, handle, close, *, timeout: float, what: str) -> None:
    """Every rank learns every rank's set-up outcome, so all of them fall back together: one rank
    left on our engine while the others use torch.distributed would deadlock the next collective.
    ``error`` is this rank's failure (or None); on any failure ``handle`` is closed and SetupError raised.
    The exchange gives up after ``timeout`` s (StateError; ``handle`` is closed then too)."""
    try:
        outcomes = all_gather_json(error, group, timeout=timeout, what=what)
    except BaseException:
        if handle is not None:
            close(handle)
        raise
    failures = [e for e in outcomes if e]
    if failures:
        fail_setup(failures, handle, close)


def fail_setup(failures: list, handle, close) -> None:
    """Closes ``handle`` (if any) with ``close`` and raises SetupError naming every failure (the
    outcome every rank has learnt, so that they fall back together)."""
    if handle is not None:
        close(handle)
    raise SetupError("; ".join(failures))


def host_identity() -> str:
    """Equal on two processes only if they run on the same machine (and so can share /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _slot_bytes() -> int:
    raw = os.environ.get("LLMMEM_TP_SHM_SLOT_BYTES", "")
    return int(raw) if raw else 0  # 0: the C default (1 MiB per slot; 2 slots per rank)


class ShmCommunicator:
    """One shared segment per process group. Use :meth:`setup`; calls are collective, in the same
    order on every rank, one thread at a time (like the process group itself)."""

    def __init__(self, handle, rank: int, world_size: int) -> None:
        self._handle = handle
        self.rank, self.world_size = rank, world_size
        # the first failure of a collective (a peer that exited, a timeout, an interrupt): the
        # engine refuses every later call, and collectives.py names this cause when it does
        self.failure: str | None = None
        self.closed = False

    @classmethod
    def setup(cls, group, *, timeout: float) -> ShmCommunicator:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if not available():
            raise SetupError("the C core (llmmem._C) is not loaded")
        if world > 64:
            raise SetupError(f"group of {world} ranks is larger than 64")
        name = f"llmmem-tp-{uuid.uuid4().hex}" if rank == 0 else None
        what = "set-up of the shared-memory collectives"
        # bounded by the engine's own timeout: a rank that never comes is reported in that time,
        # like a late peer of a running engine, not after the process group's 30 minutes
        info = all_gather_json((host_identity(), name), group, timeout=timeout, what=what)
        hosts = {h for h, _ in info}
        if len(hosts) != 1:
            raise SetupError(f"the group spans {len(hosts)} hosts")
        name = info[0][1]
        handle, error = None, None
        try:
            handle = native.shm_comm_open(name, rank, world, _slot_bytes(), float(timeout))
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        agree_or_raise(error, group, handle, native.shm_comm_close, timeout=timeout, what=what)
        return cls(handle, rank, world)

    def set_timeout(self, seconds: float) -> None:
        native.shm_comm_set_timeout(self._handle, float(seconds))

    def close(self) -> None:
        """Unmap the segment (local; idempotent). The handle is kept, closed, so that a later call
        says "the communicator is closed" rather than failing on a missing handle."""
        native.shm_comm_close(self._handle)
        self.closed = True

    @staticmethod
    def _check(t: torch.Tensor, what: str) -> int:
        if not t.is_cpu or not t.is_contiguous() or t.dtype not in DTYPE_CODES:
            raise ValueError(
                f"llmmem shm {what}: needs a contiguous CPU float32/float16/bfloat16 tensor, got "
                f"{t.dtype} on {t.device} (contiguous={t.is_contiguous()})"
            )
        return DTYPE_CODES[t.dtype]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        code = self._check(t, "all_reduce")
        native.shm_all_reduce(self._handle, t.data_ptr(), t.data_ptr(), t.numel(), code)
        return t

    def all_reduce_checked_(self, t: torch.Tensor, dtype: torch.dtype) -> None:
        """:meth:`all_reduce_` for a caller that has checked that ``t`` is contiguous, on the CPU and
        of ``dtype`` (one of DTYPE_CODES): the routing in collectives.py, where every tensor
        accessor call shows in the time of a collective (see ``all_reduce_`` there)."""
        p = t.data_ptr()
        native.shm_all_reduce(self._handle, p, p, t.numel(), DTYPE_CODES[dtype])

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``out`` (world * t.numel() elements) = every rank's ``t``, in rank order."""
        code = self._check(t, "all_gather")
        if self._check(out, "all_gather") != code or out.numel() != self.world_size * t.numel():
            raise ValueError(
                f"llmmem shm all_gather: out must be {self.world_size} x {t.numel()} elements of "
                f"{t.dtype}, got {out.numel()} of {out.dtype}"
            )
        native.shm_all_gather(self._handle, t.data_ptr(), out.data_ptr(), t.numel(), code)
        return out

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``out`` = this rank's block of the sum of every rank's ``t`` (world blocks of out.numel())."""
        code = self._check(t, "reduce_scatter")
        if self._check(out, "reduce_scatter") != code or t.numel() != self.world_size * out.numel():
            raise ValueError(
                f"llmmem shm reduce_scatter: input must be {self.world_size} x {out.numel()} elements "
                f"of {out.dtype}, got {t.numel()} of {t.dtype}"
            )
        native.shm_reduce_scatter(self._handle, t.data_ptr(), out.data_ptr(), out.numel(), code)
        return out
