"""Where did my memory go: :class:`MemoryTracker`, bytes per module x phase x category, over time.

How it works (all on top of :class:`llmmem.diagnostics.live.LiveBytes`, so it is exact on any
device: every tensor storage an operator returns is counted from the moment it appears until it is
freed):

* **category** of a storage, decided when it appears and refined by identity afterwards (the
  timeline is computed from the final categories, so a storage that later turns out to be a
  gradient counts as one from the start): ``parameters`` and ``buffers`` (the modules' own),
  ``gradients`` (``.grad`` of a parameter, seen by a post-accumulate-grad hook, or of an input),
  ``optimizer_state`` (in ``optimizer.state`` after a step), ``inputs`` (tensors given to the
  outermost module), ``activations`` (saved for backward: seen by a ``saved_tensors_hooks`` pack
  hook or reported by a checkpointing mode, and what a checkpointed region recomputes in
  backward), ``temporaries`` (made during a step and not kept for backward), ``other`` (made
  outside a step and never identified);
* **phase**: ``forward`` (from the outermost module's forward until backward starts, so a loss
  computed outside the model counts), ``backward``, ``recompute`` (a module's forward run again
  inside backward: activation checkpointing), ``optimizer`` (inside ``optimizer.step``) or
  ``other``;
* **module**: the innermost module running (global forward hooks; in backward, gradient hooks on
  each module's outputs (it enters) and inputs (it leaves), as ``torch.distributed._tools.mod_tracker``
  does, but also on tensors passed by keyword, and without its reference cycle). Names are
  hierarchical, ``GPT.blocks.0.attn``.

``llmmem.checkpoint`` regions show as what they are: inside a region nothing is saved (its own
hooks replace the tracker's), so the region's tensors are temporaries in the forward and only its
inputs stay; the recompute shows as phase ``recompute`` in backward, attributed to the modules it
re-runs (the "recomputed" column of :meth:`MemoryTracker.table`). Offloaded inputs are counted on
the memory they are kept in (host vs device: every figure is per device). Under
``torch.distributed`` the rank (and the tensor-parallel rank of ``llmmem.parallel.init``) is part of
every output. On CUDA, ``torch.cuda.memory_stats`` (allocated, reserved, reserved-but-free) and the
statistics of the llmmem pool in use are sampled at every phase change.

Cost: the tracker is a diagnostic. Per operator a Python call (the dispatch mode); per new storage
a small record, and a short stack summary (``stacks=True``); per module call two hooks and, in
training, a gradient hook per output and per input. No GPU synchronisation, except that CUDA statistics are read at
phase changes. Memory: about 200 bytes per storage ever made while tracking (``timeline=True``),
or per storage alive (``timeline=False``).

Not seen: memory no tensor storage owns (allocator caches, kernels' scratch buffers: compare the
CUDA samples), tensors made on threads the mode is not active on, tensors saved by other
``saved_tensors_hooks`` of the user (they count as temporaries), double backward through saved
intermediates (the pack hook keeps them detached, as checkpointing does).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import json
import os
import sys
import threading
import time
import weakref
from collections import defaultdict

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from llmmem.checkpointing.observers import observe_kept
from llmmem.diagnostics.live import LiveBytes, device_key, storage_key
from llmmem.errors import OutOfMemoryError
from llmmem.units import format_bytes, parse_bytes

__all__ = ["MemoryTracker", "CATEGORIES", "PHASES", "is_out_of_memory", "step_text"]

# The calling thread's dispatch-mode stack (thread-local; see MemoryTracker._here).
_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_thread_id = threading.get_ident

CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "inputs",
    "activations",
    "temporaries",
    "other",
)
PHASES = ("forward", "backward", "recompute", "optimizer", "other")
# An identity wins over a weaker one: a parameter saved for backward stays a parameter.
_IDENTITY_RANK = {"parameters": 0, "buffers": 1, "gradients": 2, "optimizer_state": 3, "inputs": 4}

# Frames in these folders and files are skipped when summarising where a tensor was made.
_SKIP_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    "<",
)
_SKIP_FILES = frozenset(os.path.abspath(m.__file__) for m in (contextlib, functools, threading))

# The CPU allocator's error text (c10/core/alloc_cpu.cpp) and the text of an installed llmmem pool's
# out-of-memory (llmmem.pool.torch_allocator); torch's own CUDA OOM is a torch.OutOfMemoryError.
_OOM_TEXTS = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory", "out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: torch's ``torch.OutOfMemoryError`` (CUDA and
    other accelerators), llmmem's :class:`llmmem.OutOfMemoryError` (pools, the tracker's budget),
    Python's ``MemoryError``, or a ``RuntimeError`` with the CPU allocator's or an installed llmmem
    pool's message."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(t in text for t in _OOM_TEXTS)
    return False


def step_text(step: int) -> str:
    """A step number as reports print it: ``"step 3"``; the tracker's step -1 (no training step
    had begun: no outermost module's forward had run under the tracker) as ``"outside a tracked step"``."""
    return f"step {step}" if step >= 0 else "outside a tracked step"


# Per thread: the trackers inside their ``with`` block on it, innermost last (see MemoryTracker._pack).
_THREAD = threading.local()


