"""Caps on what a trial step may allocate, checked *before* the allocation: :class:`AllocationCap` on
the CPU (a dispatch mode that sizes each operator's outputs first), :func:`cuda_cap` on CUDA (the
caching allocator's per-process limit, which it checks before asking the driver).

Used by :func:`llmmem.find_batch_size`, so that a trial at too large a batch is stopped at its first
operator that would cross the cap, instead of allocating a tensor of many times the budget and being
noticed afterwards.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from llmmem.errors import OutOfMemoryError
from llmmem.units import format_bytes

__all__ = ["AllocationCap", "cuda_cap"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# what an operator's schema says about the storages its outputs can need
_NO_NEW, _SIZE_IT = "no new storage", "size it"


class _Unpredictable(Exception):
    pass


class AllocationCap(TorchDispatchMode):
    """Dispatch mode: an operator whose new CPU storages would take the live bytes past ``limit``
    raises :class:`llmmem.OutOfMemoryError` before it runs, as a full device would.

    :param limit: bytes of live CPU tensor storage allowed.
    :param live: ``live()`` returns the live CPU tensor bytes now, e.g. the ``allocated`` of a
        :class:`~llmmem.diagnostics.live.LiveBytes` entered *after* this mode (so that it sits above it
        on the mode stack and counts each operator's outputs once the operator has run).

    How the outputs are sized: views and in-place operators need no new storage (their schemas say
    so); every other operator is first run on meta tensors of the same sizes, strides and dtypes
    (no data, no random numbers drawn), and the storages its results would newly take (or grow, for
    ``out=`` and ``resize_``) are its request. Operators that cannot be run that way (outputs whose
    size depends on the data, such as ``nonzero``; tensor subclasses; tensors on other devices) run
    first and are checked right after; :attr:`unchecked` counts them, :attr:`unchecked_bytes` sums
    their new CPU bytes. :attr:`refused` is ``(live bytes, requested bytes, operator)`` of the refusal.

    Cost: on top of the operator, one run on meta tensors for each operator that is not a view or
    in-place (microseconds each); no memory.
    """

    def __init__(self, limit: int, live) -> None:
        super().__init__()
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"AllocationCap: limit must be a positive int of bytes, got {limit!r}")
        if not callable(live):
            raise TypeError(f"AllocationCap: live must be callable as live() -> bytes, got {type(live).__name__}")
        self.limit, self.live = limit, live
        self.unchecked = 0
        self.unchecked_bytes = 0
        self.refused: tuple | None = None
        self._kinds: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # eager only, like LiveBytes: no dynamo frames per operator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            request = self._request(func, args, kwargs)
        except _Unpredictable:
            request = None
        if request is None:
            before = _storage_bytes((args, kwargs))
            out = func(*args, **kwargs)
            new = _new_bytes(out, before, "cpu")
            self.unchecked += 1
            self.unchecked_bytes += new
            live = self.live()
            if new and live + new > self.limit:
                self._refuse(live, new, func)
            return out
        if request:
            live = self.live()
            if live + request > self.limit:
                self._refuse(live, request, func)
        return func(*args, **kwargs)

    def _refuse(self, live: int, request: int, func) -> None:
        self.refused = (live, request, str(func))
        raise OutOfMemoryError(
            f"allocation cap of {format_bytes(self.limit)} ({self.limit:,} bytes) on cpu: {func} needs "
            f"{format_bytes(request)} ({request:,} bytes) with {format_bytes(live)} ({live:,} bytes) live"
        )

    # ---------------------------------------------------------------------------------------------
    def _kind(self, func) -> str:
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _schema_kind(func)
        return kind

    def _request(self, func, args, kwargs) -> int:
        if self._kind(func) == _NO_NEW:
            return 0
        # meta copy's storage -> the real storage's bytes (a copy's storage starts minimal, so an
        # input's growth is measured against the real one)
        sizes: dict = {}

        def meta(x):
            if isinstance(x, torch.Tensor):
                if type(x) not in _PLAIN or x.layout != torch.strided or x.device.type != "cpu":
                    raise _Unpredictable
                m = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
                sizes[m.untyped_storage()._cdata] = x.untyped_storage().nbytes()
                return m
            return x

        margs, mkwargs = tree_map(meta, args), tree_map(meta, kwargs)
        if "device" in mkwargs or not sizes:
            # a factory (torch.empty, randint, ...): its device is the kwarg, the CPU when absent
            device = mkwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                raise _Unpredictable
            if any(a.name == "device" for a in func._schema.arguments):
                mkwargs["device"] = torch.device("meta")
            if mkwargs.get("pin_memory"):
                mkwargs["pin_memory"] = False
        try:
            out = func(*margs, **mkwargs)
        except Exception as exc:  # no meta kernel, or a size that depends on the data
            raise _Unpredictable from exc
        return _new_bytes(out, sizes, "meta")


def _schema_kind(func) -> str:
    """Views, in-place operators and operators returning no tensor never make a storage; anything
    else (including ``out=`` variants and ``resize_``, which may grow one) is sized."""
    schema = func._schema
    returns = [r for r in schema.returns if "Tensor" in str(r.type)]
    if not returns:
        return _NO_NEW
    if all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return _NO_NEW  # views: they share their input's storage
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    out_args = any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if all(r.alias_info is not None and r.alias_info.is_write for r in returns) and not out_args:
        if "resize" not in name:
            return _NO_NEW  # in place on its input: the same storage, the same size
    return _SIZE_IT


def _storage_bytes(tensors) -> dict:
    out = {}
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and type(t) in _PLAIN and t.layout == torch.strided:
            s = t.untyped_storage()
            out[s._cdata] = s.nbytes()
    return out


def _new_bytes(out, inputs: dict, device: str) -> int:
    """Bytes of the storages on ``device`` among ``out`` that are not among ``inputs`` (storage ->
    bytes before the operator), plus the growth of those that are."""
    new = 0
    seen = set()
    for t in tree_leaves(out):
        if not isinstance(t, torch.Tensor) or type(t) not in _PLAIN or t.layout != torch.strided:
            continue
        if t.device.type != device:
            continue
        s = t.untyped_storage()
        key = s._cdata
        if key in seen:
            continue
        seen.add(key)
        new += max(0, s.nbytes() - inputs[key]) if key in inputs else s.nbytes()
    return new


@contextlib.contextmanager
def cuda_cap(device: str, limit: int):
    """Within the block, PyTorch's caching allocator on ``device`` refuses (``torch.OutOfMemoryError``)
    an allocation that would take its reserved bytes past ``limit``, before asking the driver for it:
    ``torch.cuda.set_per_process_memory_fraction`` set to ``limit`` (or left lower if it already
    is), restored on exit. Synchronises nothing; costs no memory."""
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter(device) if getter is not None else 1.0
    fraction = min(before, limit / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield fraction * total
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)
