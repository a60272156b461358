"""Measuring blocks for the recompute planner.

Per block and per mode: the bytes kept for backward and the transient peaks of its forward and of
its backward (exact: :class:`ActivationMeter`, tensor storages counted by
:class:`llmmem.diagnostics.live.LiveBytes`, on the CPU as on CUDA; on CUDA the allocator's
statistics too, whichever is larger), and its cost in work units (:class:`WorkCounter`: FLOPs of the
matrix products plus a fixed price per byte moved and per operator). The planner compares plans in
work units, which are counted, not timed, so the same model and budget give the same plan on every
run; one measured factor, the blocks' store-all forward seconds per work unit (``time_unit``, from
the median of timed repeats), turns a plan's extra work into seconds for the predictions. On the CPU
the Python a mode adds beyond its work is timed apart: a checkpoint's bookkeeping on a null block
(:mod:`llmmem.checkpointing.bookkeeping`), the recompute-cheap hooks while the block is timed.

Modes of a block: ``"store-all"`` (autograd keeps its tape), ``"selective"`` (keeps matmul and
attention outputs, recomputes the rest: :mod:`llmmem.checkpointing.selective`), ``"recompute-cheap"``
(keeps the tape but rebuilds in backward the tensors one elementwise operator or a LayerNorm makes
from kept ones: :mod:`llmmem.checkpointing.remat`), and ``"store-input-only"`` (a checkpoint of the
block alone; a column of its own only when regions cannot span blocks, see :class:`ChainProfile`).

Blocks are called as the model calls them: a :class:`BlockCall` holds a block's positional and
keyword arguments and says which one is the chain's activation (the output of the block before).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.utils.flop_counter as flop_counter
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from llmmem.checkpointing import remat, selective
from llmmem.checkpointing.bookkeeping import checkpoint_bookkeeping_seconds
from llmmem.checkpointing.core import checkpoint
from llmmem.checkpointing.observers import observe_kept
from llmmem.diagnostics.live import LiveBytes, device_key
from llmmem.dtensors import local

__all__ = [
    "kept_state",
    "is_step",
    "profile_blocks",
    "profile_calls",
    "measure_saved_bytes",
    "ActivationMeter",
    "WorkCounter",
    "BlockCall",
    "ChainProfile",
    "MODES",
    "INPUT_ONLY",
    "run_mode",
    "run_call",
    "as_block_list",
    "check_distinct",
    "median_time",
    "hidden_of",
    "without_cache",
]

MODES = ("store-all", "selective", "recompute-cheap")
INPUT_ONLY = "store-input-only"
_NESTABLE = {"store-all": 1, "selective": 0, "recompute-cheap": 0, INPUT_ONLY: 0}

# FLOP-equivalents per byte moved and per operator, by device type: only their ratios choose plans
# (round figures: a few-core CPU ~50 GFLOP/s, ~50 GB/s, ~4 us/op; a GPU ~100 TFLOP/s, ~3 TB/s, ~5 us).
WORK_MODEL = {"cpu": (1.0, 2e5), "cuda": (30.0, 5e8)}
# Modes that run a Python dispatch mode pay this per operator too (~20 us): dear on small models,
# nothing next to a large model's matmuls.
_PYTHON_PER_OP = {"selective"}
PYTHON_OP_WORK = {"cpu": 1e6, "cuda": 2e9}
# Saved bytes of a mode the head pseudo-block cannot use (plan.py): more than any budget.
UNUSABLE_BYTES = 1 << 50


# --------------------------------------------------------------------------------------------
# What a block keeps for backward


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
        self.excluded = {_storage_key(t) for t in exclude}
        self.storages: dict = {}
        self.packed = 0  # tensors saved, each time (the region bookkeeping is paid per saved tensor)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _record(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        key = _storage_key(t)
        if key not in self.excluded:
            self.storages[key] = _storage_bytes(t)

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


def _storage_key(t: torch.Tensor):
    t = local(t)
    return (t.device, t.untyped_storage().data_ptr())


def _storage_bytes(t: torch.Tensor) -> int:
    return local(t).untyped_storage().nbytes()


def _module_tensors(block) -> list:
    if isinstance(block, nn.Module):
        return list(block.parameters()) + list(block.buffers())
    return []


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


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
                if "backward" not in self.marks and _in_backward():
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


# --------------------------------------------------------------------------------------------
# Work units


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.layout == torch.strided else 0


_aten = torch.ops.aten
_SDPA_CPU = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SDPA_CPU_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _as_many_heads(q, k, v):
    """Grouped-query attention (fewer key/value heads than query heads, ``enable_gqa``) does the work
    of attention with the key/value heads repeated: torch's FLOP formulas want equal head counts."""
    if len(q) == 4 and len(k) == 4 and k[1] != q[1]:
        k = (k[0], q[1], k[2], k[3])
        v = (v[0], q[1], v[2], v[3])
    return q, k, v


class WorkCounter(TorchDispatchMode):
    """Counts the work of what runs inside, in FLOP-equivalents, forward and backward apart: matrix
    products and attention kernels by their FLOPs (torch's ``flop_counter`` formulas), every other
    operator by the bytes it reads and writes, plus a fixed price per operator (:data:`WORK_MODEL`).
    Deterministic: the same operators give the same count. A dispatch mode; an
    :class:`ActivationMeter` can also count into one (``work=``) in the same pass.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.per_byte, self.per_op = WORK_MODEL.get(device_type, WORK_MODEL["cuda"])
        self.forward = 0.0
        self.backward = 0.0
        self.forward_ops = 0
        self.backward_ops = 0

    def _flops(self, func, args, kwargs, out) -> float | None:
        packet = func.overloadpacket
        if packet in flop_counter.flop_registry:
            try:
                return float(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out))
            except AssertionError:
                # torch's attention formulas want as many key/value heads as query heads (CUDA
                # kernels with enable_gqa): count the attention with the heads repeated; an
                # operator no formula fits is counted by its bytes (still deterministic)
                grad_first = int("backward" in packet.__name__)
                try:
                    q, k, v = _as_many_heads(*(t.shape for t in args[grad_first : grad_first + 3]))
                    forward = float(flop_counter.sdpa_flop_count(q, k, v))
                except (AssertionError, AttributeError, TypeError, ValueError):
                    return None
                return 2.5 * forward if grad_first else forward
        if _SDPA_CPU is not None and packet is _SDPA_CPU:
            q, k, v = _as_many_heads(args[0].shape, args[1].shape, args[2].shape)
            return float(flop_counter.sdpa_flop_count(q, k, v))
        if _SDPA_CPU_BACKWARD is not None and packet is _SDPA_CPU_BACKWARD:
            q, k, v = _as_many_heads(args[1].shape, args[2].shape, args[3].shape)
            return float(flop_counter.sdpa_backward_flop_count(args[0].shape, q, k, v))
        return None

    def count(self, func, args, kwargs, out) -> None:
        work = self._flops(func, args, kwargs, out)
        if work is None:
            work = 0.0 if func.is_view else self.per_byte * sum(map(_nbytes, pytree.tree_leaves((args, kwargs, out))))
        work += self.per_op
        if _in_backward():
            self.backward += work
            self.backward_ops += 1
        else:
            self.forward += work
            self.forward_ops += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out


# --------------------------------------------------------------------------------------------
# Block calls


def hidden_of(out) -> torch.Tensor:
    """The chain activation in a block's output: the output itself, or the first element of a
    tuple or list (Hugging Face layers return either), or the first tensor of a mapping."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, Mapping):
        for v in out.values():
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(
        f"a block returned {type(out).__name__}: expected a tensor, or a tuple or list whose first element is "
        "the tensor the next block takes"
    )