def _entered() -> list:
    stack = getattr(_THREAD, "trackers", None)
    if stack is None:
        stack = _THREAD.trackers = []
    return stack


class _Record:
    """One storage seen by the tracker. ``alloc``/``free`` are event indices (``free`` None while live)."""

    __slots__ = (
        "key",
        "index",
        "device",
        "nbytes",
        "alloc",
        "free",
        "phase",
        "module",
        "step",
        "identity",
        "saved",
        "category",
        "stack",
        "shape",
        "dtype",
    )

    def describe(self) -> dict:
        return {
            "bytes": self.nbytes,
            "device": self.device,
            "category": self.category,
            "shape": list(self.shape),
            "dtype": str(self.dtype).replace("torch.", ""),
            "phase": self.phase,
            "module": self.module,
            "step": self.step,
            "where": ["(made before tracking)"]
            if self.stack is None
            else [f"{os.path.basename(f)}:{line} in {fn}" for f, line, fn in self.stack],
        }


def _category(rec: _Record) -> str:
    if rec.identity is not None:
        return rec.identity
    if rec.saved or rec.phase == "recompute":
        return "activations"
    return "other" if rec.phase == "other" else "temporaries"


def _ancestors(name: str):
    """``"A.b.c"`` -> ``"A"``, ``"A.b"``, ``"A.b.c"``."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


class MemoryTracker:
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
    entered on (and autograd's threads working for it): trackers entered on different threads, each
    around its own model, do not see each other's tensors or modules; trackers nested on one thread
    all see what is made inside the innermost. See the module docstring for what it costs and what
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

        self._records: list[_Record] = []  # every record (timeline) in allocation order
        self._alive: dict[int, _Record] = {}
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
        self._frame_cache: dict = {}
        self.cuda_samples: list[dict] = []
        self._series = None  # (device, events, bytes live after each event): see _total_series
        self.failure: dict | None = None
        self._failure_exc = None
        self.rank: dict | None = None
        self._active = False
        self._outer: list[weakref.ReferenceType] = []  # trackers this one was entered inside, same thread
        self._thread = None  # the id of the thread it was entered on
        self._adopting = False  # counting tensors made before (no "where" for them)
        self._handles: list = []
        self._contexts: list = []
        self.started = self.stopped = None
        self.first_event: int | None = None  # the last event of the first entry's counting of existing tensors
        self.module_inputs: dict[str, tuple] = {}  # module -> (shape, dtype, device) of its first input
        self.input_shapes: list[tuple] = []  # (shape, dtype) of the outermost module's inputs, last step
        self.autocast_dtype = None  # autocast's dtype when the last step's forward began, if enabled

    # =============================================================================================
    # entering and leaving
    # =============================================================================================
    def __enter__(self):
        if self._active:
            raise RuntimeError("MemoryTracker: already active (a tracker cannot be entered twice at once)")
        self.rank = _rank_info()
        self._adopting = True
        try:
            self.live.__enter__()
        finally:
            self._adopting = False
        try:
            self._active = True
            entered = _entered()
            self._outer = [weakref.ref(t) for t in entered]
            entered.append(self)
            self._entered_list = entered  # left from this list, whichever thread exits
            self._thread = _thread_id()
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
            for ctx in (torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack), observe_kept(self._kept)):
                ctx.__enter__()
                self._contexts.append(ctx)
            self.started = self.started or time.perf_counter()
            if self.first_event is None:  # what was counted on entry (the model, ...) is the baseline
                self.first_event = max(0, self.events - 1)
            self._sample_cuda("enter")
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc):
        self._active = False
        entered = getattr(self, "_entered_list", None) or _entered()
        if self in entered:
            entered.remove(self)
        self._entered_list = None
        self._outer = []
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
        self.live.__exit__(*exc)
        self.stopped = time.perf_counter()
        self._sample_cuda("exit")
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
        rec = _Record()
        rec.key, rec.device, rec.nbytes = key, dev, nbytes
        rec.alloc, rec.free = self.events, None
        rec.phase, rec.module = self._phase_module()
        self._mark_phase(rec.phase)
        rec.step = self._step
        rec.identity, rec.saved = None, False
        rec.category = _category(rec)
        rec.stack = None if self._adopting else (self._where() if self.stacks_enabled else ())
        rec.shape, rec.dtype = tuple(t.shape), t.dtype
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

    def _account(self, rec: _Record, delta: int) -> None:
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

    def _relabel(self, rec: _Record, *, identity: str | None = None, saved: bool = False, module: str | None = None):
        if identity is not None and (rec.identity is None or _IDENTITY_RANK[identity] < _IDENTITY_RANK[rec.identity]):
            rec.identity = identity
            if module is not None:
                rec.module = module
        if saved:
            rec.saved = True
        new = _category(rec)
        if new != rec.category:
            if rec.free is None:
                totals = self._totals[rec.device]
                totals[rec.category] -= rec.nbytes
                totals[new] += rec.nbytes
            rec.category = new

    def _label(self, t, identity: str | None = None, *, saved: bool = False, module: str | None = None) -> None:
        """Counts ``t``'s storage if it is not yet, then gives it ``identity`` / marks it saved."""
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta or t.layout != torch.strided:
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

    def _where(self) -> tuple:
        frames = []
        f = sys._getframe(1)
        depth = 0
        cache = self._frame_cache
        while f is not None and depth < 100:
            code = f.f_code
            if not code.co_filename.startswith(_SKIP_DIRS) and code.co_filename not in _SKIP_FILES:
                key = (code, f.f_lineno)
                frame = cache.get(key)
                if frame is None:
                    frame = cache[key] = (code.co_filename, f.f_lineno, code.co_name)
                frames.append(frame)
                if len(frames) == 3:
                    break
            f = f.f_back
            depth += 1
        return tuple(frames)

    def _mark_phase(self, phase: str) -> None:
        last = self._phase_marks[-1]
        if last[1] != phase or last[2] != self._step:
            self._phase_marks.append((self.events, phase, self._step))

    # =============================================================================================
    # failures
    # =============================================================================================
    def _over_budget(self, rec: _Record, nbytes: int) -> None:
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
            self._snapshot_failure(exc, op=str(func), requested=_requested_bytes(str(exc)), phase=phase, module=module)

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
            "cuda": _cuda_stats(self.device),
            "pool": _pool_stats(),
        }

    # =============================================================================================
    # modules, inputs, parameters
    # =============================================================================================
    def _name_of(self, module) -> str:
        name = self._names.get(module)
        if name is None:
            name = type(module).__name__
            self._names[module] = name
        return name

    def _adopt(self, root: torch.nn.Module) -> None:
        """Names ``root``'s modules, counts its parameters/buffers/gradients, hooks its gradients."""
        if root in self._adopted:
            return
        prefix = self._names.get(root) or type(root).__name__
        for sub_name, sub in root.named_modules(remove_duplicate=True):
            self._names.setdefault(sub, f"{prefix}.{sub_name}" if sub_name else prefix)
        if "." not in prefix and not any(r() is root for r in self._roots):
            self._roots.append(weakref.ref(root))
        # The global pre-forward hook sees no keyword arguments (Hugging Face models take
        # input_ids=...): the outermost module gets its own hook for them.
        self._param_handles.append(root.register_forward_pre_hook(self._root_kwargs, with_kwargs=True))
        seen = set()
        for sub in root.modules():
            if sub in self._adopted:
                continue
            self._adopted.add(sub)
            owner = self._name_of(sub)
            for p in sub.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self._param_names.setdefault(id(p), owner)
                self._label(p, "parameters", module=owner)
                if p.grad is not None:
                    self._label(p.grad, "gradients", module=owner)
                if p.requires_grad:
                    self._param_handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
            for b in sub.buffers(recurse=False):
                self._label(b, "buffers", module=owner)

    def _grad_hook(self, p) -> None:
        if self._active and p.grad is not None:
            self._label(p.grad, "gradients", module=self._param_names.get(id(p)))

    def _adopt_optimizer(self, opt) -> None:
        self._seen_optimizers.add(opt)
        for p, state in list(opt.state.items()):
            owner = self._param_names.get(id(p))
            for v in state.values() if isinstance(state, dict) else ():
                self._label(v, "optimizer_state", module=owner)

    def _pre_forward(self, module, args):
        if not self._here():
            return
        with self._lock:
            if torch._C._current_graph_task_id() != -1:
                name = self._name_of(module)
                self._rstack.append((name, self._open(name, "recompute", outermost=not self._rstack)))
                return
            if not self._stack:
                self._enter_root(module, args)
            name = self._name_of(module)
            self._stack.append((name, self._open(name, "forward")))
            if args and isinstance(args[0], torch.Tensor):
                x = args[0]
                self.module_inputs[name] = (tuple(x.shape), x.dtype, x.device)

    def _enter_root(self, module, args) -> None:
        if self._in_bw or self._in_optimizer:  # the last backward or step raised: its end never came
            self._finish_backward()
            self._in_optimizer = 0
        if self._step_done:
            self._step += 1
            self.steps += 1
            self._step_done = False
            self._inputs = []
            self.input_shapes = []
            self._sample_cuda("step")
        kind = torch.device(self.device).type
        self.autocast_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        self._fwd_active = True
        if module not in self._adopted:
            self._adopt(module)
        self._mark_phase("forward")
        self._label_inputs(args)

    def _root_kwargs(self, module, args, kwargs):
        if self._here() and len(self._stack) == 1 and torch._C._current_graph_task_id() == -1:
            with self._lock:
                self._label_inputs(kwargs)

    def _label_inputs(self, obj) -> None:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                self._label(t, "inputs")
                self.input_shapes.append((tuple(t.shape), t.dtype))
                if t.requires_grad and t.is_leaf:
                    self._inputs.append(weakref.ref(t))

    def _post_forward(self, module, args, *rest):
        # (kwargs, output) normally; torch calls a global with_kwargs hook with (output,) only when
        # the forward raised (an out-of-memory error, checkpointing's early stop): pop, hook nothing.
        if not self._here():
            return
        failed = len(rest) != 2
        kwargs, output = ({}, None) if failed else rest
        with self._lock:
            name = self._name_of(module)
            if torch._C._current_graph_task_id() != -1:
                _pop(self._rstack, name, self._close)
                return
            _pop(self._stack, name, self._close)
            if not self._stack:
                if failed:  # the attempt is over: a retry is the next step
                    self._step_done = True
                    self._fwd_active = False
                    self._mark_phase("other")
        if failed or not torch.is_grad_enabled():
            return
        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not outs:
            return
        me = weakref.ref(self)
        push = _BackwardMark(me, name, True)
        for t in outs:
            t.register_hook(push)
        # Leaves are skipped: a hook on a leaf stays on it after the step. Without a non-leaf input,
        # the module leaves backward when backward ends.
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if ins:
            pop = _BackwardMark(me, name, False)
            for t in ins:
                t.register_hook(pop)

    def _open(self, name: str, phase: str, outermost: bool = False) -> int:
        self._intervals.append([name, phase, self._step, self.events, None, outermost])
        return len(self._intervals) - 1

    def _close(self, index: int) -> None:
        self._intervals[index][4] = self.events

    def _bw_mark(self, name: str, push: bool) -> None:
        if not self._active:
            return
        with self._lock:
            if not self._in_bw:
                self._begin_backward()
            entry = self._bw_active.get(name)
            if push:
                if entry is None:
                    self._bw_active[name] = [1, self._open(name, "backward")]
                else:
                    entry[0] += 1
            elif entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    del self._bw_active[name]
                    self._close(entry[1])

    def _begin_backward(self) -> None:
        self._in_bw = True
        self._fwd_active = False
        self._step_done = True
        self._bw_start.setdefault(self._step, self.events)
        self._mark_phase("backward")
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _call(me, "_end_backward"))

    def _finish_backward(self) -> None:
        for _, index in self._bw_active.values():
            self._close(index)
        self._bw_active.clear()
        while self._rstack:
            self._close(self._rstack.pop()[1])
        self._in_bw = False
        self._mark_phase("other")

    def _end_backward(self) -> None:
        with self._lock:
            self._finish_backward()
            inputs = [r() for r in self._inputs]
        for t in inputs:
            if t is not None and t.grad is not None:
                self._label(t.grad, "gradients")
        self._sample_cuda("backward end")

    def _pre_step(self, opt, args, kwargs):
        if not self._here():
            return
        with self._lock:
            if opt not in self._seen_optimizers:
                self._adopt_optimizer(opt)
            self._in_optimizer += 1
            self._fwd_active = False
            self._step_done = True
            self._mark_phase("optimizer")

    def _post_step(self, opt, args, kwargs):
        if not self._here():
            return
        with self._lock:
            self._adopt_optimizer(opt)
            self._in_optimizer = max(0, self._in_optimizer - 1)
            self._mark_phase("other")
        self._sample_cuda("optimizer end")

    def _pack(self, t: torch.Tensor):
        # Only the innermost saved_tensors_hooks run (they are thread-local, and autograd's threads
        # inherit them): this tracker labels the tensor for itself and for the trackers it was
        # entered inside on its thread (an oom_report inside a profiling tracker), never for a
        # tracker of another thread.
        if self._active:
            self._label(t, saved=True)
        for ref in self._outer:
            tracker = ref()
            if tracker is not None and tracker._active:
                tracker._label(t, saved=True)
        # A saved output returned as itself would hold its own grad_fn: a reference cycle through C++
        # that leaks when a forward is abandoned (an out-of-memory error). Detached: same storage and
        # version counter, so backward computes the same thing.
        return t if t.grad_fn is None else t.detach()

    def _kept(self, t: torch.Tensor) -> None:
        if self._active:
            self._label(t, saved=True)

    def _sample_cuda(self, why: str) -> None:
        if not self.device.startswith("cuda") or not torch.cuda.is_initialized():
            return
        stats = _cuda_stats(self.device)
        if stats:
            stats.update(why=why, event=self.events, step=self._step, pool=_pool_stats())
            self.cuda_samples.append(stats)

    # =============================================================================================
    # reading
    # =============================================================================================
    def current(self, device=None) -> dict:
        """Bytes live now on ``device`` (default: the tracker's), by category."""
        totals = self._totals.get(self._dev(device))
        return dict(totals) if totals is not None else dict.fromkeys(CATEGORIES, 0)

    def peak_bytes(self, device=None) -> int:
        """The most bytes live at once on ``device`` since the tracker started."""
        peak = self._peak.get(self._dev(device))
        return peak["bytes"] if peak else 0

    def peak(self, device=None) -> dict:
        """The peak on ``device``: ``bytes``, ``event``, ``phase``, ``module`` (innermost module
        running), ``step`` and ``categories`` (bytes by category at that moment)."""
        dev = self._dev(device)
        peak = dict(self._peak.get(dev) or {"bytes": 0, "event": -1, "phase": "other", "module": "", "step": -1})
        if peak["event"] < 0:
            peak["categories"] = dict.fromkeys(CATEGORIES, 0)
        elif self.timeline_enabled:
            peak["categories"] = self.categories_at(peak["event"], dev)
        return peak

    def roots(self) -> list:
        """The outermost modules seen (the model first when given)."""
        return [m for m in (r() for r in self._roots) if m is not None]

    def batch_and_seq(self):
        """``(batch, seq)`` read off the last step's token ids (the first 2-D integer input of the
        outermost module), or None."""
        for shape, dtype in self.input_shapes:
            if len(shape) == 2 and not dtype.is_floating_point and dtype != torch.bool:
                return shape
        return None

    def devices(self) -> list[str]:
        """Devices on which the tracker saw storages (host memory of offloaded tensors included)."""
        return sorted(set(self._dev_total) | {self.device})

    def _dev(self, device) -> str:
        if device is None:
            return self.device
        return (
            device
            if isinstance(device, str) and (device == "cpu" or ":" in device)
            else device_key(torch.device(device))
        )

    def _require_timeline(self, what: str) -> None:
        if not self.timeline_enabled:
            raise RuntimeError(f"MemoryTracker.{what} needs the event timeline; create the tracker with timeline=True")

    def categories_at(self, event: int, device=None) -> dict:
        """Bytes by category on ``device`` just after event ``event`` (final categories)."""
        self._require_timeline("categories_at")
        dev = self._dev(device)
        totals = dict.fromkeys(CATEGORIES, 0)
        recs = self._records
        for ri, delta in zip(self._ev_rec[: event + 1], self._ev_delta[: event + 1]):
            rec = recs[ri]
            if rec.device == dev:
                totals[rec.category] += delta
        return totals

    def timeline(self, device=None) -> tuple[list, dict]:
        """``(events, {category: bytes})``: the bytes live on ``device`` after each of its events."""
        self._require_timeline("timeline")
        dev = self._dev(device)
        recs = self._records
        totals = dict.fromkeys(CATEGORIES, 0)
        xs: list[int] = []
        ys: dict[str, list] = {c: [] for c in CATEGORIES}
        for i, (ri, delta) in enumerate(zip(self._ev_rec, self._ev_delta)):
            rec = recs[ri]
            if rec.device != dev:
                continue
            totals[rec.category] += delta
            xs.append(i)
            for c in CATEGORIES:
                ys[c].append(totals[c])
        return xs, ys

    def phases(self) -> list[dict]:
        """Phase spans in event order: ``phase``, ``step``, ``start`` and ``end`` events."""
        spans = []
        marks = self._phase_marks + [(self.events, None, None)]
        for (start, phase, step), (end, _, _) in zip(marks, marks[1:]):
            if end > start:
                if spans and spans[-1]["phase"] == phase and spans[-1]["step"] == step and spans[-1]["end"] == start:
                    spans[-1]["end"] = end
                else:
                    spans.append({"phase": phase, "step": step, "start": start, "end": end})
        return spans

    def end_of_forward(self, device=None):
        """Bytes by category when the last step's backward started (None before any backward)."""
        if not self._bw_start:
            return None
        return self.categories_at(self._bw_start[max(self._bw_start)] - 1, device)

    def _largest(self, n: int, device=None) -> list[_Record]:
        recs = [r for r in self._alive.values() if device is None or r.device == device]
        return sorted(recs, key=lambda r: -r.nbytes)[:n]

    def largest_tensors(self, n: int = 10, device=None) -> list[dict]:
        """The ``n`` largest live storages: bytes, shape, dtype, category, phase and module where
        made, step, and where (file:line, innermost user frames first)."""
        return [r.describe() for r in self._largest(n, None if device is None else self._dev(device))]

    def _outlived(self) -> dict:
        """Storages made during an earlier step (forward, backward or recompute, not kept as a
        gradient, optimizer state or input) that are still alive: the "never freed" leak check."""
        old = [
            r
            for r in self._alive.values()
            if r.step < self._step and r.phase in ("forward", "backward", "recompute") and r.identity is None
        ]
        old.sort(key=lambda r: -r.nbytes)
        return {"bytes": sum(r.nbytes for r in old), "count": len(old), "largest": [r.describe() for r in old[:5]]}

    def outlived(self) -> dict:
        """Tensors made in an earlier step that are still alive (see :meth:`largest_tensors` for the
        fields): ``bytes``, ``count``, ``largest``."""
        with self._lock:
            return self._outlived()

    def live_by_module(self, device=None) -> dict:
        """Bytes live now by module where made or owned (self only, not submodules), by category."""
        out: dict[str, dict] = {}
        for r in list(self._alive.values()):
            if device is not None and r.device != device:
                continue
            per = out.setdefault(r.module or "(outside modules)", {})
            per[r.category] = per.get(r.category, 0) + r.nbytes
        return dict(sorted(out.items(), key=lambda kv: -sum(kv[1].values())))

    def modules(self, device=None) -> list[dict]:
        """Per module (hierarchical names, submodules included in each figure):

        ``parameters`` (bytes of its parameters), ``kept_for_backward`` (activations made in its
        forward and alive when backward started; max over steps), ``forward_peak`` /
        ``backward_peak`` / ``recompute_peak`` (the most bytes live on the device while it ran in
        that phase), ``recomputed`` (bytes its forward, run again inside backward by activation
        checkpointing, made and left alive for backward: what checkpointing stopped keeping from
        the forward to the backward; max over its recomputes).
        """
        self._require_timeline("modules")
        dev = self._dev(device)
        names: dict[str, dict] = {}

        def row(name: str) -> dict:
            r = names.get(name)
            if r is None:
                r = names[name] = {
                    "module": name,
                    "parameters": 0,
                    "kept_for_backward": 0,
                    "forward_peak": None,
                    "backward_peak": None,
                    "recompute_peak": None,
                    "recomputed": 0,
                }
            return r

        for ref in self._roots:
            root = ref()
            if root is None:
                continue
            for sub in root.modules():
                name = self._names.get(sub)
                if name is None:
                    continue
                seen, total = set(), 0
                for p in sub.parameters():
                    if p.device.type == "meta" or id(p) in seen:
                        continue
                    seen.add(id(p))
                    total += p.untyped_storage().nbytes()
                row(name)["parameters"] = total
        kept: dict[tuple, int] = defaultdict(int)
        for rec in self._records:
            if rec.device != dev or not rec.module:
                continue
            if rec.category == "activations" and rec.phase == "forward":
                start = self._bw_start.get(rec.step)
                if start is not None and rec.alloc < start and (rec.free is None or rec.free >= start):
                    for a in _ancestors(rec.module):
                        kept[(a, rec.step)] += rec.nbytes
        for (name, _), nbytes in kept.items():
            r = row(name)
            r["kept_for_backward"] = max(r["kept_for_backward"], nbytes)
        totals = self._total_series(dev)
        n = len(totals)
        # The device's peak while each module ran: the events from the one before it entered to the
        # one before it left, all answered in one pass over the series.
        spans = []
        for _, _, _, start, end, _ in self._intervals:
            lo = max(0, start - 1)
            spans.append((lo, min(n, max(self.events if end is None else end, lo + 1))))
        peaks = _span_maxima(totals, spans)
        allocs = [rec.alloc for rec in self._records]  # increasing: records are made in event order
        enclosing: dict[tuple, int] = defaultdict(int)  # (ancestor, step) -> bytes recomputed under it
        for (name, phase, step, start, end, outermost), value in zip(self._intervals, peaks):
            end = self.events if end is None else end
            if phase == "recompute":
                left = 0
                for rec in self._records[bisect.bisect_left(allocs, start) : bisect.bisect_left(allocs, end)]:
                    if rec.device == dev and rec.phase == "recompute" and (rec.free is None or rec.free >= end):
                        left += rec.nbytes
                r = row(name)
                r["recomputed"] = max(r["recomputed"], left)
                if outermost:
                    for a in list(_ancestors(name))[:-1]:
                        enclosing[(a, step)] += left
            r = row(name)
            key = f"{phase}_peak"
            r[key] = value if r[key] is None else max(r[key], value)
        for (name, _), nbytes in enclosing.items():
            r = row(name)
            r["recomputed"] = max(r["recomputed"], nbytes)
        return list(names.values())

    def _total_series(self, dev: str) -> list[int]:
        """Bytes live on ``dev`` after every event (all devices' events, so indices are event numbers).
        Kept until the next event: :meth:`table` reads it for the modules and the phases."""
        cached = self._series
        if cached is not None and cached[0] == dev and cached[1] == self.events:
            return cached[2]
        if set(self._dev_total) <= {dev}:  # every event is on dev
            out = list(itertools.accumulate(self._ev_delta))
        else:
            recs = self._records
            out = list(
                itertools.accumulate(d if recs[ri].device == dev else 0 for ri, d in zip(self._ev_rec, self._ev_delta))
            )
        self._series = (dev, self.events, out)
        return out

    def phase_peaks(self, device=None) -> dict:
        """The most bytes live on ``device`` during each phase."""
        self._require_timeline("phase_peaks")
        dev = self._dev(device)
        totals = self._total_series(dev)
        n = len(totals)
        spans = [span for span in self.phases() if span["start"] < min(n, span["end"])]
        out: dict[str, int] = {}
        for span, value in zip(spans, _span_maxima(totals, [(s["start"], min(n, s["end"])) for s in spans])):
            out[span["phase"]] = max(out.get(span["phase"], 0), value)
        return out

    # =============================================================================================
    # output
    # =============================================================================================
    def table(self, top: int = 10, depth: int | None = None) -> str:
        """A text report: the peak, bytes by category (at the peak, when backward started, now),
        the peak of each phase, CUDA allocator figures, and the ``top`` modules by bytes kept for
        backward (``depth`` limits how deep names go: 1 = the outermost module only)."""
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"MemoryTracker.table: top must be an int >= 0, got {top!r}")
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"MemoryTracker.table: depth must be None or an int >= 1, got {depth!r}")
        with self._lock:
            return self._table(top, depth)

    def _table(self, top: int, depth: int | None) -> str:
        dev = self.device
        peak = self.peak()
        lines = [f"MemoryTracker on {dev}{_rank_text(self.rank)}: {self.steps} step(s), {self.events:,} events"]
        if peak["event"] >= 0:
            where = f"{peak['phase']}" + (f" of {peak['module']}" if peak["module"] else "")
            lines.append(
                f"peak {format_bytes(peak['bytes'])} ({peak['bytes']:,} B) at event {peak['event']:,}: {where}, "
                + step_text(peak["step"])
            )
        if self.budget is not None:
            lines.append(f"budget {format_bytes(self.budget)} ({self.budget:,} B)")
        columns = [("at peak", peak["categories"])]
        if self.timeline_enabled:
            eof = self.end_of_forward()
            if eof is not None:
                columns.append(("backward start", eof))
        columns.append(("now", self.current()))
        lines += ["", f"{'bytes by category':<20}" + "".join(f"{title:>16}" for title, _ in columns)]
        for cat in CATEGORIES:
            if any(col[cat] for _, col in columns):
                lines.append(f"  {cat:<18}" + "".join(f"{format_bytes(col[cat]):>16}" for _, col in columns))
        lines.append(f"  {'total':<18}" + "".join(f"{format_bytes(sum(col.values())):>16}" for _, col in columns))
        for other in self.devices():
            if other != dev:
                cats = self.current(other)
                held = ", ".join(f"{c} {format_bytes(b)}" for c, b in cats.items() if b)
                pk = self.peak_bytes(other)
                lines.append(
                    f"  on {other}: {format_bytes(sum(cats.values()))} now ({held or 'nothing'}), peak {format_bytes(pk)}"
                )
        if self.timeline_enabled:
            pp = self.phase_peaks()
            if pp:
                lines += ["", "peak by phase: " + ", ".join(f"{p} {format_bytes(b)}" for p, b in pp.items())]
        if self.cuda_samples:
            last = self.cuda_samples[-1]
            lines += [
                "",
                f"{dev} allocator: allocated {format_bytes(last['allocated'])} (max {format_bytes(last['max_allocated'])}),"
                f" reserved {format_bytes(last['reserved'])} (max {format_bytes(last['max_reserved'])}),"
                f" reserved but free {format_bytes(last['reserved'] - last['allocated'])}",
            ]
            if last.get("pool"):
                p = last["pool"]
                lines.append(
                    f"llmmem pool: reserved {format_bytes(p.get('reserved_bytes.current', 0))}, free "
                    f"{format_bytes(p.get('free_bytes', 0))}, largest free block {format_bytes(p.get('largest_free_block', 0))}"
                )
        if self.timeline_enabled and top:
            rows = [r for r in self.modules() if depth is None or r["module"].count(".") < depth]
            rows.sort(key=lambda r: (-r["kept_for_backward"], -(r["backward_peak"] or 0), r["module"]))
            rows = rows[:top]
            if rows:
                width = max(30, *(len(r["module"]) for r in rows))
                lines += [
                    "",
                    f"top {len(rows)} modules by bytes kept for backward (submodules included; a peak is the whole "
                    "device's while the module ran)",
                    f"{'module':<{width}} {'params':>11} {'kept for bw':>12} {'fwd peak':>11} {'bwd peak':>11} "
                    f"{'recomputed':>11}",
                ]
                for r in rows:
                    lines.append(
                        f"{r['module']:<{width}} {format_bytes(r['parameters']):>11} "
                        f"{format_bytes(r['kept_for_backward']):>12} {_fmt(r['forward_peak']):>11} "
                        f"{_fmt(r['backward_peak']):>11} {format_bytes(r['recomputed']):>11}"
                    )
        if self.failure is not None:
            f = self.failure
            lines += ["", f"out of memory in {f['phase']} of {f['module'] or '(no module)'}: {f['message']}"]
        return "\n".join(lines)

    def to_dict(self, max_points: int = 2000) -> dict:
        """Every figure, in bytes, JSON-ready; the timeline of the tracker's device is reduced to at
        most ``max_points`` events (each kept point is the highest of its stretch, so the peak stays)."""
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
            raise ValueError(f"MemoryTracker.to_dict: max_points must be an int >= 2, got {max_points!r}")
        with self._lock:
            out = {
                "device": self.device,
                "devices": self.devices(),
                "rank": self.rank,
                "steps": self.steps,
                "events": self.events,
                "budget": self.budget,
                "peak": self.peak(),
                "peaks": {d: self.peak_bytes(d) for d in self.devices()},
                "now": {d: self.current(d) for d in self.devices()},
                "cuda": list(self.cuda_samples),
                "failure": self.failure,
                "largest": self.largest_tensors(10),
                "outlived": self._outlived(),
            }
            if self.timeline_enabled:
                xs, ys = self.timeline()
                keep = _reduce_points(xs, ys, max_points)
                out.update(
                    end_of_forward=self.end_of_forward(),
                    phases=self.phases(),
                    phase_peaks=self.phase_peaks(),
                    modules=self.modules(),
                    timeline={
                        "device": self.device,
                        "event": [xs[i] for i in keep],
                        "categories": {c: [ys[c][i] for i in keep] for c in CATEGORIES},
                    },
                )
        return out

    def to_json(self, path, max_points: int = 2000) -> None:
        """Writes :meth:`to_dict` to ``path`` as JSON."""
        data = self.to_dict(max_points=max_points)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=1, default=str)

    def plot(self, path, *, device=None, title: str | None = None, max_points: int = 4000) -> None:
        """Writes a PNG: the bytes live on ``device`` over the events, stacked by category, with the
        phases marked, the peak annotated (and the budget and CUDA reserved bytes when known).
        Needs matplotlib; uses its Agg canvas (no display, no pyplot state)."""
        from llmmem.diagnostics.plot import plot_tracker

        self._require_timeline("plot")
        with self._lock:
            plot_tracker(self, path, device=self._dev(device), title=title, max_points=max_points)


