"""A caching memory pool with O(1) allocation, little fragmentation and honest statistics.

:class:`MemoryPool` reserves memory up front (``initial_size``, in one piece) and grows by further
segments up to ``max_size``. Inside it, llmmem's C allocator hands out blocks with a two-level
segregated fit (512-byte granularity, immediate coalescing, small requests packed apart from
large ones, stream-ordered reuse on CUDA).

Two ways to use a CUDA pool from PyTorch:

* ``with llmmem.use_pool(pool): ...`` — allocations made by this thread inside the block come from
  the pool's memory, through ``torch.cuda.MemPool`` with llmmem as its allocator. PyTorch's caching
  allocator stays in charge of per-tensor caching and its statistics keep working; llmmem supplies
  and accounts for the segments. Can be entered and left at any time, nested and switched.
* ``llmmem.install_allocator(pool)`` — process-wide: every CUDA tensor is allocated and freed by
  llmmem directly (PyTorch's own caching is bypassed). Must be called before the first CUDA
  allocation of the process.

On the CPU (``device="cpu"`` or page-locked ``"pinned"``) tensors come from the pool through
:meth:`MemoryPool.empty`; see :func:`use_pool` for what it does and does not route there.
"""

from __future__ import annotations

import math
import numbers
import sys
import threading

from llmmem._native import available, load_error, native
from llmmem.errors import OutOfMemoryError
from llmmem.units import format_bytes, parse_bytes

__all__ = ["MemoryPool", "feature_status", "installed_pool"]

# The torch release that introduced torch.cuda.MemPool / use_mem_pool with a custom allocator.
_MEMPOOL_MIN_TORCH = "2.5"

# The pool given to llmmem.pool.torch_allocator.install_allocator, kept alive for the life of the
# process: torch calls into it until exit, so it can never be closed.
_installed = None


def installed_pool():
    """The pool installed as the process-wide CUDA allocator, or None."""
    return _installed


def mark_installed(pool) -> None:
    global _installed
    _installed = pool


def _torch():
    import torch

    return torch


def _parse_device(device) -> tuple[str, int]:
    """("cpu"|"pinned"|"cuda", index) from "cpu", "pinned", "cuda", "cuda:1", torch.device or an int."""
    if isinstance(device, bool):
        raise ValueError(f"device: expected 'cpu', 'pinned', 'cuda' or 'cuda:N', got {device!r}")
    if isinstance(device, numbers.Integral):
        if device < 0:
            raise ValueError(f"device: a CUDA device index must be >= 0, got {device}")
        return "cuda", int(device)
    if not isinstance(device, str):
        try:
            torch = _torch()
        except ImportError:
            torch = None
        if torch is not None and isinstance(device, torch.device):
            device = str(device)
        else:
            raise ValueError(f"device: expected 'cpu', 'pinned', 'cuda' or 'cuda:N', got {type(device).__name__}")
    name = device.strip().lower()
    if name in ("cpu", "pinned"):
        return name, -1
    if name == "cuda":
        # torch.cuda.current_device() would initialize PyTorch's CUDA state, and with it its caching
        # allocator, after which install_allocator can no longer swap it: ask only once it is up.
        index = 0
        try:
            torch = _torch()
            if torch.cuda.is_initialized():
                index = torch.cuda.current_device()
        except Exception:
            pass
        return "cuda", index
    if name.startswith("cuda:") and name[5:].isdigit():
        return "cuda", int(name[5:])
    raise ValueError(f"device: expected 'cpu', 'pinned', 'cuda' or 'cuda:N', got {device!r}")


def _require_mempool(torch) -> None:
    """Raises a RuntimeError naming the torch version needed when MemPool is missing."""
    cuda = getattr(torch, "cuda", None)
    memory = getattr(cuda, "memory", None)
    missing = [
        n
        for n, o in (
            ("torch.cuda.MemPool", cuda),
            ("torch.cuda.use_mem_pool", cuda),
            ("torch.cuda.memory.CUDAPluggableAllocator", memory),
        )
        if o is None or not hasattr(o, n.rsplit(".", 1)[1])
    ]
    if missing:
        raise RuntimeError(
            f"llmmem.use_pool on CUDA needs torch >= {_MEMPOOL_MIN_TORCH} (for {', '.join(missing)}); "
            f"this is torch {getattr(torch, '__version__', '?')}. Upgrade torch, or use "
            "llmmem.install_allocator(pool) at the start of the process instead."
        )