_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(obj) -> bool:
    """A Hugging Face key/value cache (any ``transformers`` class named ``Cache`` or derived from it)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(obj).__mro__)


def without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
    """``(args, kwargs, what changed)`` with the key/value cache taken out, as Hugging Face's
    ``GradientCheckpointingLayer`` does for a checkpointed layer: a recompute runs the layer again and
    must not write the cache a second time. ``use_cache`` becomes ``False``; ``cache`` /
    ``past_key_values`` / ``past_key_value`` / ``layer_past`` keywords and positional cache objects
    become ``None``."""
    changed = []
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
        changed.append("use_cache=False")
    for name in _CACHE_KEYWORDS:
        if kwargs.get(name) is not None:
            kwargs = {**kwargs, name: None}
            changed.append(f"{name}=None")
    if any(_is_cache(a) for a in args):
        args = tuple(None if _is_cache(a) else a for a in args)
        changed.append("positional cache=None")
    return args, kwargs, changed


@dataclass
class BlockCall:
    """How a block is called: its positional and keyword arguments, and where among them the chain
    activation is (``hidden``: an index into ``args`` or a keyword)."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    hidden: int | str = 0
    # whether the step differentiates the chain activation: not the first block's input when what
    # comes before the chain is frozen (a LoRA model's embeddings), so no gradient of it is made
    input_grad: bool = True

    @property
    def hidden_tensor(self) -> torch.Tensor:
        return self.args[self.hidden] if isinstance(self.hidden, int) else self.kwargs[self.hidden]

    def with_hidden(self, h) -> tuple[tuple, dict]:
        if isinstance(self.hidden, int):
            args = list(self.args)
            args[self.hidden] = h
            return tuple(args), dict(self.kwargs)
        return tuple(self.args), {**self.kwargs, self.hidden: h}

    def other_tensors(self) -> list:
        """The tensors of the call besides the chain activation (masks, position embeddings, ...)."""
        args, kwargs = self.with_hidden(None)
        return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def signature(self) -> tuple:
        """What the cost of a call depends on, besides the block: shapes, dtypes, devices and
        whether each tensor needs a gradient; the other arguments by value when simple."""

        def describe(v):
            if isinstance(v, torch.Tensor):
                return ("tensor", tuple(v.shape), v.dtype, v.device, v.requires_grad)
            if v is None or isinstance(v, (bool, int, float, str)):
                return v
            return type(v).__name__

        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        return (self.hidden, self.input_grad, str(spec), tuple(describe(v) for v in leaves))

    def fresh_input(self) -> torch.Tensor:
        """A new leaf with the chain activation's value, needing a gradient as the step's does."""
        h = self.hidden_tensor
        return h.detach().clone().requires_grad_(self.input_grad and h.is_floating_point())


def _rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1] if t.dim() and t.shape[-1] else 0


def find_hidden(args: tuple, kwargs: dict, previous=None) -> tuple[int | str | None, bool]:
    """``(where, linked)``: the argument that is ``previous`` (the last block's output) if any
    (``linked``), else the first floating-point tensor among the positional then keyword arguments."""
    if previous is not None:
        for i, a in enumerate(args):
            if a is previous:
                return i, True
        for k, v in kwargs.items():
            if v is previous:
                return k, True
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return i, False
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k, False
    return None, False


# --------------------------------------------------------------------------------------------
# Profiling


