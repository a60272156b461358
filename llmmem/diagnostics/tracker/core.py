"""The :class:`MemoryTracker` itself: its state, entering and leaving, and the counting of every
storage (see :mod:`llmmem.diagnostics.tracker` for what it measures and costs)."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import defaultdict

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from llmmem.checkpointing.observers import observe_kept
from llmmem.diagnostics.live import LiveBytes, device_key, storage_key
from llmmem.diagnostics.mode_stacks import pop_saved_tensors_hooks, push_saved_tensors_hooks
from llmmem.diagnostics.tracker.environment import cuda_stats, pool_stats, rank_info
from llmmem.diagnostics.tracker.failures import is_out_of_memory, requested_bytes
from llmmem.diagnostics.tracker.hooks import ModuleHooks, unpack
from llmmem.diagnostics.tracker.queries import TrackerQueries
from llmmem.diagnostics.tracker.records import CATEGORIES, IDENTITY_RANK, Record, category_of
from llmmem.diagnostics.tracker.report import TrackerReport
from llmmem.diagnostics.tracker.stacks import where
from llmmem.dtensors import is_dtensor, local
from llmmem.errors import OutOfMemoryError
from llmmem.units import format_bytes, parse_bytes

__all__ = ["MemoryTracker"]

# The calling thread's dispatch-mode stack (thread-local; see MemoryTracker._here).
_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_thread_id = threading.get_ident
_SHAPES = 1 << 16  # distinct shapes shared at most (variable sequence lengths would grow it without end)

# Per thread: the trackers inside their ``with`` block on it, innermost last (see MemoryTracker._pack).
_THREAD = threading.local()
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass wraps tensors counted apart


def _entered() -> list:
    stack = getattr(_THREAD, "trackers", None)
    if stack is None:
        stack = _THREAD.trackers = []
    return stack


class MemoryTracker(ModuleHooks, TrackerQueries, TrackerReport):
    """Context manager: bytes per module, phase and category, at every allocation and at the peak.

    :param model: the model (optional). Its parameters, buffers and gradients are counted from the
        start and named after it; without it, each outermost module is adopted when it first runs.
    :param optimizer: the optimizer (optional); its state is counted from the start. Without it,
        any optimizer's state is recognised after its ``step``.
    :param device: the device whose peak, budget and timeline are reported (``"cpu"``,
        ``"cuda:0"``); default: the model's parameters' device, else the CPU.
    :param budget: a simulated capacity for ``device`` (bytes or ``"4GB"``): an allocation that
        makes the live bytes exceed it raises :class:`llmmem.OutOfMemoryError`, as a full device
        would (the tensor is freed, the tracker's state stays consistent).
    :param timeline: keep every event (needed for :meth:`plot`, per-module peaks and bytes kept
        for backward); ``False`` keeps only what is alive, for long runs (``llmmem.oom_report``).
    :param stacks: record where (file:line) each storage was made, for the largest-tensor lists.
    :param existing: ``"gc"`` also counts, on entry, every tensor the garbage collector can reach
        (so totals are the process's live tensor bytes); default: what is made inside, plus the
        model's and optimizer's tensors and the inputs.

    Example::

        model = llmmem.models.gpt.GPT(cfg); opt = torch.optim.AdamW(model.parameters())
        with llmmem.MemoryTracker(model, opt) as tracker:
            logits, loss = model(idx, targets=idx)
            loss.backward(); opt.step(); opt.zero_grad()
        print(tracker.table(top=8)); tracker.plot("memory.png")

    Entering and leaving again adds steps to the same record. A tracker counts the thread it is
    entered on (and autograd's threads working for it), and is left on that thread: trackers
    entered on different threads, each around its own model, do not see each other's tensors or
    modules; trackers nested on one thread all see what is made inside the innermost, and may be
    left in any order. A signal (Ctrl-C) that arrives while it updates its counts takes effect right
    after (:mod:`llmmem.diagnostics.interrupts`). See the module docstring for what it costs and what
    it cannot see.
    """

    def __init__(
        self,
        model=None,
        optimizer=None,
        *,
        device=None,
        budget=None,
        timeline: bool = True,
        stacks: bool = True,
        existing: str | None = None,
    ) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"MemoryTracker: model must be a torch.nn.Module or None, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"MemoryTracker: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        for name, value in (("timeline", timeline), ("stacks", stacks)):
            if not isinstance(value, bool):
                raise TypeError(f"MemoryTracker: {name} must be True or False, got {value!r}")
        if existing not in (None, "gc"):
            raise ValueError(f"MemoryTracker: existing must be None or 'gc', got {existing!r}")
        if device is None:
            first = next(iter(model.parameters()), None) if model is not None else None
            device = first.device if first is not None else torch.device("cpu")
        try:
            self.device = device_key(torch.device(device))
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"MemoryTracker: device must be a device such as 'cpu' or 'cuda:0', got {device!r}"
            ) from exc
        self.budget = None
        if budget is not None:
            self.budget = parse_bytes(budget, "MemoryTracker: budget")
            if self.budget == 0:
                raise ValueError("MemoryTracker: budget must be more than 0 bytes")
        self.model = model
        self.optimizer = optimizer
        self.timeline_enabled = timeline
        self.stacks_enabled = stacks

        self.live = LiveBytes(existing=existing)
        self.live.tensor_listeners.append(self._on_new_storage)
        self.live.listeners.append(self._on_event)
        self.live.error_listeners.append(self._on_error)
        self._lock = self.live._lock  # one lock for the counter and the tracker: callbacks nest

        self._records: list[Record] = []  # every record (timeline) in allocation order
        self._alive: dict[int, Record] = {}
        self._ev_rec: list[int] = []  # per event: record index
        self._ev_delta: list[int] = []  # per event: bytes (+ made/grown, - freed/shrunk)
        self.events = 0
        self._totals = defaultdict(lambda: dict.fromkeys(CATEGORIES, 0))  # device -> category -> bytes
        self._dev_total: dict[str, int] = defaultdict(int)
        self._peak: dict[str, dict] = {}  # device -> {"bytes", "event", "phase", "module", "step", ...}
        self._phase_marks: list[tuple] = [(0, "other", -1)]  # (event, phase, step)
        # [module, phase, step, start event, end event, outermost (a recompute not inside another)]
        self._intervals: list[list] = []
        self._stack: list[tuple] = []  # forward: (module name, interval index)
        self._rstack: list[tuple] = []  # recompute (forward inside backward)
        self._bw_active: dict[str, list] = {}  # module -> [count, interval index], in push order
        self._in_optimizer = 0
        self._fwd_active = False
        self._in_bw = False
        self.steps = 0
        self._step = -1
        self._step_done = True  # the current step had a backward or an optimizer step
        self._bw_start: dict[int, int] = {}  # step -> event at which backward started
        self._names = weakref.WeakKeyDictionary()  # module -> hierarchical name
        self._adopted = weakref.WeakSet()
        self._roots: list[weakref.ReferenceType] = []
        self._param_names: dict[int, str] = {}  # id(parameter) -> owning module's name
        self._param_handles: list = []
        self._inputs: list[weakref.ReferenceType] = []
        self._seen_optimizers = weakref.WeakSet()
        self._frame_cache: dict = {}  # see stacks.where
        self._shapes: dict = {}  # shape -> the one tuple of it the records share
        self.cuda_samples: list[dict] = []
        self._series = None  # (device, events, bytes live after each event): see _total_series
        self.failure: dict | None = None
        self._failure_exc = None
        self.rank: dict | None = None
        self._active = False
        self._outer: list[weakref.ReferenceType] = []  # trackers this one was entered inside, same thread
        self._thread = None  # the id of the thread it was entered on, while entered
        self._pack_hook = self._pack  # one object: found by identity on the saved-tensor hooks' stack
        self._hooks_pushed = False
        self._adopting = False  # counting tensors made before (no "where" for them)
        self._handles: list = []
        self._contexts: list = []
        self.started = self.stopped = None
        self.first_event: int | None = None  # the last event of the first entry's counting of existing tensors
        self.module_inputs: dict[str, tuple] = {}  # module -> (shape, dtype, device) of its first input
        self.input_shapes: list[tuple] = []  # (shape, dtype) of the outermost module's inputs, last step
        # (shape, dtype) of those passed by keyword, by keyword: an encoder-decoder's "labels" or
        # "decoder_input_ids" say its decoder length wherever they stand among the inputs
        self.named_inputs: dict[str, tuple] = {}
        self.autocast_dtype = None  # autocast's dtype when the last step's forward began, if enabled

    # =============================================================================================
    # entering and leaving
    # =============================================================================================
    def __enter__(self):
        if self._active:
            raise RuntimeError("MemoryTracker: already active (a tracker cannot be entered twice at once)")
        self.rank = rank_info()
        self._adopting = True
        try:
            self.live.__enter__()
        finally:
            self._adopting = False
        self._thread = _thread_id()
        try:
            self._active = True
            entered = _entered()
            self._outer = [weakref.ref(t) for t in entered]
            entered.append(self)
            if self.model is not None:
                self._adopt(self.model)
            if self.optimizer is not None:
                self._adopt_optimizer(self.optimizer)
            self._handles += [
                register_module_forward_pre_hook(self._pre_forward),
                register_module_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
                register_optimizer_step_pre_hook(self._pre_step),
                register_optimizer_step_post_hook(self._post_step),
            ]
            push_saved_tensors_hooks(self._pack_hook, unpack)
            self._hooks_pushed = True
            kept = observe_kept(self._kept)
            kept.__enter__()
            self._contexts.append(kept)
            self.started = self.started or time.perf_counter()
            if self.first_event is None:  # what was counted on entry (the model, ...) is the baseline
                self.first_event = max(0, self.events - 1)
            self._sample_cuda("enter")
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc):
        """Leaves the tracker: every hook it set is removed, wherever it is on this thread's stacks
        (trackers nested on one thread may be left in any order). Raises ``RuntimeError``, leaving
        it active, when called on another thread than the one that entered it."""
        if self._thread is not None and self._thread != _thread_id():
            raise RuntimeError(
                f"MemoryTracker: left on thread {_thread_id()} but entered on thread {self._thread}; its "
                "counting mode and saved-tensor hooks are on that thread's stacks: leave it there (a with "
                "block does). It is still active."
            )
        self._active = False
        entered = _entered()
        if self in entered:
            entered.remove(self)
        self._outer = []
        lost = None  # its hooks gone from this thread's stack (taken off by other code): the rest is still undone
        if self._hooks_pushed:
            self._hooks_pushed = False
            try:
                pop_saved_tensors_hooks(self._pack_hook)
            except RuntimeError as err:
                lost = err
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        for h in self._handles + self._param_handles:
            h.remove()
        self._handles, self._param_handles = [], []
        self._adopted = weakref.WeakSet()  # hooks were removed: adopt again on re-entry
        with self._lock:
            while self._stack:
                self._close(self._stack.pop()[1])
            if self._in_bw and exc[0] is not None:  # backward raised: its end callback never comes
                self._finish_backward()
            self._in_optimizer = 0
            self._fwd_active = False
        self._thread = None
        try:
            self.live.__exit__(*exc)  # may raise a signal's exception deferred until the books were done
        finally:
            self.stopped = time.perf_counter()
            self._sample_cuda("exit")
        if lost is not None:
            raise RuntimeError(f"MemoryTracker: its saved-tensor hooks were taken off by other code ({lost})")
        return False

    def _here(self) -> bool:
        """Whether a global hook (module forward, optimizer step) that runs now belongs to this
        tracker: it is active and its counting mode is on the calling thread's dispatch-mode stack
        (thread-local; autograd's threads inherit it), so another thread's model is not adopted."""
        if not self._active:
            return False
        if _thread_id() == self._thread:  # the thread it was entered on (its mode is on the stack there)
            return True
        live = self.live
        return any(_dispatch_mode_at(i) is live for i in range(_dispatch_modes()))

    # =============================================================================================
    # counting (LiveBytes callbacks; all run under self._lock)
    # =============================================================================================
    def _phase_module(self) -> tuple[str, str]:
        if self._in_optimizer:
            return "optimizer", ""
        if torch._C._current_graph_task_id() != -1:
            if not self._in_bw:
                self._begin_backward()
            if self._rstack:
                return "recompute", self._rstack[-1][0]
            return "backward", next(reversed(self._bw_active)) if self._bw_active else ""
        module = self._stack[-1][0] if self._stack else ""
        return ("forward" if self._fwd_active else "other"), module

    def _on_new_storage(self, t: torch.Tensor, key: int, dev: str, nbytes: int) -> None:
        rec = Record()
        rec.device, rec.nbytes = dev, nbytes
        # The event index is only read off the timeline: without one, no int object per record.
        rec.alloc, rec.free = (self.events if self.timeline_enabled else 0), None
        rec.phase, rec.module = self._phase_module()
        self._mark_phase(rec.phase)
        rec.step = self._step
        rec.identity, rec.saved = None, False
        rec.category = category_of(rec)
        rec.stack = None if self._adopting else (where(self._frame_cache) if self.stacks_enabled else ())
        shape = tuple(t.shape)
        shapes = self._shapes  # one tuple per distinct shape, not one per record
        rec.shape = shapes.get(shape) or (shapes.setdefault(shape, shape) if len(shapes) < _SHAPES else shape)
        rec.dtype = t.dtype
        self._alive[key] = rec
        if self.timeline_enabled:
            rec.index = len(self._records)
            self._records.append(rec)
        self._account(rec, nbytes)
        if self.budget is not None and dev == self.device and self._dev_total[dev] > self.budget:
            self._over_budget(rec, nbytes)

    def _on_event(self, event: str, key: int, dev: str, nbytes: int) -> None:
        if event == "alloc":
            return  # accounted in _on_new_storage, which has the tensor
        rec = self._alive.get(key)
        if rec is None:
            return
        if event == "free":
            del self._alive[key]
            self._account(rec, -rec.nbytes)
            rec.free = self.events - 1
        else:  # resize: nbytes is the change
            rec.nbytes += nbytes
            self._account(rec, nbytes)
            if nbytes > 0 and self.budget is not None and dev == self.device and self._dev_total[dev] > self.budget:
                self._over_budget(rec, nbytes)

    def _account(self, rec: Record, delta: int) -> None:
        dev = rec.device
        self._totals[dev][rec.category] += delta
        now = self._dev_total[dev] + delta
        self._dev_total[dev] = now
        if self.timeline_enabled:
            self._ev_rec.append(rec.index)
            self._ev_delta.append(delta)
        self.events += 1
        if delta > 0:
            peak = self._peak.get(dev)
            if peak is None or now > peak["bytes"]:
                self._peak[dev] = {
                    "bytes": now,
                    "event": self.events - 1,
                    "phase": rec.phase,
                    "module": rec.module,
                    "step": rec.step,
                    "categories": None if self.timeline_enabled else dict(self._totals[dev]),
                }

    def _relabel(self, rec: Record, *, identity: str | None = None, saved: bool = False, module: str | None = None):
        if identity is not None and (rec.identity is None or IDENTITY_RANK[identity] < IDENTITY_RANK[rec.identity]):
            rec.identity = identity
            if module is not None:
                rec.module = module
        if saved:
            rec.saved = True
        new = category_of(rec)
        if new != rec.category:
            if rec.free is None:
                totals = self._totals[rec.device]
                totals[rec.category] -= rec.nbytes
                totals[new] += rec.nbytes
            rec.category = new

    def _label(self, t, identity: str | None = None, *, saved: bool = False, module: str | None = None) -> None:
        """Counts ``t``'s storage if it is not yet, then gives it ``identity`` / marks it saved. A
        DTensor (FSDP2's sharded parameters, gradients and optimizer state; tensor parallelism's)
        is its local shard: what this rank holds."""
        if type(t) not in _PLAIN and is_dtensor(t):
            t = local(t)
        if type(t) not in _PLAIN or t.is_meta or t.layout != torch.strided:
            return
        try:
            key = storage_key(t)
        except (RuntimeError, NotImplementedError):
            return  # no storage
        with self._lock:
            rec = self._alive.get(key)
            if rec is None:
                self._adopting = True
                try:
                    self.live._see(t)
                finally:
                    self._adopting = False
                rec = self._alive.get(key)
            if rec is not None:
                self._relabel(rec, identity=identity, saved=saved, module=module)

    def _mark_phase(self, phase: str) -> None:
        last = self._phase_marks[-1]
        if last[1] != phase or last[2] != self._step:
            self._phase_marks.append((self.events, phase, self._step))

    # =============================================================================================
    # failures
    # =============================================================================================
    def _over_budget(self, rec: Record, nbytes: int) -> None:
        live = self._dev_total[rec.device]
        msg = (
            f"MemoryTracker budget exceeded on {rec.device}: allocating {format_bytes(nbytes)} "
            f"({list(rec.shape)} {str(rec.dtype).replace('torch.', '')}) in {rec.phase}"
            f"{' of ' + rec.module if rec.module else ''} brings live tensors to {format_bytes(live)} "
            f"({live:,} bytes) > budget {format_bytes(self.budget)} ({self.budget:,} bytes)"
        )
        exc = OutOfMemoryError(msg)
        self._snapshot_failure(exc, op=None, requested=nbytes, phase=rec.phase, module=rec.module)
        raise exc

    def _on_error(self, func, exc: BaseException) -> None:
        if not is_out_of_memory(exc) or self._failure_exc == id(exc):
            return
        with self._lock:
            phase, module = self._phase_module()
            self._snapshot_failure(exc, op=str(func), requested=requested_bytes(str(exc)), phase=phase, module=module)

    def _snapshot_failure(self, exc, *, op, requested, phase, module) -> None:
        """What was live when an allocation failed, taken before the stack unwinds and frees it."""
        self._failure_exc = id(exc)  # not the exception: its traceback holds the failed step's tensors
        self.failure = {
            "message": str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
            "type": type(exc).__name__,
            "op": op,
            "device": self.device,
            "phase": phase,
            "module": module,
            "step": self._step,
            "event": self.events,
            "requested": requested,
            "live": {dev: dict(cats) for dev, cats in self._totals.items()},
            "live_total": dict(self._dev_total),
            "by_module": self.live_by_module(),
            "largest": [r.describe() for r in self._largest(10)],
            "outlived": self._outlived(),
            "cuda": cuda_stats(self.device),
            "pool": pool_stats(),
        }

    def _sample_cuda(self, why: str) -> None:
        if not self.device.startswith("cuda") or not torch.cuda.is_initialized():
            return
        stats = cuda_stats(self.device)
        if stats:
            stats.update(why=why, event=self.events, step=self._step, pool=pool_stats())
            self.cuda_samples.append(stats)
