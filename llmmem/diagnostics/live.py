"""Live tensor bytes, counted exactly on any device: the allocator-free measure of memory that the
tracker, the planner's CPU profiles and ``python -m llmmem compare`` share.

:class:`LiveBytes` is a dispatch mode. Every storage that an operator run inside it returns is
counted, once, from the moment it appears until the storage is freed (a weak reference to the
storage's Python object, which PyTorch keeps exactly as long as the storage itself). Views share
their storage, so they cost nothing more; in-place operators that grow a storage (``resize_``,
``out=``) are re-read. Storages made before the mode was entered are counted when given to
:meth:`LiveBytes.track` (a model's parameters, an optimizer's state) or, with ``existing="gc"``,
every tensor the garbage collector can see when the mode starts.

FSDP2's gathered parameters, which it frees and allocates again by resizing their storages outside
any operator, are re-read after each resize (:mod:`llmmem.diagnostics.fsdp_storage`).

What it does not see: memory that no tensor storage owns (an allocator's cache, a kernel's
scratch buffer), tensors made on threads the mode is not active on (autograd's backward
threads inherit it; other threads do not), and what a DTensor operator makes inside its own
dispatch besides its result (a redistribution's buffers): a DTensor is counted as its local shard.

Hooks for tools built on it (:class:`llmmem.diagnostics.tracker.MemoryTracker`): ``listeners``
hear every change of a counted storage; ``tensor_listeners`` hear, once per new storage, the tensor
that revealed it (its shape and dtype, where it is being made); ``error_listeners`` hear an operator
that raised inside the mode (an out-of-memory error, before the stack unwinds); ``write_listeners``
hear the tensors an operator writes in place (its schema's ``Tensor(a!)`` arguments, lists
included), after it ran or failed.

Version counters: under any dispatch mode, torch's in-place foreach operators (``_foreach_mul_``,
the whole step of a ``foreach=True`` optimizer) bump no version counter, though they do without
one: their per-tensor work runs below the mode, where the bump is skipped. Unbumped, autograd would
not see a tensor saved for backward being modified in place (a wrong gradient instead of its
error), and a counter could not show what a failed optimizer step wrote. So the mode bumps the
counters of what such an operator wrote, when the operator has not (torch's own bump happens above
the mode for every other in-place operator). Operators that bump none without a mode either
(``_fused_adamw_``, batch norm's running statistics) are left so; ``write_listeners`` hear them.

Frees are counted lazily but in order: a storage's weak-reference callback only queues it (it
runs no Python code, so a ``KeyboardInterrupt`` cannot land in it and be lost), and the queue is
counted before the next storage is and before any reading. The bookkeeping runs under an
:class:`llmmem.diagnostics.interrupts.Guard`, so a signal that arrives meanwhile takes effect right
after, with the counts complete.

A counter counts the thread it is entered on and must be left there; counters nested on one thread
may be left in any order (see :mod:`llmmem.diagnostics.mode_stacks`).

Cost: a Python call per operator (for one that writes in place, also a pass over its written
arguments, once its schema has been read) and, per live storage, about 230 bytes of host memory
(its weak reference, which holds its device and size, its key, and the storage's Python object,
which counting makes: ``benchmarks/bench_tracker_memory.py``), so it is a diagnostic, not something
to leave on in production; it never changes what the operators compute.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import defaultdict, deque
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmmem.diagnostics import fsdp_storage
from llmmem.diagnostics.interrupts import Guard, defer_signals, restore_signals
from llmmem.diagnostics.mode_stacks import enter_mode, exit_mode
from llmmem.dtensors import is_dtensor, local

__all__ = ["LiveBytes", "device_key", "storage_key"]

# (event, storage id, device key, bytes): event is "alloc", "free" or "resize" (bytes is then the change)
Listener = Callable[[str, int, str, int], None]
# (tensor, storage id, device key, bytes): called once per new storage, before the "alloc" listeners
TensorListener = Callable[[torch.Tensor, int, str, int], None]
# (operator, exception): an operator run inside the mode raised; called before the exception propagates
ErrorListener = Callable[[object, BaseException], None]
# (operator, tensors it wrote in place): after the operator returned or raised (it may have written some)
WriteListener = Callable[[object, list], None]


def device_key(device: torch.device) -> str:
    """``"cpu"`` or ``"cuda:0"``: the key of a device in :class:`LiveBytes`' counters."""
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}:{device.index if device.index is not None else torch.cuda.current_device()}"


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types counted; subclasses wrap counted tensors