@dataclass
class ChainProfile:
    """Measured costs of a chain of blocks, in bytes and in time units; ``modes`` names the columns.

    Times are in units of ``time_unit`` seconds (:func:`profile_blocks` counts work, so plans are
    the same on every run; a profile made by hand may use seconds with the default ``time_unit=1``;
    NaN when the blocks were counted but not timed, ``repeats=0``).
    ``head`` is what runs between the chain's forward and its backward, a model's head and loss
    (``{"saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes"}``: kept at its end, transient peaks of its
    forward and its backward), planned as a last block that always keeps its tape; ``static_bytes``
    are held outside the chain through all of it (what ran before it keeps, the other arguments of
    the blocks such as masks); ``outside_peak_bytes`` is the step's peak before the chain's forward
    and after its backward. ``chainable`` is false when a block's input is not the previous block's
    output as it is (the model changes it in between): regions then hold one block each (the
    ``"store-input-only"`` mode) instead of spanning blocks.
    """

    modes: tuple
    fwd_time: list  # [L][K] forward keeping the tape in mode k
    fwd_nostore_time: list  # [L] forward inside a checkpointed region (the mean of it and its recompute)
    bwd_time: list  # [L][K]
    input_bytes: list  # [L + 1]
    saved_bytes: list  # [L][K] beyond the block input
    fwd_tmp_bytes: list  # [L] beyond input, output and tape: the most of any mode keeping a tape
    bwd_tmp_bytes: list  # [L][K] beyond tape, incoming and outgoing gradients
    device: str = "cpu"
    # [L] the forward inside a checkpointed region, beyond input and output: it frees intermediates
    # as it goes, yet holds more at once than a tape's forward beyond its tape. Empty: unknown,
    # fwd_tmp_bytes counts for both forwards.
    fwd_nostore_tmp_bytes: list = field(default_factory=list)
    # [L][K] the forward keeping its tape in mode k, beyond input, output and tape (a mode that keeps
    # less can hold more at once on the way: selective's forward). Empty: unknown, fwd_tmp_bytes
    # counts for every mode.
    fwd_tape_tmp_bytes: list = field(default_factory=list)
    # [L][K] 1 where the block's tape in that mode keeps its own output (selective keeps a final
    # matmul's output, tanh keeps its result): offloading the next block's input would then free
    # nothing on the device. Empty: unknown, treated as all 0.
    output_kept: list = field(default_factory=list)
    time_unit: float = 1.0
    head: dict | None = None
    static_bytes: int = 0
    outside_peak_bytes: int = 0
    measured_peak_bytes: int = 0  # the step's activation peak without checkpointing (0: not measured)
    measured_step_time: float = 0.0  # seconds of one store-all step of the chain (0: not measured)
    outside_work: float = 0.0  # work units of a step outside the chain (0: unknown; a bare chain)
    outside_time: float = 0.0  # seconds of it, at the blocks' timed rates (0: not timed or unknown)
    hidden: list = field(default_factory=list)  # [L] where each block's chain input is in its call
    chainable: bool = True
    # made by profile_model on a batch, whose step frees the model's output before the backward (a
    # loop that keeps it is warned: llmmem.checkpointing.outputs)
    step_frees_output: bool = False
    # the time fields measured in seconds ({"fwd_time", "bwd_time", "fwd_nostore_time"}), for the
    # predictions of a plan chosen on work (None: not timed), and "bookkeeping": per block, the
    # seconds of Python a mode adds beyond its work ({"checkpoint": s, "recompute-cheap": (pack,
    # unpack, operators inside the unpacks)}; {} off the CPU)
    seconds: dict | None = None
    # rows of the last block's chain input (its elements over its last dimension: the tokens a
    # model's LM head reads); 0: unknown (a profile made by hand)
    hidden_rows: int = 0
    # [L] 1 where block i's input is not block i - 1's output (a second stack of blocks starts
    # there: a decoder after an encoder): regions end before it. Empty: none.
    cuts: list = field(default_factory=list)

    def to_chain(self, host_bandwidth: float = 0.0, seconds: bool = False) -> dict:
        """The dict the C planner takes (llmmem._C.plan_solve); ``host_bandwidth`` in bytes per
        time unit, 0 for no offloading. ``seconds``: the measured times instead of the work. With a
        ``head`` the chain has one more block (its modes other than store-all are made unusable)."""
        times = self.seconds if seconds else self.__dict__
        chain = {
            "fwd_time": [list(r) for r in times["fwd_time"]],
            "fwd_nostore_time": list(times["fwd_nostore_time"]),
            "bwd_time": [list(r) for r in times["bwd_time"]],
            "input_bytes": list(self.input_bytes),
            "saved_bytes": [list(r) for r in self.saved_bytes],
            "fwd_tmp_bytes": list(self.fwd_tmp_bytes),
            "fwd_nostore_tmp_bytes": list(self.fwd_nostore_tmp_bytes) if self.fwd_nostore_tmp_bytes else None,
            "fwd_tape_tmp_bytes": [list(r) for r in self.fwd_tape_tmp_bytes] if self.fwd_tape_tmp_bytes else None,
            "bwd_tmp_bytes": [list(r) for r in self.bwd_tmp_bytes],
            "mode_nestable": [_NESTABLE[m] if self.chainable else 0 for m in self.modes],
            "output_kept": [list(r) for r in self.output_kept] if self.output_kept else None,
            "host_bandwidth": float(host_bandwidth),
        }
        if any(self.cuts):
            chain["cut_before"] = [int(c) for c in self.cuts]
        if self.head is not None:
            K = len(self.modes)
            chain["fwd_time"].append([0.0] * K)
            chain["fwd_nostore_time"].append(0.0)
            chain["bwd_time"].append([0.0] * K)
            chain["input_bytes"].append(0)
            chain["saved_bytes"].append([int(self.head["saved_bytes"])] + [UNUSABLE_BYTES] * (K - 1))
            chain["fwd_tmp_bytes"].append(int(self.head["fwd_tmp_bytes"]))
            if chain["fwd_nostore_tmp_bytes"] is not None:
                # the planner never puts the head in a region; a plan given by hand that does gets
                # the one transient measured for it
                chain["fwd_nostore_tmp_bytes"].append(int(self.head["fwd_tmp_bytes"]))
            if chain["fwd_tape_tmp_bytes"] is not None:
                chain["fwd_tape_tmp_bytes"].append([int(self.head["fwd_tmp_bytes"])] * K)
            chain["bwd_tmp_bytes"].append([int(self.head["bwd_tmp_bytes"])] * K)
            if chain["output_kept"] is not None:
                chain["output_kept"].append([0] * K)
            if "cut_before" in chain:
                chain["cut_before"].append(0)
        return chain

    @property
    def n_blocks(self) -> int:
        return len(self.fwd_time)

    @property
    def stack_starts(self) -> list:
        """The first block of each stack: 0 and every cut."""
        return [0] + [i for i, c in enumerate(self.cuts) if c and i > 0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _tensor_bytes(x) -> int:
    seen = {}
    for t in pytree.tree_leaves(x):
        if isinstance(t, torch.Tensor):
            seen[_storage_key(t)] = _storage_bytes(t)
    return sum(seen.values())


def run_call(fn: Callable, args: tuple, kwargs: dict, mode: str, block=None, **checkpoint_options):
    """``fn(*args, **kwargs)`` in one mode (profiling, and the top-level blocks of a plan); the
    options go to :func:`llmmem.checkpoint` in the modes that use it. ``block``: the module whose
    LayerNorms the recompute-cheap mode may rebuild."""
    # non-reentrant regions, said explicitly (llmmem.checkpoint warns when use_reentrant is omitted);
    # the kept outputs of the selective mode stay on the device, where the plan counts them
    checkpoint_options = {"use_reentrant": False, **checkpoint_options}
    if mode == "store-all":
        return fn(*args, **kwargs)
    if mode == "selective":
        options = {"respect_saved_tensors_hooks": False, **checkpoint_options}
        return checkpoint(context_fn=selective.selective_context_fn, **options)(fn)(*args, **kwargs)
    if mode == "recompute-cheap":
        with remat.recompute_cheap(block):
            return fn(*args, **kwargs)
    if mode in ("nostore", INPUT_ONLY):
        return checkpoint(**checkpoint_options)(fn)(*args, **kwargs)
    raise ValueError(f"unknown mode {mode!r}")


def run_mode(block, x, mode: str, **checkpoint_options):
    """``block(x)`` in one mode (see :func:`run_call`)."""
    return run_call(block, (x,), {}, mode, block if isinstance(block, nn.Module) else None, **checkpoint_options)


def _grad_tensor(out) -> torch.Tensor:
    t = hidden_of(out)
    if not t.requires_grad:
        raise ValueError(
            "profile: a block returned no tensor that requires grad: nothing in it is differentiated (its "
            "parameters are frozen and its input needs no gradient, or it detaches its output), so checkpointing "
            "it saves nothing"
        )
    return t


@dataclass
class _BlockCosts:
    work: dict  # the planner's costs in work units (_planner_costs)
    seconds: dict | None  # the same from timed steps (None: not timed)
    saved: list  # [K] bytes
    ftmp: list  # [K] the forward keeping a tape in each mode
    nostore_ftmp: int  # the forward inside a checkpointed region
    btmp: list  # [K]
    kept_out: list  # [K] bytes of the output kept by the tape
    input_only_btmp: int
    # seconds a mode adds beyond its work: {"checkpoint": s, "recompute-cheap": (pack, unpack, operators
    # inside the unpacks)}; {}: not timed, or not on the CPU
    bookkeeping: dict


def _planner_costs(fwd: dict, bwd: dict, modes) -> dict:
    """The planner's time costs of a block from each mode's forward and backward (and "nostore",
    the block checkpointed alone), in any unit."""
    store = modes[0]
    # The planner charges fwd_nostore_time twice per region (its forward and its recompute, which
    # costs more: a graph again, the slots filled); their mean makes a one-level region exact.
    recompute = max(bwd["nostore"] - bwd[store], fwd["nostore"])
    return {
        "fwd": [fwd[m] for m in modes],
        # other modes run store-all's operators plus extra work: never cheaper (a lower figure is noise)
        "bwd": [max(bwd[m], fwd[store] + bwd[store] - fwd[m]) for m in modes],
        "nostore": 0.5 * (fwd["nostore"] + recompute),
        "input_only": (fwd["nostore"], fwd[store] + bwd[store] - fwd["nostore"] + recompute),
    }


def _memory_and_work(run, block, call: BlockCall, mode: str, device: torch.device, exclude: list) -> dict:
    """One forward + backward of the block in ``mode`` under the meters: bytes kept, transients,
    work units. The block input is a fresh leaf made outside the meters (the planner counts it)."""
    params = _module_tensors(block)
    x = call.fresh_input()
    args, kwargs = call.with_hidden(x)
    key = device_key(device)
    work = WorkCounter(device.type)
    with ActivationMeter(params, device=key, work=work) as meter:
        with measure_saved_bytes(exclude=params + exclude) as saved:
            out = run_call(run, args, kwargs, mode, block)
        y = _grad_tensor(out)
        fwd_end, fwd_peak = meter.current, meter.window_peak
        out_bytes = meter.counted_bytes(y)
        saved.storages.pop(_storage_key(x), None)
        kept_out = saved.storages.pop(_storage_key(y), 0)
        grad = torch.ones_like(y)
        meter.exclude(grad)  # the incoming gradient: the planner counts it
        meter.reset_window()
        bwd_start = meter.current
        torch.autograd.backward(y, grad)
        grad_in = _tensor_bytes(x.grad) if x.grad is not None else 0
        bwd_peak = meter.window_peak
    del out, y, grad
    if isinstance(block, nn.Module):
        block.zero_grad(set_to_none=True)
    python_op = PYTHON_OP_WORK.get(device.type, PYTHON_OP_WORK["cuda"]) if mode in _PYTHON_PER_OP else 0.0
    backward_work = work.backward + work.backward_ops * python_op
    forward_work = work.forward + work.forward_ops * python_op
    return {
        # held after the forward beyond the output: everything the forward made that is still alive
        "saved": max(0, fwd_end - out_bytes),
        "kept_out": kept_out,
        "ftmp": max(0, fwd_peak - fwd_end),
        "btmp": max(0, bwd_peak - bwd_start - grad_in),
        "fwd": forward_work,
        "bwd": backward_work,
        "packed": saved.packed,
    }


def _allocator_transients(run, block, call: BlockCall, mode: str, device: torch.device) -> tuple[int, int]:
    """CUDA: (forward, backward) transient peaks from the allocator's statistics, which also see
    memory no tensor owns (library workspaces) and the allocator's rounding. Parameter gradients
    exist before, so the backward's peak holds only what it adds."""
    params = [p for p in _module_tensors(block) if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    x = call.fresh_input()
    args, kwargs = call.with_hidden(x)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = run_call(run, args, kwargs, mode, block)
    y = _grad_tensor(out)
    grad = torch.ones_like(y)
    torch.cuda.synchronize(device)
    end = torch.cuda.memory_allocated(device)
    ftmp = torch.cuda.max_memory_allocated(device) - end
    torch.cuda.reset_peak_memory_stats(device)
    torch.autograd.backward(y, grad)
    torch.cuda.synchronize(device)
    btmp = torch.cuda.max_memory_allocated(device) - end - _tensor_bytes(x)
    del out, y, grad, base
    for p in params:
        p.grad = None
    return max(0, ftmp), max(0, btmp)


def _timed_steps(run, block, call: BlockCall, modes, repeats: int, warmup: int, device: torch.device) -> dict:
    """Seconds of a step of the block in each mode (and "nostore"): ``{mode: (forward, backward)}``,
    and ``"hooks"``: the recompute-cheap mode's (pack, unpack, rebuilding operators) seconds
    (:func:`remat.hook_clock`).
    Round-robin over the modes; each mode's time is the store-all time (median) times the median of
    its ratio to store-all within a round: a shared machine's load drifts between rounds and slows a
    whole round alike, so ratios taken within a round are steady where times taken apart are not."""
    x = call.fresh_input()
    args, kwargs = call.with_hidden(x)

    def step(mode):
        with remat.hook_clock() if mode == "recompute-cheap" else contextlib.nullcontext((0.0, 0.0, 0.0)) as hooks:
            _sync(device)
            t0 = time.perf_counter()
            y = _grad_tensor(run_call(run, args, kwargs, mode, block))
            _sync(device)
            t1 = time.perf_counter()
            torch.autograd.backward(y, torch.ones_like(y))
            _sync(device)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, tuple(hooks)

    store, timed = modes[0], (*modes, "nostore")
    rounds: list = []
    for r in range(warmup + repeats):
        sample = {mode: step(mode) for mode in timed}
        if r >= warmup:
            rounds.append(sample)
    if isinstance(block, nn.Module):
        block.zero_grad(set_to_none=True)
    out = {}
    for m in timed:
        times = []
        for part in (0, 1):
            base = statistics.median(s[store][part] for s in rounds)
            ratio = statistics.median(s[m][part] / s[store][part] if s[store][part] > 0 else 1.0 for s in rounds)
            times.append(base * ratio)
        out[m] = tuple(times)
    if "recompute-cheap" in modes:
        out["hooks"] = tuple(statistics.median(s["recompute-cheap"][2][part] for s in rounds) for part in (0, 1, 2))
    return out


def _profile_one(run, block, call: BlockCall, modes, repeats: int, warmup: int, device: torch.device) -> _BlockCosts:
    exclude = call.other_tensors()
    per_mode = {m: _memory_and_work(run, block, call, m, device, exclude) for m in (*modes, "nostore")}
    if device.type == "cuda":
        for m, costs in per_mode.items():
            ftmp, btmp = _allocator_transients(run, block, call, m, device)
            costs["ftmp"], costs["btmp"] = max(costs["ftmp"], ftmp), max(costs["btmp"], btmp)
    work = _planner_costs(
        {m: c["fwd"] for m, c in per_mode.items()}, {m: c["bwd"] for m, c in per_mode.items()}, modes
    )
    seconds, bookkeeping = None, {}
    if repeats > 0:
        timed = _timed_steps(run, block, call, modes, repeats, warmup, device)
        hooks = timed.pop("hooks", None)
        seconds = _planner_costs({m: t[0] for m, t in timed.items()}, {m: t[1] for m, t in timed.items()}, modes)
        if device.type == "cpu":
            # host-side Python: on an accelerator it overlaps the device's work
            # rounds as the block's (a short null-block round each; at least 5 for a median)
            rounds = max(5, 3 * repeats)
            bookkeeping["checkpoint"] = checkpoint_bookkeeping_seconds(call, per_mode[modes[0]]["packed"], rounds)
            if hooks is not None:
                bookkeeping["recompute-cheap"] = hooks
    return _BlockCosts(
        work=work,
        seconds=seconds,
        saved=[per_mode[m]["saved"] for m in modes],
        # per mode and apart: a no-store forward keeps nothing, so its intermediates peak higher above
        # its end than a tape's forward does above its tape; the planner counts each where it runs
        ftmp=[per_mode[m]["ftmp"] for m in modes],
        nostore_ftmp=per_mode["nostore"]["ftmp"],
        # other modes run store-all's backward plus their recompute: a lower figure is not to be
        # trusted (recompute-cheap measured 128 B below store-all alone, 124 B above it in a model)
        btmp=[max(per_mode[m]["btmp"], per_mode[modes[0]]["btmp"]) for m in modes],
        kept_out=[per_mode[m]["kept_out"] for m in modes],
        input_only_btmp=per_mode["nostore"]["btmp"],
        bookkeeping=bookkeeping,
    )


@contextlib.contextmanager
def kept_state(params: Sequence[torch.Tensor], devices: Sequence[torch.device] = ()):
    """Inside: profiling may draw random numbers and make gradients; on exit (also on an error) the
    random state (the CPU's and that of every CUDA device in ``devices``) and each parameter's
    ``.grad`` are exactly as before. Gradients are set to ``None`` inside, so autograd makes new
    tensors rather than accumulating into the caller's (which it would do in place).

    Memory: references to the old gradients only; no synchronisation beyond reading the CUDA
    random states."""
    params = [p for p in params if isinstance(p, torch.Tensor)]
    grads = [p.grad for p in params]
    cuda = sorted({d for d in (torch.device(d) for d in devices) if d.type == "cuda"}, key=str)
    try:
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            for p in params:
                p.grad = None
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def _block_signature(block, call: BlockCall) -> tuple:
    params = tuple((tuple(p.shape), p.dtype, p.device, p.requires_grad) for p in _module_tensors(block))
    training = block.training if isinstance(block, nn.Module) else None
    return (type(block), repr(block), params, training, call.signature())


def profile_calls(
    blocks,
    calls: Sequence[BlockCall],
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    warmup: int = 1,
    same_blocks: bool | None = None,
    chainable: bool = True,
    runs: Sequence[Callable] | None = None,
    output_bytes: int | None = None,
) -> ChainProfile:
    """Measure each block called as ``calls[i]`` says (see :func:`profile_blocks`).

    :param calls: one :class:`BlockCall` per block (its chain input is replaced by a fresh copy).
    :param same_blocks: measure one block per group of blocks with the same class, configuration,
        parameter shapes and call signature, and give its costs to the group (``None``: group so;
        ``True``: all blocks are one group; ``False``: measure every block).
    :param chainable: each block's input is the previous block's output as it is.
    :param runs: what to call for each block (default: the block): its original forward when the
        block is wrapped.
    :param output_bytes: bytes of the last block's output (default: measured by running it).
    """
    blocks = as_block_list(blocks, "profile_blocks")
    modes = tuple(modes)
    if not modes or modes[0] != "store-all" or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"profile_blocks: modes must start with 'store-all' and be taken from {MODES}, got {modes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"profile_blocks: repeats must be an int >= 0, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"profile_blocks: warmup must be an int >= 0, got {warmup!r}")
    if len(calls) != len(blocks):
        raise ValueError(f"profile_blocks: {len(calls)} calls for {len(blocks)} blocks")
    runs = list(runs) if runs is not None else list(blocks)
    device = calls[0].hidden_tensor.device
    n = len(blocks)
    groups: dict = {}
    for i, (b, c) in enumerate(zip(blocks, calls)):
        key = 0 if same_blocks else (i if same_blocks is False else _block_signature(b, c))
        groups.setdefault(key, []).append(i)
    params = [p for b in blocks for p in b.parameters()]
    # profiling must change neither the user's random stream nor the gradients
    with kept_state(params, {device, *(p.device for p in params)}):
        costs: list = [None] * n
        for members in groups.values():
            i = members[0]
            try:
                one = _profile_one(runs[i], blocks[i], calls[i], modes, repeats, warmup, device)
            except RuntimeError as e:
                if isinstance(e, torch.OutOfMemoryError) or "in-place operation" not in str(e):
                    raise
                raise ValueError(
                    f"auto_checkpoint: block {i} ({type(blocks[i]).__name__}) updates in place an input that needs a "
                    "gradient (one an earlier block made for the later ones): a recompute of the blocks that read it "
                    "would see its later value, so they cannot be checkpointed; copy it in the block instead "
                    f"(x = x * 0.5, not x.mul_(0.5)) ({e})"
                ) from e
            for j in members:
                costs[j] = one
        if output_bytes is None:
            with torch.no_grad():
                args, kwargs = calls[-1].args, calls[-1].kwargs
                output_bytes = _tensor_bytes(hidden_of(runs[-1](*args, **kwargs)))
    K = len(modes) + (0 if chainable else 1)
    prof = ChainProfile(
        modes + (() if chainable else (INPUT_ONLY,)),
        [],
        [],
        [],
        [_tensor_bytes(c.hidden_tensor) for c in calls] + [output_bytes],
        [],
        [],
        [],
        device=str(device),
        chainable=chainable,
        hidden=[c.hidden for c in calls],
        hidden_rows=_rows(calls[-1].hidden_tensor),
    )
    timed = all(c.seconds is not None for c in costs)
    seconds = {"fwd_time": [], "bwd_time": [], "fwd_nostore_time": [], "bookkeeping": [c.bookkeeping for c in costs]}
    for i, c in enumerate(costs):
        saved, btmp = list(c.saved), list(c.btmp)
        kept = [int(o > 0) for o in c.kept_out]
        if not chainable:
            # a checkpoint of the block alone: keeps its input only; its backward rebuilds the tape
            saved.append(0)
            btmp.append(c.input_only_btmp)
            kept.append(0)
        if i == n - 1:
            # a tape keeping its own output: the planner counts it with the next block's input,
            # and there is no next block
            saved = [s + o for s, o in zip(saved, c.kept_out + [0] * (K - len(c.kept_out)))]
        for costs_of, into in ((c.work, prof), (c.seconds, seconds) if timed else (None, None)):
            if costs_of is None:
                continue
            fwd, bwd = list(costs_of["fwd"]), list(costs_of["bwd"])
            if not chainable:
                fwd.append(costs_of["input_only"][0])
                bwd.append(costs_of["input_only"][1])
            times = into if isinstance(into, dict) else into.__dict__
            times["fwd_time"].append(fwd)
            times["bwd_time"].append(bwd)
            times["fwd_nostore_time"].append(costs_of["nostore"])
        prof.saved_bytes.append(saved)
        # store-input-only (not chainable) is a tape mode whose forward is the no-store one
        ftmp = list(c.ftmp) + ([] if chainable else [c.nostore_ftmp])
        prof.fwd_tmp_bytes.append(max(ftmp))
        prof.fwd_tape_tmp_bytes.append(ftmp)
        prof.fwd_nostore_tmp_bytes.append(c.nostore_ftmp)
        prof.bwd_tmp_bytes.append(btmp)
        prof.output_kept.append(kept)
    if not timed:
        prof.time_unit = float("nan")  # counted work only: no seconds to predict (repeats=0)
    if timed:
        prof.seconds = seconds
        prof.measured_step_time = sum(f[0] + b[0] for f, b in zip(seconds["fwd_time"], seconds["bwd_time"]))
        # seconds per work unit, for figures given per block
        work = sum(f[0] for f in prof.fwd_time)
        if work > 0:
            prof.time_unit = sum(f[0] for f in seconds["fwd_time"]) / work
    return prof


def profile_blocks(
    blocks,
    sample_input,
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    warmup: int = 1,
    same_blocks: bool | None = None,
) -> ChainProfile:
    """Measure each block of a chain: bytes kept for backward, transient peaks and work per mode.

    :param blocks: an ``nn.Sequential``/``nn.ModuleList``/list of blocks; block ``i + 1`` takes the
        output of block ``i``.
    :param sample_input: the first block's input (a tensor), of the shape used in training (the
        costs depend on batch and sequence length: profile again when they change). For blocks
        that take more than one argument, use :func:`llmmem.auto_checkpoint` on the whole model.
    :param modes: which modes to measure, from ``("store-all", "selective", "recompute-cheap")``;
        store-all is required.
    :param repeats: timed repeats (median) of the steps that turn work units into seconds.
    :param same_blocks: the blocks are copies of one block (transformer layers): measure the first
        and reuse its costs for all. ``None``: blocks of the same class, configuration (``repr``),
        parameter shapes and input shape are measured once.
    :returns: a :class:`ChainProfile` (times in work units of ``time_unit`` seconds).

    Memory: one block's activations at a time (and the chain's boundary activations). Runs each
    measured block once per mode under the meters, and ``2 * (warmup + repeats)`` timed steps;
    synchronises a CUDA device. The random state (CPU and CUDA) and the blocks' parameter
    gradients are left exactly as they were, also when profiling raises.
    """
    blocks = as_block_list(blocks, "profile_blocks")
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(
            f"profile_blocks: sample_input must be a tensor, got {type(sample_input).__name__} (for blocks called "
            "with several arguments, give the whole model to llmmem.auto_checkpoint(model, sample=...))"
        )
    x = sample_input.detach()
    params = [p for b in blocks for p in b.parameters()]
    devices = {x.device, *(p.device for p in params)}
    # the state is kept before the chain runs: its dropout draws random numbers too
    with kept_state(params, devices):
        calls = []
        with torch.no_grad():
            for block in blocks:
                calls.append(BlockCall((x,)))
                x = block(x)
                if not isinstance(x, torch.Tensor):
                    raise TypeError("profile_blocks: each block must return one tensor (the next block's input)")
        return profile_calls(
            blocks,
            calls,
            modes=modes,
            repeats=repeats,
            warmup=warmup,
            same_blocks=same_blocks,
            output_bytes=_tensor_bytes(x),
        )


def as_block_list(blocks, who: str) -> list:
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        blocks = list(blocks)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise TypeError(f"{who}: blocks must be a non-empty nn.Sequential, nn.ModuleList or list of modules")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"{who}: blocks[{i}] must be an nn.Module, got {type(b).__name__}")
    check_distinct(blocks, who)
    return list(blocks)