# =================================================================================================
# helpers
# =================================================================================================
class _BackwardMark:
    """A gradient hook on a module's outputs (it enters backward at the first of their gradients)
    or on its inputs (it leaves at the first of theirs: exact for one input, early for several).

    Holds nothing but a weak reference to the tracker: torch's ``register_multi_grad_hook`` keeps
    the inputs' autograd nodes in the hook stored on those nodes, a reference cycle through C++
    that the garbage collector cannot break, so an abandoned graph (an out-of-memory error in the
    forward) would keep every activation alive."""

    __slots__ = ("tracker", "name", "push", "task")

    def __init__(self, tracker, name: str, push: bool) -> None:
        self.tracker, self.name, self.push, self.task = tracker, name, push, None

    def __call__(self, grad):
        task = torch._C._current_graph_task_id()
        if task == self.task:  # once per backward pass
            return
        self.task = task
        tracker = self.tracker()
        if tracker is not None:
            tracker._bw_mark(self.name, self.push)


def _call(ref, method: str) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)()


def _unpack(x):
    return x


def _pop(stack: list, name: str, close) -> None:
    """Pops ``name`` (and anything above it, left by an exception) from a module stack."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] == name:
            while len(stack) > i:
                close(stack.pop()[1])
            return


_CHUNK = 256  # events per precomputed maximum in _span_maxima


def _span_maxima(values: list, spans: list) -> list:
    """``max(values[lo:hi])`` (0 if empty) for every ``(lo, hi)`` in ``spans``. One pass over
    ``values`` takes the maximum of every chunk of ``_CHUNK`` events; a span then reads at most two
    partial chunks and one maximum per whole chunk: O(len(values) + len(spans) * (_CHUNK +
    span / _CHUNK)), not the sum of the spans' lengths."""
    n, size = len(values), _CHUNK
    chunks = [max(values[j : j + size]) for j in range(0, n, size)]
    out = []
    for lo, hi in spans:
        hi = min(hi, n)
        if hi <= lo:
            out.append(0)
        elif hi - lo <= 2 * size:
            out.append(max(values[lo:hi]))
        else:
            first, last = -(-lo // size), hi // size  # the whole chunks inside (at least one)
            top = max(chunks[first:last])
            if lo < first * size:
                top = max(top, max(values[lo : first * size]))
            if last * size < hi:
                top = max(top, max(values[last * size : hi]))
            out.append(top)
    return out


def _fmt(value) -> str:
    return "-" if value is None else format_bytes(value)


def _reduce_points(xs: list, ys: dict, max_points: int) -> list[int]:
    """Indices of at most ``max_points`` points: the highest total of each equal stretch."""
    n = len(xs)
    if n <= max_points:
        return list(range(n))
    totals = [sum(ys[c][i] for c in CATEGORIES) for i in range(n)]
    keep = []
    per = n / max_points
    for k in range(max_points):
        lo, hi = int(k * per), min(n, int((k + 1) * per))
        if hi > lo:
            keep.append(max(range(lo, hi), key=totals.__getitem__))
    return keep


def _requested_bytes(message: str):
    """The request size in an allocator's message ("Tried to allocate 2.00 GiB", "allocate 4096 bytes")."""
    import re

    m = re.search(r"[Tt]ried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB|bytes)", message)
    if m is None:
        m = re.search(r"allocat\w* ([0-9]+) bytes", message)
        return int(m.group(1)) if m else None
    unit = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * unit)