def _require_pluggable(torch) -> None:
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    if memory is None or not all(hasattr(memory, n) for n in ("CUDAPluggableAllocator", "change_current_allocator")):
        raise RuntimeError(
            "llmmem.install_allocator needs torch >= 2.0 (torch.cuda.memory.CUDAPluggableAllocator and "
            f"change_current_allocator); this is torch {getattr(torch, '__version__', '?')}"
        )


def _require_native():
    if not available():
        raise ImportError(
            f"llmmem: the C core (llmmem._C) is not loaded, so MemoryPool is unavailable: {load_error!r}"
        )
    return native


class MemoryPool:
    """A pool of ``device`` memory managed by llmmem's caching allocator.

    :param initial_size: bytes reserved at once, in one piece, kept until the pool is closed:
        an integer or a string such as ``"4GB"``, ``"512MiB"``, ``"1.5GiB"``. Default 0.
    :param max_size: cap on the memory the pool reserves (``None``: no cap beyond the device).
        Must be ``>= initial_size``. An allocation that would exceed it fails.
    :param device: ``"cpu"`` (ordinary host memory), ``"pinned"`` (page-locked host memory; needs a
        CUDA driver), ``"cuda"`` / ``"cuda:N"`` / a ``torch.device`` / an index (device memory).
    :param growth_size: when the pool must grow, it reserves at least this much (default: only
        what the request needs, rounded up to 2 MiB).
    :param expandable: whether the pool's memory grows in place (``None``: the device's default,
        see below). ``"pinned"`` memory cannot (``True`` is a ``ValueError``).

    How it grows. *In place* (``"cpu"`` by default; ``"cuda"`` with ``expandable=True``): the
    pool's memory is one contiguous region over reserved address space that grows by what a
    request lacks, and, when it must hold more than ever before, first gives back the whole 2 MiB
    pages of its free holes (mapped again when reused; never below ``initial_size``, and not with
    ``max_size``). On CUDA this uses the driver's virtual memory management (``cuMemAddressReserve``
    + ``cuMemCreate``/``cuMemMap``, like PyTorch's ``expandable_segments``); if the driver or GPU
    lacks it, the pool warns and uses ``cudaMalloc`` instead (see :attr:`expandable`). *By
    segments* (``"cuda"`` by default, ``"pinned"``, ``"cpu"`` with ``expandable=False``): each
    growth is a separate ``cudaMalloc``/``cudaHostAlloc``, fully free ones are given back when
    growing. Growing in place wastes less (``benchmarks/bench_pool.py`` replays traces both ways).

    ``expandable=True`` on CUDA is **opt-in and not yet validated on a GPU**: the backend builds,
    its bookkeeping is tested over a simulated driver, and its GPU tests
    (``tests/pool/test_pool_cuda_vmm.py``) are written but have not run on hardware yet. CUDA keeps
    ``cudaMalloc`` segments by default until they have.

    Creating the pool reserves ``initial_size`` immediately (one ``cudaMalloc`` for CUDA, one
    ``cudaHostAlloc`` for pinned). Reserved memory is memory that exists: a ``"cpu"`` pool takes
    memory from the system only when the system can back it (``MemAvailable`` + ``SwapFree``, the
    cgroup's memory limit, ``RLIMIT_DATA``), and makes it resident as it takes it (as ``cudaMalloc``
    does), so a request the machine cannot hold raises :class:`llmmem.OutOfMemoryError` stating the
    bytes requested and available, instead of succeeding and getting the process killed by the
    kernel when first written. Its reserved address space is bounded by ``max_size`` and by the
    machine's memory, so pools work under ``ulimit -v``. Memory given back by :meth:`empty_cache` or :meth:`close` is
    returned to the device (``cudaFree``, which synchronizes the device; an expandable CUDA pool
    unmaps instead, without a device synchronization, since it gives back only memory whose free
    has completed on its stream).
    """

    def __init__(self, initial_size=0, max_size=None, device="cpu", *, growth_size=0, expandable=None):
        initial = parse_bytes(initial_size, "initial_size")
        cap = None if max_size is None else parse_bytes(max_size, "max_size")
        growth = parse_bytes(growth_size, "growth_size")
        if cap is not None and cap == 0:
            raise ValueError("max_size: must be > 0 bytes, or None for no cap")
        if cap is not None and cap < initial:
            raise ValueError(f"max_size ({format_bytes(cap)}) must be >= initial_size ({format_bytes(initial)})")
        if expandable is not None and not isinstance(expandable, bool):
            raise TypeError(f"expandable: expected True, False or None, got {type(expandable).__name__}")
        kind, index = _parse_device(device)
        if kind == "pinned" and expandable:
            raise ValueError("expandable=True: page-locked ('pinned') memory cannot grow in place")
        nat = _require_native()
        self._kind = kind
        self._index = index
        fixed = expandable is False
        if kind == "cuda" and expandable:
            self._capsule = _create_cuda_vmm(nat, index, initial, cap or 0, growth)
        else:
            self._capsule = nat.pool_create(kind, index, initial, cap or 0, growth, fixed)
        self._backend = nat.pool_info(self._capsule)[0]
        self._expandable = self._backend in ("host", "cuda_vmm") and not fixed
        self._initial = initial
        self._max = cap
        self._slot = None
        self._torch_pool = None
        self._lock = threading.Lock()  # guards the lazy creation of the slot and the torch MemPool

    # ---- identity -------------------------------------------------------------------------
    @property
    def device(self):
        """The pool's device as a ``torch.device`` (``cpu`` for both host kinds)."""
        torch = _torch()
        return torch.device("cuda", self._index) if self._kind == "cuda" else torch.device("cpu")

    @property
    def kind(self) -> str:
        """``"cpu"``, ``"pinned"`` or ``"cuda"``."""
        return self._kind

    @property
    def expandable(self) -> bool:
        """Whether the pool's memory grows in place (one region over reserved address space),
        rather than by separate segments. ``False`` for an ``expandable=True`` CUDA pool whose
        driver lacked virtual memory management (it warned and uses ``cudaMalloc``)."""
        return self._expandable

    @property
    def backend(self) -> str:
        """The C backend serving the pool: ``"host"``, ``"pinned"``, ``"cuda"`` (``cudaMalloc``) or
        ``"cuda_vmm"`` (virtual memory management, grows in place)."""
        return self._backend

    @property
    def initial_size(self) -> int:
        return self._initial

    @property
    def max_size(self) -> int | None:
        return self._max

    def __repr__(self) -> str:
        dev = f"cuda:{self._index}" if self._kind == "cuda" else self._kind
        cap = "None" if self._max is None else format_bytes(self._max)
        state = (
            "closed" if self._capsule is None else f"reserved {format_bytes(self.stats()['reserved_bytes.current'])}"
        )
        return (
            f"MemoryPool(device={dev!r}, initial_size={format_bytes(self._initial)}, max_size={cap}, "
            f"expandable={self._expandable}, {state})"
        )

    def _cap(self):
        if self._capsule is None:
            raise ValueError("llmmem: this MemoryPool is closed")
        return self._capsule

    # ---- tensors --------------------------------------------------------------------------
    def empty(self, shape, dtype=None):
        """An uninitialized tensor of ``shape`` and ``dtype`` (default ``torch.float32``) whose
        memory comes from this pool and returns to it when the tensor (and every view of it) dies.

        CPU and pinned pools: the tensor is a CPU tensor over the pool's memory. CUDA pools: the
        tensor is allocated by PyTorch inside :func:`use_pool`. Zero-element tensors take no memory
        from the pool. Does not synchronize.

        :raises llmmem.OutOfMemoryError: (a ``MemoryError``) when ``max_size`` or the machine cannot
            hold the tensor; the message states the bytes requested and available.
        """
        torch = _torch()
        dtype = torch.float32 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
        if dtype in (
            torch.qint8,
            torch.quint8,
            torch.qint32,
            torch.quint4x2,
            torch.quint2x4,
        ):  # frombuffer crashes on use
            raise TypeError(f"dtype: quantized dtypes such as {dtype} are not supported by MemoryPool.empty")
        shape = _parse_shape(shape)
        if self._kind == "cuda":
            with torch.cuda.use_mem_pool(self._mempool(), device=self.device):
                return torch.empty(shape, dtype=dtype, device=self.device)
        numel = math.prod(shape)
        itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else torch.empty((), dtype=dtype).element_size()
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * itemsize
        if nbytes > sys.maxsize:
            raise OutOfMemoryError(
                f"MemoryPool.empty: shape {shape} of {dtype} needs {nbytes} bytes, more than any address space holds"
            )
        buf = native.pool_buffer(self._cap(), nbytes)
        flat = torch.frombuffer(buf, dtype=dtype, count=numel)
        return flat if len(shape) == 1 else flat.view(shape)

    # ---- statistics -----------------------------------------------------------------------
    def stats(self) -> dict:
        """The pool's statistics, named as in ``torch.cuda.memory_stats``: ``allocated_bytes``,
        ``requested_bytes``, ``active_bytes``, ``reserved_bytes``, ``allocation``, ``segment`` (each
        ``.current`` and ``.peak``), counters ``num_allocs``, ``num_frees``, ``num_ooms``,
        ``num_invalid_frees``, ``num_device_alloc``, ``num_device_free``, ``num_sync_events``, and
        ``free_bytes`` (reserved - allocated), ``largest_free_block`` (the longest free stretch of
        reserved memory, never more than ``free_bytes``), ``fragmentation`` (1 - largest free /
        free), and ``decommitted_bytes`` (free address space inside segments whose memory was given
        back: not in reserved, nor in free; a request may still be served there, committing it);
        ``device``, ``backend`` and ``expandable`` as the properties of the same names.

        With :func:`use_pool`, llmmem's blocks are PyTorch's *segments*: per-tensor numbers are in
        ``torch.cuda.memory_stats()``. Reads counters under the pool's lock; no GPU sync.
        """
        d = native.pool_stats(self._cap())
        d["device"] = f"cuda:{self._index}" if self._kind == "cuda" else self._kind
        d["backend"] = self._backend
        d["expandable"] = self._expandable
        return d

    def reset_peak_stats(self) -> None:
        """Sets every ``.peak`` statistic to its current value."""
        native.pool_reset_peak_stats(self._cap())

    def snapshot(self) -> list[dict]:
        """Segments and their blocks, address order, for plotting: a list of dicts with
        ``address``, ``total_size``, ``allocated_size``, ``active_size`` and ``blocks``
        (``address``, ``size``, ``requested_size``, ``state`` in {"active_allocated",
        "active_pending_free", "inactive"}, ``small``)."""
        segments: list[dict] = []
        by_base: dict[int, dict] = {}
        device = f"cuda:{self._index}" if self._kind == "cuda" else self._kind
        for base, seg_size, addr, size, requested, state, small, stream in native.pool_snapshot(self._cap()):
            seg = by_base.get(base)
            if seg is None:
                seg = {
                    "address": base,
                    "total_size": seg_size,
                    "allocated_size": 0,
                    "active_size": 0,
                    "device": device,
                    "blocks": [],
                }
                by_base[base] = seg
                segments.append(seg)
            seg["blocks"].append(
                {
                    "address": addr,
                    "size": size,
                    "requested_size": requested,
                    "state": state,
                    "small": small,
                    "stream": stream,
                }
            )
            if state == "active_allocated":
                seg["allocated_size"] += size
            if state != "inactive":
                seg["active_size"] += size
        return segments

    def memory_summary(self) -> str:
        """A readable table of the statistics (like ``torch.cuda.memory_summary``)."""
        s = self.stats()
        cap = "unlimited" if s["max_size"] is None else format_bytes(s["max_size"])
        rows = [
            ("Allocated memory", "allocated_bytes", True),
            ("Requested memory", "requested_bytes", True),
            ("Active memory", "active_bytes", True),
            ("Reserved memory", "reserved_bytes", True),
            ("Allocations", "allocation", False),
            ("Segments", "segment", False),
        ]
        width = 70
        lines = [
            "=" * width,
            f" llmmem MemoryPool ({s['device']}, {s['backend']}, "
            f"{'grows in place' if s['expandable'] else 'grows by segments'})",
            f" initial_size {format_bytes(s['initial_size'])}, max_size {cap}",
            "-" * width,
            f" {'Metric':<24}{'Current':>20}{'Peak':>20}",
            "-" * width,
        ]
        for label, key, is_bytes in rows:
            cur, peak = s[key + ".current"], s[key + ".peak"]
            fmt = format_bytes if is_bytes else str
            lines.append(f" {label:<24}{fmt(cur):>20}{fmt(peak):>20}")
        lines += [
            "-" * width,
            f" Free in reserved        {format_bytes(s['free_bytes']):>20}   largest block "
            f"{format_bytes(s['largest_free_block'])}",
            f" Fragmentation           {100 * s['fragmentation']:>19.1f}%   (1 - largest free / free)",
            f" Decommitted (not held)  {format_bytes(s['decommitted_bytes']):>20}",
            f" Small-request chunks    {s['small_chunks']:>20}",
            f" Allocs / frees          {s['num_allocs']:>20} / {s['num_frees']}",
            f" OOMs / invalid frees    {s['num_ooms']:>20} / {s['num_invalid_frees']}",
            f" Device allocs / frees   {s['num_device_alloc']:>20} / {s['num_device_free']}",
            f" Event syncs             {s['num_sync_events']:>20}",
            "=" * width,
        ]
        return "\n".join(lines)

    # ---- memory management ----------------------------------------------------------------
    def empty_cache(self) -> int:
        """Returns fully free segments grown beyond ``initial_size`` to the device; returns the
        bytes released. On CUDA, first calls ``torch.cuda.empty_cache()`` so that PyTorch can hand
        back the segments it cached from this pool under :func:`use_pool`, then waits for the pool's
        pending stream events (a host sync)."""
        if self._kind == "cuda" and self._torch_pool is not None:
            _torch().cuda.empty_cache()
        return native.pool_empty_cache(self._cap())

    def close(self) -> None:
        """Releases all of the pool's memory now. Raises :class:`llmmem.StateError` while tensors
        from the pool are alive. Idempotent; any other use of a closed pool raises ``ValueError``.
        (Dropping the last reference also releases the memory, once the last block has come back.)"""
        if self._capsule is None:
            return
        if self is _installed:
            raise RuntimeError(
                "llmmem: this pool is installed as the process-wide CUDA allocator; it cannot be closed"
            )
        if self._torch_pool is not None:
            torch = _torch()
            self._torch_pool = None
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        # The C destroy unbinds the pool's slot itself, after waiting for calls PyTorch may be
        # making through it on other threads (unbinding here, after it, could hit a slot another
        # pool has taken since).
        native.pool_close(self._capsule)
        self._slot = None
        self._capsule = None

    # ---- PyTorch integration --------------------------------------------------------------
    def _bind_slot(self) -> int:
        with self._lock:
            if self._slot is None:
                self._slot = native.pool_bind_slot(self._cap())
            return self._slot

    def _mempool(self):
        """The torch.cuda.MemPool whose segments come from this pool (created on first use)."""
        torch = _torch()
        _require_mempool(torch)
        slot = self._bind_slot()
        with self._lock:
            if self._torch_pool is None:
                alloc = torch.cuda.memory.CUDAPluggableAllocator(
                    native.__file__, f"llmmem_pool_alloc_{slot}", f"llmmem_pool_free_{slot}"
                )
                self._torch_pool = torch.cuda.MemPool(allocator=alloc.allocator())
            return self._torch_pool