def check_distinct(blocks: Sequence[nn.Module], who: str) -> None:
    """Raise ``ValueError`` when a module is twice in the chain, or two blocks share a parameter that
    trains. The planner's model is a chain of distinct blocks: a parameter used by two blocks of
    one step has its first gradient held by autograd (which sums the two before accumulating) from
    the later block's backward until the earlier one's, memory the plan does not count; and a plan
    runs in place per module, so a module cannot be two blocks."""
    first: dict = {}
    for j, b in enumerate(blocks):
        i = first.setdefault(id(b), j)
        if i != j:
            raise ValueError(
                f"{who}: blocks[{j}] is blocks[{i}], the same {type(b).__name__} module: each block of the chain must "
                "be a module of its own (a module run several times in a step, sharing its weights, is not a chain "
                "the planner can budget: its parameters' gradients are held between its uses)"
            )
    owner: dict = {}
    for j, b in enumerate(blocks):
        for name, p in b.named_parameters():
            if not p.requires_grad:
                continue
            i, other = owner.setdefault(id(p), (j, name))
            if i != j:
                raise ValueError(
                    f"{who}: blocks[{i}] and blocks[{j}] share a parameter that trains ({other!r} of blocks[{i}] is "
                    f"{name!r} of blocks[{j}], shape {list(p.shape)}): the planner needs blocks that share no trained "
                    "weights (autograd holds a shared weight's gradient from the later block's backward until the "
                    "earlier one's, memory the plan does not count)"
                )