class _Writes:
    """What an operator writes in place: the positions and names of its ``Tensor(a!)`` arguments,
    whether the mode bumps their version counters (see the module docstring), and whether it may
    grow or swap the storage of its first argument (``resize_``, ``set_``: re-read after it)."""

    __slots__ = ("arguments", "bump", "reread")

    def __init__(self, arguments: tuple, bump: bool, reread: bool = False) -> None:
        self.arguments, self.bump, self.reread = arguments, bump, reread

    def tensors(self, args, kwargs) -> list:
        # kwarg-only arguments (out=) come in kwargs; a positional one left out takes its default
        out = []
        for i, name in self.arguments:
            value = args[i] if i < len(args) else (kwargs.get(name) if kwargs else None)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out.extend(t for t in value if isinstance(t, torch.Tensor))
        return out


class _RunningStatistics(_Writes):
    """Batch norm's kernels write the running mean and variance (arguments 3 and 4) when training
    (argument 5), though their schemas mark no argument written."""

    def tensors(self, args, kwargs) -> list:
        if len(args) > 5 and args[5]:
            return [t for t in args[3:5] if isinstance(t, torch.Tensor)]
        return []


_BATCH_NORMS = frozenset({"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"})
_UNKNOWN = object()
_WRITES: dict = {}  # operator overload -> its _Writes, or None when it writes nothing


def _writes_of(func):
    schema = func._schema
    if schema.name in _BATCH_NORMS:
        return _RunningStatistics((), False)
    if not schema.is_mutable:
        return None
    arguments = tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )
    if not arguments:
        return None
    # Only torch's in-place foreach operators are bumped: without a mode they bump (per tensor), under
    # one they do not. Others that bump none without a mode either (fused optimizers, batch norm's
    # running statistics, which its backward saves) stay as torch leaves them: a bump there would
    # make autograd refuse a backward that works without the mode.
    name = schema.name.split("::")[-1]
    bump = schema.name.startswith("aten::_foreach_") and name.endswith("_")
    if bump:
        try:
            bump = not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "ADInplaceOrView")
        except RuntimeError:
            pass
    return _Writes(arguments, bump, reread=name in ("resize_", "set_"))


def _bump_unbumped(tensors: list, versions: list) -> None:
    """Bumps the version counter of each tensor whose counter still reads as before the operator
    (a nested mode, or a kernel that bumps its own (CUDA's foreach), has bumped the others)."""
    stale = [t for t, v in zip(tensors, versions) if v is not None and t._version == v]
    if stale:
        _increment_version(stale)


def _increment_version(tensors: list) -> None:
    try:
        torch._C._increment_version(tensors)  # a list: torch >= 2.6
    except TypeError:
        for t in tensors:
            torch._C._increment_version(t)


def _versions(tensors: list) -> list:
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference tensor has no version counter (reading it raises)
        return [None if t.is_inference() else t._version for t in tensors]


class _StorageRef(weakref.ref):
    """A weak reference to a counted storage that is also its entry in the counter."""

    __slots__ = ("key", "device", "nbytes")


def storage_key(t: torch.Tensor) -> int:
    """The key :class:`LiveBytes` counts ``t``'s storage under (the storage object's id, stable for
    the storage's life); the storage id its listeners are given."""
    return id(t.untyped_storage())


# the counters entered and not left: FSDP2's storage resizes are told to them
_ACTIVE: weakref.WeakSet = weakref.WeakSet()


def _storage_resized(t: torch.Tensor) -> None:
    for meter in list(_ACTIVE):
        meter._see(t)


