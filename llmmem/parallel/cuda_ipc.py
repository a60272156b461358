"""CUDA IPC one-shot all-reduce between the ranks of one node (the Python side of cuda_allreduce.cu).

Set-up is collective: every rank allocates its buffer and IPC handle, the handles are exchanged
with ``all_gather_object`` over the group, every rank opens its peers' buffers, and all ranks
agree on the outcome (any failure anywhere -> every rank falls back to NCCL). Calls are ordered on
the current CUDA stream and do not synchronise. A missing peer (timeout) or ranks that disagree on
the size or dtype make the kernels of every rank give up (queued ones at once, not each after its
own timeout) and set the result to NaN where they did; :meth:`CudaIpcCommunicator.check` raises
the error (``StateError``, or ``InvalidArgumentError`` for a disagreement) and any later call on
the communicator raises it without synchronising, instead of reducing stale data.

Not CUDA-graph capturable: each call advances a host-side epoch that the kernel's flags compare
against, so a replayed graph would reuse a stale epoch (capture NCCL collectives instead).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmmem._devices import cuda_index
from llmmem._native import available, native
from llmmem.parallel.exchange import all_gather_json
from llmmem.parallel.shm import DTYPE_CODES, SetupError, agree_or_raise, fail_setup, host_identity

__all__ = ["CudaIpcCommunicator", "SetupError"]


class CudaIpcCommunicator:
    def __init__(self, handle, rank: int, world_size: int, max_bytes: int, device: torch.device) -> None:
        self._handle = handle
        self.rank, self.world_size, self.max_bytes, self.device = rank, world_size, max_bytes, device

    @classmethod
    def setup(cls, group, device: torch.device, *, timeout: float, max_bytes: int):
        """``max_bytes``: the largest message the engine serves (its buffers are sized for it,
        rounded up to 256 B and capped at 64 MiB)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        max_bytes = min(max_bytes, 64 << 20)
        max_bytes = max(256, (max_bytes + 255) // 256 * 256)
        handle, ipc, error = None, None, None
        if not available():
            error = "the C core (llmmem._C) is not loaded"
        elif not native.build_info().get("cuda_built"):
            error = "llmmem was built without CUDA"
        elif world > 8:
            error = f"group of {world} ranks is larger than 8"
        else:
            try:
                handle, ipc = native.cuda_ar_create(cuda_index(device), rank, world, max_bytes, float(timeout))
            except Exception as exc:
                error = f"rank {rank}: {exc}"
        what = "set-up of the CUDA IPC all-reduce"
        try:
            info = all_gather_json(
                (host_identity(), None if ipc is None else bytes(ipc).hex(), error), group, timeout=timeout, what=what
            )
        except BaseException:
            if handle is not None:
                native.cuda_ar_close(handle)
            raise
        info = [(h, None if i is None else bytes.fromhex(i), e) for h, i, e in info]
        failures = [e for _, _, e in info if e]
        if len({h for h, _, _ in info}) != 1:
            failures.append("the group spans several hosts")
        if failures:
            fail_setup(failures, handle, native.cuda_ar_close)
        try:
            native.cuda_ar_connect(handle, b"".join(h for _, h, _ in info))
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        agree_or_raise(error, group, handle, native.cuda_ar_close, timeout=timeout, what=what)
        return cls(handle, rank, world, max_bytes, device)

    def set_timeout(self, seconds: float) -> None:
        """Applies to communicators set up later (the kernel's bound is fixed at creation)."""

    def close(self) -> None:
        if self._handle is not None:
            native.cuda_ar_close(self._handle)
            self._handle = None

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda" or not t.is_contiguous() or t.dtype not in DTYPE_CODES:
            raise ValueError(
                f"llmmem cuda all_reduce: needs a contiguous CUDA float32/float16/bfloat16 tensor, "
                f"got {t.dtype} on {t.device}"
            )
        stream = torch.cuda.current_stream(t.device).cuda_stream
        native.cuda_ar_all_reduce(self._handle, t.data_ptr(), t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype], stream)
        return t

    def check(self) -> None:
        """Wait for the current stream; raise if a kernel timed out waiting for a peer."""
        native.cuda_ar_check(self._handle, torch.cuda.current_stream(self.device).cuda_stream)