# --------------------------------------------------------------------------------------------
# A whole model: one real step, recorded


def loss_of(out) -> torch.Tensor:
    """The loss of a model's output: a scalar tensor itself; ``.loss`` or ``["loss"]`` (Hugging
    Face outputs); the first scalar floating-point tensor of a tuple; else the sum of the first
    floating-point tensor (give ``sample`` as a callable to measure a real loss instead)."""
    if isinstance(out, torch.Tensor):
        return out if out.numel() == 1 else out.sum()
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for t in leaves:
        if t.numel() == 1 and t.requires_grad:
            return t
    for t in leaves:
        if t.requires_grad:
            return t.sum()
    raise TypeError(
        f"sample: the model returned {type(out).__name__} with no floating-point tensor to take a loss from"
    )


def is_step(sample) -> bool:
    """Is ``sample`` a callable running a training step (rather than a batch)?"""
    return callable(sample) and not isinstance(sample, (torch.Tensor, nn.Module))


def forward_of(model, sample) -> Callable[[], object]:
    """The model's forward on a batch ``sample`` (a tensor, a tuple/list or a mapping), as a callable."""
    if isinstance(sample, torch.Tensor):
        return lambda: model(sample)
    if isinstance(sample, (tuple, list)):
        return lambda: model(*sample)
    if isinstance(sample, Mapping):
        return lambda: model(**dict(sample))
    raise TypeError(f"sample: expected {SAMPLE_FORMS}, got {type(sample).__name__}")