def _create_cuda_vmm(nat, index, initial, cap, growth):
    """A CUDA pool over the virtual-memory backend, or, when the driver or GPU lacks virtual
    memory management, over cudaMalloc with a warning saying why."""
    from llmmem.errors import NoDeviceError

    try:
        return nat.pool_create("cuda_vmm", index, initial, cap, growth)
    except NoDeviceError as exc:
        reason = str(exc)
    capsule = nat.pool_create("cuda", index, initial, cap, growth)  # raises if there is no GPU at all
    import warnings

    warnings.warn(
        f"llmmem.MemoryPool(expandable=True): {reason}; using cudaMalloc segments instead "
        "(the pool grows by separate segments)",
        RuntimeWarning,
        stacklevel=3,
    )
    return capsule


def _parse_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape: expected an int or a sequence of ints, got {type(shape).__name__}") from None
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"shape: every dimension must be an int, got {d!r}")
        if d < 0:
            raise ValueError(f"shape: dimensions must be >= 0, got {tuple(dims)}")
        out.append(int(d))
    return tuple(out)


def feature_status() -> tuple[bool, str]:
    """(usable, detail) for ``python -m llmmem info``."""
    if not available():
        return False, f"C core not loaded: {load_error!r}"
    parts = ["CPU pools"]
    try:
        cuda_built = bool(native.build_info()["cuda_built"])
    except Exception:
        cuda_built = False
    if not cuda_built:
        parts.append("CUDA/pinned pools not built (CPU-only build)")
        return True, "; ".join(parts)
    try:
        torch = _torch()
        gpu = torch.cuda.is_available()
    except Exception:
        torch, gpu = None, False
    if not gpu:
        parts.append("CUDA and pinned pools built, but no usable GPU here")
    else:
        parts.append("pinned and CUDA pools")
        try:
            _require_mempool(torch)
            parts.append("use_pool via torch.cuda.MemPool")
        except RuntimeError:
            parts.append(f"use_pool needs torch >= {_MEMPOOL_MIN_TORCH}")
    return True, "; ".join(parts)
