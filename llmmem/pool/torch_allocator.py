"""How PyTorch allocates from an llmmem pool: :func:`use_pool` (a scope, through
``torch.cuda.MemPool``), :func:`install_allocator` (process-wide, through
``CUDAPluggableAllocator``), and :func:`torch_oom_errors` (an installed pool's out-of-memory as
torch's own error type)."""

from __future__ import annotations

import contextlib
import contextvars

from llmmem._native import native
from llmmem.pool import memory_pool as _memory_pool
from llmmem.pool.memory_pool import MemoryPool, _require_pluggable, installed_pool, mark_installed

__all__ = ["use_pool", "current_pool", "install_allocator", "torch_oom_errors"]

_current: contextvars.ContextVar = contextvars.ContextVar("llmmem_current_pool", default=None)


@contextlib.contextmanager
def use_pool(pool: MemoryPool):
    """Make ``pool`` the current pool for the enclosed block (this thread only).

    **CUDA pools**: every CUDA allocation this thread makes inside the block (``torch.empty``,
    operator outputs, optimizer state, ...) is served from memory that llmmem's pool supplies, via
    ``torch.cuda.MemPool(allocator=CUDAPluggableAllocator(...))`` and ``torch.cuda.use_mem_pool``.
    PyTorch keeps its per-tensor caching, ``torch.cuda.memory_stats()`` and snapshots; the pool's
    own :meth:`~MemoryPool.stats` count the segments PyTorch took. Tensors may outlive the block.
    Allocations made by other threads (for example autograd's backward threads) are *not* routed.
    Nesting and switching pools work. Needs torch >= 2.5.

    **CPU and pinned pools**: PyTorch offers no Python-level hook for its CPU allocator, so
    ``use_pool`` does **not** route ``torch.empty``, ``torch.zeros`` or operator outputs on the CPU.
    It only makes ``pool`` what :func:`current_pool` returns, for code (llmmem's own offload
    staging, your helpers) that takes buffers from the current pool; tensors from the pool are
    made explicitly with :meth:`MemoryPool.empty`.
    """
    if not isinstance(pool, MemoryPool):
        raise TypeError(f"use_pool: expected an llmmem.MemoryPool, got {type(pool).__name__}")
    pool._cap()
    if pool.kind == "cuda":
        torch = _memory_pool._torch()
        mempool = pool._mempool()
        with torch.cuda.use_mem_pool(mempool, device=pool.device):
            token = _current.set(pool)
            try:
                yield pool
            finally:
                _current.reset(token)
    else:
        token = _current.set(pool)
        try:
            yield pool
        finally:
            _current.reset(token)


def current_pool() -> MemoryPool | None:
    """The pool of the innermost :func:`use_pool` block of this thread, or None."""
    return _current.get()


def install_allocator(pool: MemoryPool) -> None:
    """Make ``pool`` PyTorch's CUDA allocator for the whole process (``change_current_allocator``).

    Every CUDA tensor is then allocated and freed by llmmem directly, with stream-ordered reuse
    (each free records a CUDA event on the tensor's allocation stream, a few microseconds of host
    time; PyTorch tells the allocator no other stream, so ``Tensor.record_stream`` has no effect).
    It must be called before the process makes its first CUDA allocation, and cannot be undone.
    Costs of this mode (PyTorch's, not llmmem's): ``torch.cuda.memory_stats()`` and
    ``memory_snapshot()`` stop working (use ``pool.stats()``), ``cudnn.benchmark`` is unsupported.

    **Out of memory.** An allocation the pool cannot serve raises a plain ``RuntimeError`` (not
    ``torch.OutOfMemoryError``) whose message starts with ``"CUDA out of memory (llmmem pool, slot
    k): out of memory allocating N bytes"`` and carries the pool's state (allocated, reserved, free,
    largest free block, segments, ``max_size``). PyTorch turns only its own C++ exception type,
    ``c10::OutOfMemoryError``, into ``torch.OutOfMemoryError``, and a pluggable allocator has no
    way to raise that type without being built against one torch release's C++ ABI, which llmmem
    is not. Catch it with ``except RuntimeError`` (which also catches ``torch.OutOfMemoryError``,
    a subclass), or run the step inside :func:`torch_oom_errors`, which re-raises it as
    ``torch.OutOfMemoryError`` with the same message. Under :func:`use_pool` the OOM already is a
    ``torch.OutOfMemoryError`` (PyTorch's caching allocator raises it when the pool returns NULL).
    Prefer :func:`use_pool` unless you need llmmem to do all the caching.
    """
    if not isinstance(pool, MemoryPool):
        raise TypeError(f"install_allocator: expected an llmmem.MemoryPool, got {type(pool).__name__}")
    if pool.kind != "cuda":
        raise ValueError(
            f"install_allocator: needs a CUDA pool (device='cuda'), got device={pool.kind!r}; "
            "CPU pools hand out tensors with pool.empty(shape, dtype)"
        )
    pool._cap()
    if installed_pool() is pool:
        return
    if installed_pool() is not None:
        raise RuntimeError(
            "llmmem.install_allocator: another pool is already installed; the process-wide "
            "allocator cannot be swapped once installed"
        )
    torch = _memory_pool._torch()
    _require_pluggable(torch)
    slot = pool._bind_slot()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        native.__file__, f"llmmem_pool_xalloc_{slot}", f"llmmem_pool_free_{slot}"
    )
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as exc:
        if "initialized" in str(exc):
            raise RuntimeError(
                "llmmem.install_allocator must be called before the first CUDA allocation of the process: "
                "PyTorch's CUDA allocator is already in use, and cannot be swapped. Call it at the very "
                "start of your script (before creating any CUDA tensor or model), or use "
                "`with llmmem.use_pool(pool):`, which works at any time."
            ) from exc
        raise
    mark_installed(pool)


# The start of the message of an installed pool's out-of-memory (backend_cuda.cu, alloc_or_throw).
_INSTALLED_OOM_PREFIX = "CUDA out of memory (llmmem pool, slot "


@contextlib.contextmanager
def torch_oom_errors():
    """Inside the block (or a function decorated with it), an out-of-memory of a pool installed
    with :func:`install_allocator`, which PyTorch raises as a plain ``RuntimeError``, is re-raised
    as ``torch.OutOfMemoryError`` with the same message (the pool's summary), the original as its
    ``__cause__``. Any other exception passes unchanged. Costs nothing unless an exception leaves
    the block.

    Example::

        with llmmem.torch_oom_errors():
            loss = model(batch).sum(); loss.backward()
    """
    try:
        yield
    except RuntimeError as exc:
        torch = _memory_pool._torch()
        if not isinstance(exc, torch.OutOfMemoryError) and _INSTALLED_OOM_PREFIX in str(exc):
            raise torch.OutOfMemoryError(str(exc)) from exc
        raise