def sample_step(model, sample) -> Callable[[], None]:
    """One training step on ``sample``: a callable is the step itself; a tensor, a tuple/list or a
    mapping are the model's inputs (``model(x)``, ``model(*sample)``, ``model(**sample)``), and the
    step is that forward, :func:`loss_of` its output, and the backward. Such a step carries
    ``called_as`` (how the model is called, with the sample's types), which :func:`record_step`
    puts in the ``TypeError`` it raises when the model refuses the sample before any block ran."""
    if is_step(sample):
        return sample
    call = forward_of(model, sample)
    how = (
        "model(sample)"
        if isinstance(sample, torch.Tensor)
        else "model(*sample)"
        if isinstance(sample, (tuple, list))
        else "model(**sample)"
    )

    def step() -> None:
        out = call()
        loss = loss_of(out)
        del out  # nothing but the loss outlives the forward, as in a training loop
        loss.backward()

    # what record_step says when the model refuses the sample before any block ran
    step.called_as = f"{how} with sample = {describe_value(sample)}"
    step.hint = ""
    if isinstance(sample, (tuple, list)) and len(sample) == 1 and isinstance(sample[0], Mapping):
        step.hint = "; sample holds one dict: for model(**batch), give the dict itself (sample=batch)"
    return step


SAMPLE_FORMS = (
    "a batch (a tensor: model(sample); a tuple or list of the model's positional arguments: model(*sample); a "
    "dict of its keyword arguments: model(**sample)) or a callable running one training step"
)


def describe_value(v, depth: int = 0) -> str:
    """A short description of a sample's types: tensors by shape and dtype, containers by their items."""
    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
    if depth >= 2:
        return type(v).__name__
    if isinstance(v, Mapping):
        items = ", ".join(f"{k!r}: {describe_value(x, depth + 1)}" for k, x in list(v.items())[:6])
        more = ", ..." if len(v) > 6 else ""
        return f"{type(v).__name__} {{{items}{more}}}"
    if isinstance(v, (tuple, list)):
        items = ", ".join(describe_value(x, depth + 1) for x in v[:6])
        more = ", ..." if len(v) > 6 else ""
        return f"{type(v).__name__} of {len(v)} [{items}{more}]"
    return type(v).__name__


def _copy_call(meter: ActivationMeter, args: tuple, kwargs: dict, memo: dict) -> tuple[tuple, dict]:
    """Copies of a call's tensors made outside the meter's count, so that keeping them for profiling
    changes neither what the step holds nor when it frees it. A tensor passed to several blocks (a
    mask) is copied once."""

    def copy(t):
        if id(t) not in memo:
            with meter.ignoring(), torch.no_grad():
                memo[id(t)] = t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())
        return memo[id(t)]

    return pytree.tree_map_only(torch.Tensor, copy, (tuple(args), dict(kwargs)))


