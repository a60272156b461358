"""Memory meters: the bytes a block keeps for backward and the activation bytes of a step, exactly.

:class:`measure_saved_bytes` counts what autograd saves (and the outputs the selective mode keeps,
and the inputs of offloaded regions on the memory they are kept in), each storage once;
:class:`ActivationMeter` counts every tensor storage made inside (through
:class:`llmmem.diagnostics.live.LiveBytes`, on the CPU as on CUDA), with its peak and named marks.
Storages are told apart by :func:`storage_address` (device, data pointer; not
:func:`llmmem.diagnostics.live.storage_key`, the storage object's id); :func:`tensor_bytes` sums
the storages of a structure of tensors, each once.

Not here: what the meters are run on and the CUDA allocator's own statistics
(:mod:`llmmem.checkpointing.costs`, :mod:`llmmem.checkpointing.recording`), work
(:mod:`llmmem.checkpointing.work`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch
from torch.utils import _pytree as pytree

from llmmem.checkpointing.observers import observe_kept
from llmmem.checkpointing.work import WorkCounter, in_backward
from llmmem.diagnostics.live import LiveBytes, device_key
from llmmem.dtensors import local

__all__ = ["measure_saved_bytes", "ActivationMeter", "storage_address", "storage_bytes", "tensor_bytes"]


class measure_saved_bytes:
    """Context manager: the bytes kept for backward by what runs inside, each storage once.

    Counts the tensors autograd saves at this level (inside a checkpointed region they are
    placeholders, so they do not count, exactly as they take no memory) and the outputs kept by
    the selective mode, and the inputs of offloaded regions on the memory they are kept in (the
    host copy; on the CPU the input itself). Storages in ``exclude`` (parameters, buffers) are not
    counted; ``storages`` keys carry the device, so device and host bytes can be told apart.
    ``.bytes`` is the total after the block exits; ``.storages`` maps storage key to bytes.

    Memory: none beyond weak bookkeeping (it keeps no tensor alive it did not already keep).
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self.excluded = {storage_address(t) for t in exclude}
        self.storages: dict = {}
        self.packed = 0  # tensors saved, each time (the region bookkeeping is paid per saved tensor)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _record(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        key = storage_address(t)
        if key not in self.excluded:
            self.storages[key] = storage_bytes(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        self._record(t)
        # Detached (same storage and version counter): a saved output returned as itself holds its
        # own grad_fn, a cycle through C++ that leaks when the forward is measured without a backward.
        return t.detach()

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks.__enter__()
        self._observing = observe_kept(self._record)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc):
        self._observing.__exit__(*exc)
        return self._hooks.__exit__(*exc)


def storage_address(t: torch.Tensor):
    t = local(t)
    return (t.device, t.untyped_storage().data_ptr())


def storage_bytes(t: torch.Tensor) -> int:
    return local(t).untyped_storage().nbytes()


def tensor_bytes(x) -> int:
    seen = {}
    for t in pytree.tree_leaves(x):
        if isinstance(t, torch.Tensor):
            seen[storage_address(t)] = storage_bytes(t)
    return sum(seen.values())


def _aliasing(func) -> bool:
    """Whether an operator returns (a view of) one of its inputs: views, in-place and out= operators."""
    hit = _ALIASING.get(func)
    if hit is None:
        hit = _ALIASING[func] = any(r.alias_info is not None for r in func._schema.returns)
    return hit


_ALIASING: dict = {}


class _Live(LiveBytes):
    """LiveBytes that tells its listeners when a storage first seen is one an operator's input
    already had (a view of a parameter, of the batch): it existed before, nothing was allocated.
    Counts work into ``work`` in the same dispatch (one Python call per operator, not two)."""

    def __init__(self, work=None) -> None:
        super().__init__()
        self.local = threading.local()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = getattr(self.local, "aliasing", False)
        self.local.aliasing = _aliasing(func)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.local.aliasing = before
        if self.work is not None:
            self.work.count(func, args, kwargs or {}, out)
        return out