class LiveBytes(TorchDispatchMode):
    """Context manager counting the bytes of live tensor storages, per device, and their peak.

    :param existing: ``"gc"`` to count, on entry, every tensor the garbage collector can reach
        (so that ``allocated()`` is the process's live tensor bytes, not only those made inside);
        ``None`` (default) to count only what is made inside or given to :meth:`track`.

    ``allocated(device)`` and ``max_allocated(device)`` mirror ``torch.cuda.memory_allocated`` and
    ``torch.cuda.max_memory_allocated`` (bytes of storages, not of an allocator's rounded blocks).
    """

    def __init__(self, existing: str | None = None) -> None:
        super().__init__()
        if existing not in (None, "gc"):
            raise ValueError(f"existing: expected None or 'gc', got {existing!r}")
        self._existing = existing
        # id(storage) -> its _StorageRef. A storage may be freed on any thread (autograd's), at any
        # point of any code: its callback, deque.append, only queues the reference, and the queue is
        # counted under the guard (which counts it on entry), before anything else is.
        self._entries: dict[int, _StorageRef] = {}
        self._freed: deque = deque()
        self._queue_freed = self._freed.append  # one bound method for every reference (72 bytes each)
        self._flushing = False
        self._lock = Guard(self._flush_freed)
        self._thread: int | None = None  # the thread it is entered on
        self._current: dict[str, int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)
        self.listeners: list[Listener] = []
        self.tensor_listeners: list[TensorListener] = []
        self.error_listeners: list[ErrorListener] = []
        self.write_listeners: list[WriteListener] = []

    # -- counting -------------------------------------------------------------------------------
    def track(self, tensors: Iterable) -> None:
        """Count the storages of ``tensors`` (any nesting of lists, tuples and dicts; modules'
        parameters and buffers; an optimizer's state) if they are not counted yet."""
        fsdp_storage.install(_storage_resized)  # FSDP2 may have been loaded since the counter was entered
        for t in _tensors_of(tensors):
            self._see(t)

    def _see(self, t: torch.Tensor) -> None:
        if type(t) not in _PLAIN:
            # A DTensor (FSDP2, tensor parallelism) made by an operator is seen here, not the local
            # shard its own dispatch made below this mode: count that shard, the bytes this process
            # holds (the DTensor's own storage is a placeholder). Other wrapper subclasses
            # (FakeTensor, ...) are skipped: their inner tensors are counted where they are made.
            if not is_dtensor(t):
                return
            t = local(t)
            if type(t) not in _PLAIN:
                return
        if t.is_meta or t.layout != torch.strided:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # no storage (functional or sparse tensors)
        nbytes = storage.nbytes()
        key = id(storage)
        with self._lock:  # counts the queued frees first: a storage freed since may have had this id
            entry = self._entries.get(key)
            if entry is not None and entry() is storage:
                if entry.nbytes != nbytes:  # grown or shrunk in place
                    delta = nbytes - entry.nbytes
                    self._change(entry.device, delta)
                    entry.nbytes = nbytes
                    self._notify("resize", key, entry.device, delta)
                return
            if nbytes == 0:
                return
            dev = device_key(t.device)
            # The callback holds the queue, not the counter: a storage outliving the counter does
            # not keep it alive.
            ref = _StorageRef(storage, self._queue_freed)
            ref.key, ref.device, ref.nbytes = key, dev, nbytes
            self._entries[key] = ref
            self._change(dev, nbytes)
            for listener in self.tensor_listeners:
                listener(t, key, dev, nbytes)
            self._notify("alloc", key, dev, nbytes)

    def flush(self) -> None:
        """Counts the storages freed since the last call (every reading does; a tool that reads the
        counter's state directly calls it first)."""
        if self._freed:
            with self._lock:
                pass  # the guard counts them on entry

    def _flush_freed(self) -> None:
        # Not again from inside (a listener reading the counter): it reads the count after this free.
        if self._flushing or not self._freed:
            return
        self._flushing = True
        try:
            freed, entries = self._freed, self._entries
            while freed:
                ref = freed.popleft()
                if entries.get(ref.key) is not ref:
                    continue  # not counted any more (the id was reused by a storage counted since)
                del entries[ref.key]
                self._change(ref.device, -ref.nbytes)
                self._notify("free", ref.key, ref.device, ref.nbytes)
        finally:
            self._flushing = False

    def _change(self, dev: str, delta: int) -> None:
        now = self._current[dev] + delta
        self._current[dev] = now
        if now > self._peak[dev]:
            self._peak[dev] = now

    def _notify(self, event: str, key: int, dev: str, nbytes: int) -> None:
        for listener in self.listeners:
            listener(event, key, dev, nbytes)

    # -- reading --------------------------------------------------------------------------------
    def allocated(self, device="cpu") -> int:
        """Bytes of live counted storages on ``device`` now."""
        self.flush()
        return self._current.get(_as_key(device), 0)

    def max_allocated(self, device="cpu") -> int:
        """The most :meth:`allocated` has been since the start or the last :meth:`reset_peak`."""
        self.flush()
        return self._peak.get(_as_key(device), 0)

    def reset_peak(self, device=None) -> None:
        """Start the peak over from what is live now (on ``device``, or on every device)."""
        with self._lock:
            for dev in [_as_key(device)] if device is not None else list(self._current):
                self._peak[dev] = self._current.get(dev, 0)

    def devices(self) -> list[str]:
        self.flush()
        return sorted(set(self._current) | set(self._peak))

    def storage_bytes(self, t: torch.Tensor) -> int | None:
        """The counted bytes of ``t``'s storage, or None if it is not counted."""
        storage = t.untyped_storage()
        # No flush (callers hold their own locks): a queued free of a storage that had this id is
        # a dead reference, which the identity check below rejects.
        entry = self._entries.get(id(storage))
        return entry.nbytes if entry is not None and entry() is storage else None

    # -- the mode -------------------------------------------------------------------------------
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this says False:
        # two more Python frames and an eval-frame switch per operator, the larger part of this
        # mode's cost on small tensors. Eager only: the mode is not meant to run under torch.compile.
        return False

    def __enter__(self):
        if self._thread is not None:
            raise RuntimeError("LiveBytes: already active (a counter cannot be entered twice at once)")
        defer_signals()
        try:
            enter_mode(self)
        except BaseException:
            restore_signals()
            raise
        self._thread = threading.get_ident()
        _ACTIVE.add(self)
        fsdp_storage.install(_storage_resized)
        if self._existing == "gc":
            # type(), not isinstance(): a deprecated module attribute warns when its __class__ is read
            self.track(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
        return self

    def __exit__(self, exc_type=None, exc_value=None, traceback=None):
        """Leaves the counter (it goes on counting frees of what it counted, not new storages).

        Raises ``RuntimeError``, leaving it active, when called on another thread than the one it was
        entered on (its mode is on that thread's stack). Counters nested on one thread may be left
        in any order."""
        if self._thread is None:
            return
        if self._thread != threading.get_ident():
            raise RuntimeError(
                f"LiveBytes: left on thread {threading.get_ident()} but entered on thread {self._thread}; "
                "leave it on the thread that entered it (a with block does)"
            )
        exit_mode(self)
        _ACTIVE.discard(self)
        self._thread = None
        restore_signals()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        writes = _WRITES.get(func, _UNKNOWN)
        if writes is _UNKNOWN:
            writes = _WRITES[func] = _writes_of(func)
        written = None
        # the written arguments are only read when there is something to do with them
        if writes is not None and (writes.bump or self.write_listeners):
            written = writes.tensors(args, kwargs)
            versions = _versions(written) if writes.bump else None
        try:
            out = func(*args, **(kwargs or {}))
        except BaseException as exc:
            if written:  # it may have written some before it failed (a foreach loop)
                self._wrote(func, written, versions)
            for listener in self.error_listeners:
                listener(func, exc)
            raise
        if written:
            self._wrote(func, written, versions)
        kind = type(out)
        if kind in _PLAIN:  # most operators return one tensor or a flat tuple of them: no pytree walk
            self._see(out)
        elif kind is tuple or kind is list:
            for t in out:
                if type(t) in _PLAIN:
                    self._see(t)
                elif t is not None and not isinstance(t, (int, float, bool)):
                    for leaf in tree_leaves(t):
                        if isinstance(leaf, torch.Tensor):
                            self._see(leaf)
        elif out is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._see(t)
        if writes is not None and writes.reread:
            self._see(args[0])
        return out

    def _wrote(self, func, written: list, versions) -> None:
        if versions is not None:
            _bump_unbumped(written, versions)
        for listener in self.write_listeners:
            listener(func, written)


def _as_key(device) -> str:
    if isinstance(device, str) and (device == "cpu" or ":" in device):
        return device
    return device_key(torch.device(device))


def _tensors_of(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        yield from (p.grad for p in obj.parameters() if p.grad is not None)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors_of(state)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple, set)) or hasattr(obj, "__next__"):
        for v in obj:
            yield from _tensors_of(v)