def _cuda_stats(device: str) -> dict:
    """torch's allocator figures for a CUDA ``device`` (reads counters; no synchronisation)."""
    if not device.startswith("cuda") or not torch.cuda.is_initialized():
        return {}
    try:
        s = torch.cuda.memory_stats(device)
    except RuntimeError:  # an installed pluggable allocator has no statistics
        return {}
    return {
        "allocated": s.get("allocated_bytes.all.current", 0),
        "max_allocated": s.get("allocated_bytes.all.peak", 0),
        "reserved": s.get("reserved_bytes.all.current", 0),
        "max_reserved": s.get("reserved_bytes.all.peak", 0),
        "inactive_split": s.get("inactive_split_bytes.all.current", 0),
        "num_alloc_retries": s.get("num_alloc_retries", 0),
        "num_ooms": s.get("num_ooms", 0),
    }


def _pool_stats():
    """Statistics of the llmmem pool in use on this thread (``use_pool``) or installed, if any."""
    pool_mod = sys.modules.get("llmmem.pool")
    if pool_mod is None:
        return None
    from llmmem.pool.memory_pool import installed_pool

    pool = pool_mod.current_pool() or installed_pool()
    if pool is None:
        return None
    try:
        return pool.stats()
    except Exception:  # a closed pool: nothing to say
        return None


def _rank_info():
    """``{"rank", "world_size"[, "tensor_parallel_rank", "tensor_parallel_size"]}`` or None."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    info = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    parallel = sys.modules.get("llmmem.parallel")
    if parallel is not None:
        group = parallel.get_tensor_parallel_group()
        info["tensor_parallel_rank"] = dist.get_rank(group)
        info["tensor_parallel_size"] = dist.get_world_size(group)
    return info


def _rank_text(rank) -> str:
    if not rank:
        return ""
    text = f", rank {rank['rank']} of {rank['world_size']}"
    if "tensor_parallel_rank" in rank:
        text += f" (tensor-parallel rank {rank['tensor_parallel_rank']} of {rank['tensor_parallel_size']})"
    return text