class ActivationMeter:
    """Context manager: the activation bytes of what runs inside, exactly, with peaks and marks.

    Counts every tensor storage made inside (:class:`~llmmem.diagnostics.live.LiveBytes`; a storage
    that an operator returns as (a view of) one of its inputs existed before and is not counted)
    except parameter gradients: once autograd accumulates a gradient into one of ``params`` (its
    ``.grad`` when it was ``None``, or the temporary it adds into an existing ``.grad``, which is
    freed at once), that storage stops counting; so do tensors given to :meth:`exclude`. Only
    storages on ``device`` count (``None``: every device). ``work``: a :class:`WorkCounter` to count
    the operators into as well.

    ``current`` and ``peak`` are bytes now and the most since entering; :meth:`mark` records
    ``(current, most since the previous mark)`` under a name, and the mark ``"backward"`` is taken
    by itself just before the first allocation of a backward pass. Memory: weak references only;
    time: a Python call per operator (a diagnostic, as LiveBytes).
    """

    def __init__(self, params: Sequence[torch.Tensor] = (), device=None, work: WorkCounter | None = None) -> None:
        self._live = _Live(work)
        self._live.listeners.append(self._event)
        self._lock = threading.RLock()
        self._device = None if device is None else device_key(torch.device(device))
        self._params = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
        self._handles: list = []
        self._excluded: set = set()
        self._ignore = threading.local()
        self._current = 0
        self.peak = 0
        self.window_peak = 0
        self.marks: dict = {}

    def _counts(self, dev: str) -> bool:
        return self._device is None or dev == self._device

    def _add(self, delta: int) -> None:
        self._current += delta
        if self._current > self.peak:
            self.peak = self._current
        if self._current > self.window_peak:
            self.window_peak = self._current

    @property
    def current(self) -> int:
        """Bytes counted now (the frees queued since the last operator included)."""
        self._live.flush()
        return self._current

    def _event(self, event: str, key: int, dev: str, nbytes: int) -> None:
        if not self._counts(dev):
            return
        with self._lock:
            if event == "alloc":
                if getattr(self._ignore, "active", False) or getattr(self._live.local, "aliasing", False):
                    self._excluded.add(key)
                    return
                if "backward" not in self.marks and in_backward():
                    self.mark("backward")
                self._add(nbytes)
            elif key in self._excluded:
                if event == "free":
                    self._excluded.discard(key)
            else:
                self._add(-nbytes if event == "free" else nbytes)

    def exclude(self, t: torch.Tensor) -> None:
        """Stop counting ``t``'s storage (if it is counted)."""
        with self._lock:
            t = local(t)
            nbytes = self._live.storage_bytes(t)
            key = id(t.untyped_storage())
            if nbytes is None or key in self._excluded or not self._counts(device_key(t.device)):
                return
            self._excluded.add(key)
            self._current -= nbytes

    def counted_bytes(self, t: torch.Tensor) -> int:
        """Bytes of ``t``'s storage if this meter counts it, else 0."""
        t = local(t)
        with self._lock:
            if id(t.untyped_storage()) in self._excluded:
                return 0
            return self._live.storage_bytes(t) or 0

    @contextlib.contextmanager
    def ignoring(self):
        """Inside: storages made on this thread are never counted (the meter's owner's own copies)."""
        self._ignore.active = True
        try:
            yield
        finally:
            self._ignore.active = False

    def _accumulated(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.exclude(p.grad)

    def mark(self, name: str) -> None:
        """Record ``(current, most since the previous mark)`` as ``marks[name]``; start a new window."""
        self._live.flush()  # before this lock: the counter's listeners take it under the counter's
        with self._lock:
            self.marks[name] = (self._current, self.window_peak)
            self.window_peak = self._current

    def reset_window(self) -> None:
        self._live.flush()
        with self._lock:
            self.window_peak = self._current

    def __enter__(self):
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params]
        self._live.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self._live.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