class _PassThrough(torch.autograd.Function):
    """The recording step's stand-in for a block's graph: the block's output, computed without a
    graph, and in backward the output's gradient handed to the input (zeros where the shapes
    differ). The head, the loss and what comes before the chain run as they would; the blocks cost
    one forward without a graph and nothing in backward. A block whose input needs no gradient but
    whose parameters train (a LoRA layer after frozen embeddings) passes an empty leaf as ``x``,
    so that its output needs a gradient as the real block's does."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.meta = (x.shape, x.dtype, x.device)
        ctx.same = x.shape == y.shape and x.dtype == y.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if ctx.same:
            return grad, None
        shape, dtype, device = ctx.meta
        return torch.zeros(shape, dtype=dtype, device=device), None


class _Fresh(torch.autograd.Function):
    """A copy of ``t`` that needs a gradient through ``anchor``: not a leaf, so a later block may
    update it in place, as it may the output of a block run with a graph."""

    @staticmethod
    def forward(ctx, anchor, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _with_grad_outputs(out, y, args, kwargs, produced: set):
    """``out`` of a block run without a graph, its new floating-point outputs beside ``y`` (the
    chain output) needing a gradient, as with a graph they would (T5's position bias, made by a
    layer for the layers after it; a block keeps more for backward when such an input needs one).
    The copies are made unmetered; their storages go into ``produced``."""
    given = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    anchor = torch.empty(0, device=y.device, requires_grad=True)

    def mark(t):
        if t is y or t.requires_grad or not t.is_floating_point() or _storage_key(t) in given:
            return t
        return _Fresh.apply(anchor, t)

    with _disable_current_modes():
        out = pytree.tree_map_only(torch.Tensor, mark, out)
    produced.update(_storage_key(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t is not y)
    return out


def _replace_hidden(out, h):
    if isinstance(out, torch.Tensor):
        return h
    if isinstance(out, (tuple, list)):
        return type(out)([h, *out[1:]])
    return out  # a mapping: its first tensor stays graph-less (the head then sees no gradient path)


@dataclass
class StepRecord:
    """What one real step of a model says about its chain of blocks (bytes, measured)."""

    calls: list
    links: list  # [L] block i's input is block i - 1's output (links[0]: True)
    output_bytes: int
    static_bytes: int
    head: dict
    outside_peak_bytes: int
    outside_work: float  # work units of the step outside the blocks (embeddings, head, loss, optimizer)
    outside_backward_work: float  # the part of it that ran in the backward


def _no_backward_error(model, blocks: list, differentiated: list) -> ValueError:
    """What to say when blocks of the chain have no backward in the step (nothing in them trains)."""
    name = type(model).__name__
    if not any(differentiated):
        if not any(p.requires_grad for p in model.parameters()):
            why = f"no parameter of {name} requires grad (the model is frozen) and no block's input needs a gradient"
        else:
            why = "every parameter of the blocks is frozen and no block's input needs a gradient"
        return ValueError(
            f"auto_checkpoint: the chain of {len(blocks)} blocks has no backward: {why}. Activation checkpointing "
            "trades recompute for the memory a backward needs; with nothing in the blocks to train there is none to "
            "save (unfreeze the parameters to train, e.g. adapters, or run the model under torch.no_grad())"
        )
    frozen = [i for i, d in enumerate(differentiated) if not d]
    return ValueError(
        f"auto_checkpoint: block(s) {frozen[:8]} of the {len(blocks)} blocks have no backward (their parameters are "
        "frozen and their input needs no gradient): they keep nothing for backward, so there is nothing to plan "
        "there; give the blocks that train as blocks= (a list of the model's submodules)"
    )


def record_step(model, blocks: list, step: Callable[[], None], device, stack_starts: Sequence[int] = ()) -> StepRecord:
    """Run ``step`` once with hooks on ``blocks``: each block's first call (copied), whether each
    block's input is the previous block's output (identity), and the activation bytes of the step
    around the chain (:class:`ActivationMeter` marks: the chain's start and end, the start of the
    backward, the end of the head's backward, the end of the chain's backward). The blocks run
    without a graph and unmetered (:class:`_PassThrough`): their own costs are profiled one by one
    afterwards. Parameter gradients are not activations; the caller restores them and the random
    state. ``stack_starts``: where each stack of ``blocks`` starts (an encoder's, then a decoder's):
    the step must run them in that order, one after the other."""
    L = len(blocks)
    calls: list = [None] * L
    order: list = [None] * L  # when each block was first called
    reused: set = set()
    links = [False] * L
    outs: list = [None] * L
    memo: dict = {}
    groups: dict = {}
    sizes: dict = {}
    work = WorkCounter(device.type)  # the blocks run outside it (_disable_current_modes)
    # the real block's output needs a gradient when its input does or any of its parameters trains
    trains = [any(p.requires_grad for p in b.parameters()) for b in blocks]
    differentiated = [False] * L
    meter = ActivationMeter(list(model.parameters()), device=device, work=work)
    done: dict = {}

    # What the blocks' tapes would hold until the chain's backward (their inputs made before the
    # chain: the first block's input, masks, position embeddings); without tapes here, held by hand.
    held: dict = {}
    side: dict = {}  # storage -> bytes of the tensors blocks make for later blocks (beyond the chain input)
    produced: set = set()  # storages of what the blocks returned beside their chain output
    made_inputs: dict = {}  # block -> counted bytes of an input the model made for it (not the previous output)

    def on_chain_grad(_grad):
        if "chain_done" not in done:
            done["chain_done"] = True
            held.clear()
            meter.mark("chain_done")
            try:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: meter.mark("backward_end"))
            except (AttributeError, RuntimeError):
                pass

    def on_head_grad(_grad):
        if "head_done" not in done:
            done["head_done"] = True
            meter.mark("head_done")

    starts = set(stack_starts)

    def pre_hook(i):
        def hook(module, args, kwargs):
            done["block_started"] = True
            if calls[i] is not None:
                last = done.get("last_out")
                last = last() if last is not None else None
                if last is not None and torch.is_grad_enabled() and any(a is last for a in (*args, *kwargs.values())):
                    reused.add(i)  # run again on a block's output: one module at several depths
                return
            order[i] = len(done.setdefault("called", []))
            done["called"].append(i)
            # a stack's first block takes its own input (a decoder's), even where it also gets the
            # previous stack's output (as its cross-attention's memory)
            previous = outs[i - 1]() if i > 0 and i not in starts and outs[i - 1] is not None else None
            where, linked = find_hidden(args, kwargs, previous)
            if where is None:
                raise TypeError(f"auto_checkpoint: block {i} ({type(module).__name__}) was called with no tensor")
            links[i] = linked
            h = args[where] if isinstance(where, int) else kwargs[where]
            for t in pytree.tree_leaves((args, kwargs)):
                if not isinstance(t, torch.Tensor):
                    continue
                if meter.counted_bytes(t):
                    held[id(t)] = t
                elif t is not h and _storage_key(t) in produced:
                    # made by an earlier block (which runs unmetered here) and given to later ones,
                    # as T5's position bias: held until the chain's backward, by their tapes
                    side[_storage_key(t)] = _storage_bytes(t)
            call = BlockCall(tuple(args), dict(kwargs), where, input_grad=h.requires_grad)
            if i > 0 and not linked:
                # an input the model made (a decoder's embeddings): the planner counts it as the
                # block's input, not among what the model keeps between blocks
                made_inputs[i] = meter.counted_bytes(h)
            if i == 0:
                meter.mark("chain_start")
                h = call.hidden_tensor
                sizes["x0"] = meter.counted_bytes(h)
                if h.requires_grad:
                    h.register_hook(on_chain_grad)
                    done["chain_hooked"] = True
            # one copy per distinct call: the blocks that share it are profiled as one
            key = _block_signature(module, call)
            if key not in groups:
                c_args, c_kwargs = _copy_call(meter, args, kwargs, memo)
                groups[key] = BlockCall(c_args, c_kwargs, where, input_grad=call.input_grad)
            calls[i] = groups[key]

        return hook

    def post_hook(i):
        def hook(module, args, kwargs, out):
            try:
                done["last_out"] = weakref.ref(hidden_of(out))
            except TypeError:
                done.pop("last_out", None)
            if outs[i] is not None:
                return
            h = hidden_of(out)
            outs[i] = weakref.ref(h)
            if i == L - 1:
                meter.mark("chain_end")
                sizes["out"] = _tensor_bytes(h)
                if h.requires_grad:
                    h.register_hook(on_head_grad)

        return hook

    def recording_forward(i, forward, *args, **kwargs):
        if not torch.is_grad_enabled() or calls[i] is None:
            return forward(*args, **kwargs)
        where = calls[i].hidden
        h = args[where] if isinstance(where, int) else kwargs[where]
        args, kwargs, _ = without_cache(args, kwargs)
        with torch.no_grad(), _disable_current_modes():
            out = forward(*args, **kwargs)
        y = hidden_of(out)
        others = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t is not h]
        if (isinstance(h, torch.Tensor) and h.requires_grad) or trains[i] or any(t.requires_grad for t in others):
            out = _with_grad_outputs(out, y, args, kwargs, produced)
        if isinstance(h, torch.Tensor) and h.requires_grad:
            out = _replace_hidden(out, _PassThrough.apply(h, y))
        elif trains[i] or any(t.requires_grad for t in others):
            anchor = torch.empty(0, device=y.device, requires_grad=True)
            if "chain_hooked" not in done:  # the chain's backward ends at the first block it reaches
                anchor.register_hook(on_chain_grad)
                done["chain_hooked"] = True
            out = _replace_hidden(out, _PassThrough.apply(anchor, y))
        differentiated[i] = hidden_of(out).requires_grad
        return out

    handles, own_forwards = [], []
    try:
        for i, b in enumerate(blocks):
            handles.append(b.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(b.register_forward_hook(post_hook(i), with_kwargs=True))
            own_forwards.append(b.__dict__.get("forward"))
            b.__dict__["forward"] = functools.partial(recording_forward, i, b.forward)
        try:
            with meter:
                step()
        except Exception as e:
            called_as = getattr(step, "called_as", None)
            if "block_started" in done and not any(differentiated):
                # torch's "element 0 of tensors does not require grad", or no loss found: say why
                raise _no_backward_error(model, blocks, differentiated) from e
            if called_as is None or "block_started" in done:
                raise  # the user's own step, or the model's own error once its blocks ran
            text = (
                f"auto_checkpoint: the sample step failed before any of the {L} blocks ran: the model was called "
                f"as {called_as}. sample must be {SAMPLE_FORMS}{getattr(step, 'hint', '')}"
            )
            # The errors a batch of the wrong form raises become one TypeError about the sample; any
            # other (an index out of range, out of memory) keeps its type, which callers catch.
            if isinstance(e, (TypeError, AttributeError, ValueError, KeyError)):
                raise TypeError(f"{text} (the model raised {type(e).__name__}: {e})") from e
            if hasattr(e, "add_note"):  # Python >= 3.11
                e.add_note(text)
            raise
        meter.mark("end")
    finally:
        held.clear()
        for h in handles:
            h.remove()
        for b, own in zip(blocks, own_forwards):
            if own is None:
                b.__dict__.pop("forward", None)
            else:
                b.__dict__["forward"] = own
    missing = [i for i, c in enumerate(calls) if c is None]
    if missing:
        raise ValueError(
            f"auto_checkpoint: the sample step did not call block(s) {missing[:8]} of the {L} blocks; give the "
            "blocks the step runs (blocks=...)"
        )
    if reused:
        i = min(reused)
        raise ValueError(
            f"auto_checkpoint: block {i} ({type(blocks[i]).__name__}) ran again on a block's output in one step: one "
            "module applied at several depths with shared weights (as ALBERT's layer group), or a stack run twice in "
            "a step (a siamese encoder), is not a chain the planner can budget (it counts each block once); "
            "checkpoint its calls by hand with llmmem.checkpoint"
        )
    for k in stack_starts:
        if 0 < k < L and order[k] < order[k - 1]:
            raise ValueError(
                f"auto_checkpoint: the step ran block {k} ({type(blocks[k]).__name__}, the first of a stack) before "
                f"block {k - 1} ({type(blocks[k - 1]).__name__}, the last of the stack before it): the planner needs "
                "stacks the model runs one after the other; give them in that order as blocks=[path, ...], or one "
                "stack as blocks="
            )
    if not all(differentiated):
        raise _no_backward_error(model, blocks, differentiated)
    marks = meter.marks
    for name in ("chain_start", "chain_end", "backward"):
        if name not in marks:
            raise ValueError(f"auto_checkpoint: the sample step did not reach the {name.replace('_', ' ')}")
    # The blocks' own storages are not metered, so these are the rest of the step's bytes.
    live_p, peak_before = marks["chain_start"]
    live_a, _ = marks["chain_end"]
    live_b, peak_ab = marks["backward"]
    out = sizes.get("out", 0)
    live_c, peak_bc = marks.get("head_done", (live_b + out, peak_ab))
    static = max(0, live_p - sizes.get("x0", 0))
    # After the head's backward the planner has the chain's forward state back, with the gradient of
    # a_L; anything more (an output the step still holds) is held through the chain's backward too.
    static += max(0, live_c - live_a - out) + sum(side.values())
    # What the model's own code between the blocks kept during the chain (an encoder's final norm, a
    # decoder's embeddings, adapters called between the layers): held to its backward, past the
    # chain's (the blocks run unmetered here, so the rest is this).
    static += max(0, live_a - live_p - sum(made_inputs.values()))
    head = {
        "saved_bytes": max(0, live_b - live_a),
        "fwd_tmp_bytes": max(0, peak_ab - live_b),
        # beyond the gradient of a_L it makes (the planner counts that)
        "bwd_tmp_bytes": max(0, peak_bc - live_b - out),
    }
    tail = marks.get("backward_end", marks["end"])
    return StepRecord(
        calls=calls,
        links=[True] + links[1:],
        output_bytes=out,
        static_bytes=static,
        head=head,
        outside_peak_bytes=max(peak_before, tail[1] if "chain_done" in marks else 0),
        outside_work=work.forward + work.backward,
        outside_backward_work=work.backward,
    )


def profile_model(
    model,
    blocks: list,
    sample,
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    warmup: int = 1,
    runs: Sequence[Callable] | None = None,
    stack_starts: Sequence[int] = (),
) -> ChainProfile:
    """Profile the chain ``blocks`` of ``model`` as one real step on ``sample`` runs it (see
    :func:`sample_step`): each block called with the arguments the model gave it, and the bytes the
    rest of the step holds around the chain (``static_bytes``, ``head``, ``outside_peak_bytes``; see
    :func:`record_step`). Blocks of one class and call signature are measured once.

    Memory: the step with the blocks keeping nothing, then one block's activations at a time. The
    random state and the parameters' ``.grad`` are as before (:func:`kept_state`, also on an error);
    the step's other effects (an optimizer step in a callable ``sample``) happen once.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    step = sample_step(model, sample)
    params = list(model.parameters())
    with kept_state(params, {device, *(p.device for p in params)}):
        rec = record_step(model, blocks, step, device, stack_starts)
        # Regions span the blocks that feed each other; where no two do, each block is checkpointed
        # alone (the store-input-only mode), else regions end where the chain is cut.
        linked = rec.links[1:]
        chainable = all(linked) or any(linked)
        stripped = []
        for c in rec.calls:
            args, kwargs, _ = without_cache(c.args, c.kwargs)
            stripped.append(BlockCall(args, kwargs, c.hidden, input_grad=c.input_grad))
        prof = profile_calls(
            blocks,
            stripped,
            modes=modes,
            repeats=repeats,
            warmup=warmup,
            chainable=chainable,
            runs=runs,
            output_bytes=rec.output_bytes,
        )
    prof.head = rec.head
    if chainable and not all(linked):
        prof.cuts = [0] + [int(not link) for link in linked]
    prof.step_frees_output = not is_step(sample)
    prof.static_bytes = rec.static_bytes
    prof.outside_peak_bytes = rec.outside_peak_bytes
    prof.outside_work = rec.outside_work
    if prof.seconds:
        # the rest of the step at the blocks' seconds per work unit, forward and backward apart
        # (a backward runs at another rate: more operators per FLOP)
        rate = []
        for key in ("fwd_time", "bwd_time"):
            work = sum(r[0] for r in getattr(prof, key))
            rate.append(sum(r[0] for r in prof.seconds[key]) / work if work > 0 else prof.time_unit)
        forward = rec.outside_work - rec.outside_backward_work
        prof.outside_time = forward * rate[0] + rec.outside_backward_work * rate[1]
    return prof
