"""Activation checkpointing: a drop-in for ``torch.utils.checkpoint`` (non-reentrant semantics).

:func:`checkpoint` runs a function without keeping the tensors autograd would save for backward;
backward recomputes them, on the first time one of them is needed, by running the function again
from its saved inputs. It is built on :class:`torch.autograd.graph.saved_tensors_hooks`:

* forward: the function runs under a hook pair whose *pack* hook keeps a small placeholder (a
  :class:`_Slot`) instead of the tensor, and records its shape/dtype/device for the determinism
  check. The inputs of the region are saved once, by a no-op autograd node (:class:`_KeepInputs`),
  so an enclosing checkpoint (nesting) or the offload hooks decide where they live.
* backward: the first *unpack* of a slot in a backward pass re-runs the function under a second
  hook pair that hands each recomputed tensor to the slot at the same position; once every slot
  of the region is filled the recompute is stopped (early stop). Each recomputed tensor is handed
  out once and then dropped, so it is freed as soon as autograd is done with it.

Memory cost of a region: its inputs (once, whatever else holds them) plus one small Python object
per saved tensor until backward reaches the region; during backward, the region's saved tensors
are live again while the region is differentiated. Time cost: one extra forward of the region
(less with early stop).

What is replayed during the recompute: the CPU RNG state and the RNG state of every CUDA device
the inputs live on (so dropout draws the same mask), the streams of every RNG tracker that
registered itself (``llmmem.parallel``'s model-parallel tracker, so split-region dropout inside
a tensor-parallel block draws the same mask too), the autocast state of CPU and of the inputs'
accelerator (enabled, dtype, cache), and the caller's ``context_fn`` recompute context.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import weakref
from collections import defaultdict
from typing import Callable

import torch
import torch.utils.checkpoint as _torch_ckpt
from torch.utils import _pytree as pytree

from llmmem.checkpointing import compile_notes
from llmmem.checkpointing.errors import CheckpointError
from llmmem.checkpointing.offload import HostCopies
from llmmem.checkpointing.replay import (
    OpLog,
    ReplayTrackers,
    RngState,
    accelerator_type,
    autocast_state,
    format_op_logs,
    has_rng_trackers,
)

__all__ = ["checkpoint", "CheckpointError", "noop_context_fn", "feature_status", "CHECKPOINT_OPTIONS"]


def noop_context_fn():
    """The default ``context_fn``: no extra context for the forward or the recompute."""
    return contextlib.nullcontext(), contextlib.nullcontext()


def feature_status() -> tuple[bool, str]:
    """``(usable, detail)`` for ``python -m llmmem info``."""
    from llmmem._native import available, load_error

    if not available():
        return False, f"checkpoint usable, planner not: C core missing ({load_error!r})"
    return True, f"checkpoint + C planner (torch {torch.__version__})"


# --------------------------------------------------------------------------------------------
# Options


_DETERMINISM_CHECKS = ("default", "none")
CHECKPOINT_OPTIONS = (
    "use_reentrant",
    "preserve_rng_state",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "offload",
)


_BOOL_OPTIONS = ("preserve_rng_state", "debug", "early_stop", "offload")


def _is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _validate_options(opts: dict) -> None:
    # torch takes any object for these and tests its truth: offload="no" would offload. A bool
    # (numpy's too) or, for use_reentrant, None is what they mean.
    for name in _BOOL_OPTIONS + ("use_reentrant",):
        value = opts[name]
        if not (isinstance(value, bool) or _is_numpy_bool(value) or (value is None and name == "use_reentrant")):
            expected = "True, False or None" if name == "use_reentrant" else "True or False"
            raise TypeError(f"checkpoint: {name} must be a bool ({expected}), got {value!r} ({type(value).__name__})")
    if opts["determinism_check"] not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"checkpoint: determinism_check must be one of {list(_DETERMINISM_CHECKS)}, "
            f"got {opts['determinism_check']!r}"
        )
    if not callable(opts["context_fn"]):
        raise TypeError(f"checkpoint: context_fn must be callable, got {type(opts['context_fn']).__name__}")
    if opts["debug"] and opts["context_fn"] is not noop_context_fn:
        raise ValueError("checkpoint: debug=True cannot be combined with a custom context_fn")
    if opts["use_reentrant"]:
        bad = [
            name
            for name, default in (
                ("context_fn", noop_context_fn),
                ("debug", False),
                ("determinism_check", "default"),
                ("offload", False),
            )
            if opts[name] is not default and opts[name] != default
        ]
        if bad:
            raise ValueError(f"checkpoint: {', '.join(bad)} are only supported with use_reentrant=False")


def checkpoint(
    function: Callable | None = None,
    *args,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    offload: bool = False,
    **kwargs,
):
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Same signature and semantics as ``torch.utils.checkpoint.checkpoint`` with
    ``use_reentrant=False``, which is the default here (``None`` means ``False``; no warning).

    :param function: what to run. If omitted (``checkpoint(**options)``), returns a decorator:
        ``checkpoint(use_reentrant=False)(fn)(*args, **kwargs)``, so that the options and the
        function's own keyword arguments never share a namespace.
    :param args: positional arguments; tensors may be nested in lists, tuples and dicts.
    :param use_reentrant: ``True`` delegates to torch's reentrant implementation (no kwargs, no
        ``torch.autograd.grad``, no nested containers; see torch's documentation).
    :param preserve_rng_state: stash the CPU RNG and the RNG of the CUDA devices of the inputs at
        the call and restore them for the recompute, so dropout gives identical gradients; the
        streams of ``llmmem.parallel.get_rng_tracker()`` are stashed and replayed too.
    :param context_fn: returns two context managers, one entered around the forward and one around
        the recompute (e.g. ``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
    :param determinism_check: ``"default"`` compares shape, dtype and device of every recomputed
        tensor with the original and raises :class:`CheckpointError` on a difference; ``"none"``.
    :param debug: record the operators run in the forward and in the recompute, each with the
        Python stack that called it, and print both in a :class:`CheckpointError` (as torch's debug
        mode does, without its C++ frames). Costs a stack walk per operator.
    :param early_stop: stop the recompute as soon as every saved tensor of the region is rebuilt.
    :param offload: keep the region's inputs in host memory (pinned, copied on a side stream and
        prefetched during backward when they live on a CUDA device; a no-op for CPU tensors).
    :returns: what ``function`` returns (any structure; non-tensor outputs are fine).

    Backward calls under one ``torch.utils.checkpoint.GraphExecGroup`` (torch >= 2.10) share one
    recompute of the region, and may not need the same saved tensor twice, as with torch. Every
    bool option must be a bool (``TypeError`` otherwise; torch takes any object's truth).

    Memory: the region's inputs (on the host with ``offload=True``) until backward reaches it.
    Synchronisation: none, except that ``offload=True`` pins host memory.
    """
    opts = dict(
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        offload=offload,
    )
    if function is None:
        if args or kwargs:
            raise TypeError(
                "checkpoint: without a function only the checkpoint options may be given "
                f"(got {len(args)} positional and keyword {sorted(kwargs)})"
            )
        _validate_options(opts)
        return functools.partial(_Checkpointed, options=opts)
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {type(function).__name__}")
    _validate_options(opts)
    return _run(function, args, kwargs, opts)


class _Checkpointed:
    """``checkpoint(**options)(fn)``: calls ``fn`` checkpointed; also binds as a method."""

    def __init__(self, fn: Callable, *, options: dict) -> None:
        if not callable(fn):
            raise TypeError(f"checkpoint(...)(fn): fn must be callable, got {type(fn).__name__}")
        self._fn = fn
        self._options = options
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return _run(self._fn, args, kwargs, self._options)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return _Checkpointed(self._fn.__get__(obj, objtype), options=self._options)


# torch's own checkpoint, bound now: code that switches implementations by assigning
# ``torch.utils.checkpoint.checkpoint = llmmem.checkpoint`` must not make the reentrant hand-off
# below call llmmem again (it would recurse until RecursionError). If something else was assigned
# there before llmmem was imported, torch's reentrant autograd Function is called directly, as
# torch's checkpoint does after validating its arguments.
_torch_checkpoint = _torch_ckpt.checkpoint
if getattr(_torch_checkpoint, "__module__", None) != _torch_ckpt.__name__:
    _torch_checkpoint = None


def _torch_reentrant(function: Callable, args: tuple, kwargs: dict, preserve_rng_state: bool):
    if _torch_checkpoint is not None:
        return _torch_checkpoint(function, *args, use_reentrant=True, preserve_rng_state=preserve_rng_state, **kwargs)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    return _torch_ckpt.CheckpointFunction.apply(function, preserve_rng_state, *args)


def _run(function: Callable, args: tuple, kwargs: dict, opts: dict):
    if opts["use_reentrant"]:
        if opts["preserve_rng_state"] and has_rng_trackers():
            function = ReplayTrackers(function)
        return _torch_reentrant(function, args, kwargs, opts["preserve_rng_state"])
    if not torch.is_grad_enabled():
        # Nothing will be saved for backward, so there is nothing to checkpoint.
        return function(*args, **kwargs)
    if torch.compiler.is_compiling():
        return _traced(function, args, kwargs, opts)
    if opts["offload"]:
        compile_notes.watch(OFFLOAD_UNDER_COMPILE)  # said at a later torch.compile
    return _run_region(function, args, kwargs, opts)


OFFLOAD_UNDER_COMPILE = (
    "llmmem.checkpoint(offload=True) and torch.compile: where a compiled model runs such a region, the "
    "region is recomputed but its inputs stay on the device (the compiled graph cannot move them to the "
    "host); to offload them, checkpoint the compiled function instead: "
    "llmmem.checkpoint(torch.compile(block), x, offload=True)"
)


def _traced(function: Callable, args: tuple, kwargs: dict, opts: dict):
    """The region while Dynamo traces it (``torch.compile``): torch's non-reentrant checkpoint, which
    Dynamo lowers to a higher-order operator, so the compiled graph recomputes the region and saves
    what the region's own options say (``context_fn``: a selective policy). llmmem's region runs
    eagerly and keeps placeholders for the tensors autograd saves; under compile those would be the
    compiled graph's choice, which an eager recompute cannot rebuild. ``offload`` is not traced:
    the region is recomputed, its inputs stay on the device."""
    if _torch_checkpoint is None:
        raise CheckpointError(
            "checkpoint: under torch.compile a region is torch's checkpoint, and torch.utils.checkpoint.checkpoint "
            "was replaced before llmmem was imported; import llmmem first"
        )
    # torch's compile path takes its own no-op (its default) by identity, else dispatch modes
    own = {} if opts["context_fn"] is noop_context_fn else {"context_fn": opts["context_fn"]}
    return _torch_checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=opts["preserve_rng_state"],
        determinism_check=opts["determinism_check"],
        debug=opts["debug"],
        **own,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------
# The region machinery


class _StopRecompute(Exception):
    """Raised inside the recompute once every saved tensor of the region has been rebuilt."""


class _Ticket:
    """Key of one recomputed tensor; dropping it (weak key) frees the tensor if never unpacked."""

    __slots__ = ("__weakref__",)


class _Slot:
    """What the forward saves instead of a tensor: per backward pass, the ticket of its value."""

    __slots__ = ("tickets", "__weakref__")

    def __init__(self) -> None:
        self.tickets: dict[int, _Ticket | None] = {}


class _KeepInputs(torch.autograd.Function):
    """Saves the region's input tensors (through whatever saved-tensor hooks are active: an
    enclosing checkpoint's, or the offload hooks). Its output is thrown away; it is never
    differentiated."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - the output is never used
        raise RuntimeError("llmmem.checkpoint: internal node was differentiated (please report)")


_unique_pass_ids = itertools.count(start=-2, step=-1)  # negative: never a real graph task id


# torch >= 2.9 has checkpoint(early_stop=) and leaves set_checkpoint_early_stop's switch None unless
# set; before, the switch is True by default, so only False there says the caller turned it off.
_TORCH_EARLY_STOP_IS_OPTIONAL = (
    "early_stop" in inspect.signature(_torch_checkpoint or _torch_ckpt.checkpoint).parameters
)

# torch >= 2.10: torch.utils.checkpoint.GraphExecGroup, whose backward calls share one recompute
_graph_exec_group = getattr(torch._C, "_get_graph_exec_group", None)


def _pass_id():
    """Identifies the current backward pass: recomputed tensors belong to one pass only, so
    ``retain_graph=True`` followed by a second backward recomputes again. Under a
    ``torch.utils.checkpoint.GraphExecGroup``, the group is the pass: every backward call in it
    shares one recompute of each region (and may not unpack the same saved tensor twice)."""
    if _graph_exec_group is not None:
        group = _graph_exec_group()
        if group is not None:
            return group
    gid = torch._C._current_graph_task_id()
    return next(_unique_pass_ids) if gid == -1 else gid


def _metadata(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device)


class _Region:
    """State of one checkpointed call, alive while some of its saved slots are."""

    def __init__(self, recompute: Callable, rebuild: Callable, early_stop: bool, check: bool) -> None:
        self.recompute_fn = recompute  # (args, kwargs) -> None
        self.rebuild = rebuild  # saved input tensors -> (args, kwargs)
        self.early_stop = early_stop
        self.check = check
        self.inputs_keeper = None  # output of _KeepInputs: its grad_fn holds the inputs
        self.slots: list[weakref.ReferenceType] = []
        self.meta: list[tuple] = []
        self.values: dict[int, weakref.WeakKeyDictionary] = defaultdict(weakref.WeakKeyDictionary)
        self.count: dict[int, int] = defaultdict(int)
        self.recomputed: set[int] = set()
        self.forward_done = False
        self.skip_count_check = False
        self.debug_logs: tuple[list, list] | None = None

    # forward ---------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> _Slot:
        slot = _Slot()
        self.slots.append(weakref.ref(slot))
        if self.check:
            self.meta.append(_metadata(x))
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        key = _pass_id()
        if key not in self.recomputed:
            self._recompute(key)
        if key not in slot.tickets:
            raise CheckpointError(
                "llmmem.checkpoint: a saved tensor was not rebuilt by the recompute "
                "(the function saved fewer tensors the second time)" + self._debug_text()
            )
        ticket = slot.tickets[key]
        if ticket is None:
            group = (
                " Two backward calls under one torch.utils.checkpoint.GraphExecGroup needed the same "
                "saved tensor: the calls of a group must differentiate non-overlapping parts of the graph."
                if not isinstance(key, int)
                else ""
            )
            raise CheckpointError(
                "llmmem.checkpoint: a saved tensor was unpacked twice in one backward pass."
                + group
                + " If a custom autograd.Function reads ctx.saved_tensors, read it once"
                + (self._debug_text() if self.debug_logs is not None else "")
            )
        slot.tickets[key] = None
        return self.values[key].pop(ticket)

    # backward --------------------------------------------------------------------------------
    def _recompute(self, key: int) -> None:
        saved = self.inputs_keeper.grad_fn.saved_tensors  # may recompute an enclosing region (nesting)
        args, kwargs = self.rebuild(saved)
        try:
            with _RecomputeHooks(self, key), torch.autograd.enable_grad():
                self.recompute_fn(args, kwargs)
        except _StopRecompute:
            pass
        self.recomputed.add(key)
        self._check(key)

    def store_recomputed(self, key: int, x: torch.Tensor) -> torch.Tensor:
        x = x.detach() if x.requires_grad else x
        index = self.count[key]
        self.count[key] += 1
        if index >= len(self.slots):
            if not self.forward_done:
                # backward inside the checkpointed function saves extra tensors while the
                # forward is still running: the counts cannot be compared.
                self.skip_count_check = True
                return x
            raise CheckpointError(
                f"llmmem.checkpoint: the recompute saved more tensors for backward than the forward "
                f"({len(self.slots)}); the function does not do the same work when run again" + self._debug_text()
            )
        slot = self.slots[index]()
        if slot is not None:  # None: that tensor's backward already ran (or never will)
            ticket = _Ticket()
            slot.tickets[key] = ticket
            self.values[key][ticket] = x
        if self.early_stop and self.count[key] == len(self.slots):
            raise _StopRecompute
        return x

    def _check(self, key: int) -> None:
        if self.skip_count_check:
            return
        if self.count[key] != len(self.slots):
            raise CheckpointError(
                "llmmem.checkpoint: the function saved a different number of tensors for backward when "
                f"recomputed: {len(self.slots)} in the forward, {self.count[key]} in the recompute. The "
                "function must do the same work when run again (no data-dependent branches on global "
                "state, no changed inputs)" + self._debug_text()
            )
        if not self.check:
            return
        diffs = []
        for i, ref in enumerate(self.slots):
            slot = ref()
            if slot is None or slot.tickets.get(key) is None:
                continue
            got = _metadata(self.values[key][slot.tickets[key]])
            if got != self.meta[i]:
                diffs.append(
                    f"  tensor #{i}: forward saved shape={list(self.meta[i][0])} dtype={self.meta[i][1]} "
                    f"device={self.meta[i][2]}, recompute gave shape={list(got[0])} dtype={got[1]} "
                    f"device={got[2]}"
                )
        if diffs:
            raise CheckpointError(
                "llmmem.checkpoint: recomputed tensors differ from those saved in the forward "
                "(determinism_check='default' compares shape, dtype and device):\n"
                + "\n".join(diffs[:20])
                + ("\n  ..." if len(diffs) > 20 else "")
                + "\nThe function must compute the same thing when run again (determinism_check='none' "
                "skips this check)" + self._debug_text()
            )

    def _debug_text(self) -> str:
        if self.debug_logs is None:
            return (
                ". To see the operators of the forward and of the recompute, each with the stack that ran "
                "it, pass debug=True (or use torch.utils.checkpoint.set_checkpoint_debug_enabled(True))"
            )
        return format_op_logs(*self.debug_logs)


class _ForwardHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, region: _Region) -> None:
        super().__init__(region.pack, region.unpack)


class _RecomputeHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, region: _Region, key: int) -> None:
        # A weak reference: these hooks can outlive the recompute inside a graph built there
        # (backward inside the function), which must not keep the region alive.
        ref = weakref.ref(region)
        super().__init__(lambda x: ref().store_recomputed(key, x), lambda x: x)


def _save_inputs(anchor: torch.Tensor, tensors: list, offload: bool):
    """The autograd node that holds the region's inputs (on the host with ``offload``)."""
    # The node's output tensor is what keeps the node (and so the saved inputs) alive: a custom
    # Function's grad_fn object only refers to its node weakly.
    if not offload:
        return _KeepInputs.apply(anchor, *tensors)
    copies = HostCopies()
    with torch.autograd.graph.saved_tensors_hooks(copies.pack, copies.unpack):
        return _KeepInputs.apply(anchor, *tensors)


# --------------------------------------------------------------------------------------------


def _run_region(function: Callable, args: tuple, kwargs: dict, opts: dict):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_pos]
    others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def rebuild(saved):
        filled = list(others)
        for i, t in zip(tensor_pos, saved):
            filled[i] = t
        return pytree.tree_unflatten(filled, spec)

    accel = accelerator_type(tensors)
    autocast_states = {"cpu": autocast_state("cpu")}
    if accel is not None and torch.amp.is_autocast_available(accel):
        autocast_states[accel] = autocast_state(accel)
    rng = RngState(tensors) if opts["preserve_rng_state"] else None

    # torch's global switches (torch.utils.checkpoint.set_checkpoint_early_stop and
    # set_checkpoint_debug_enabled) override the per-call options there, so they do here too.
    early_stop = getattr(_torch_ckpt, "_enable_checkpoint_early_stop", None)
    if early_stop is True and not _TORCH_EARLY_STOP_IS_OPTIONAL:
        early_stop = None  # torch < 2.9: True is the switch's default, not a request
    early_stop = opts["early_stop"] if early_stop is None else early_stop
    debug = getattr(_torch_ckpt, "_checkpoint_debug_enabled", None)
    debug = opts["debug"] if debug is None else debug
    debug_logs = None
    if debug:
        debug_logs = ([], [])
        forward_ctx, recompute_ctx = OpLog(debug_logs[0]), OpLog(debug_logs[1])
    else:
        contexts = opts["context_fn"]()
        if not (isinstance(contexts, tuple) and len(contexts) == 2):
            raise TypeError("checkpoint: context_fn must return a tuple of two context managers")
        forward_ctx, recompute_ctx = contexts

    def recompute(r_args, r_kwargs):
        rng_ctx = rng.restored() if rng is not None else contextlib.nullcontext()
        with rng_ctx, contextlib.ExitStack() as stack:
            for dev, state in autocast_states.items():
                stack.enter_context(torch.amp.autocast(dev, **state))
            stack.enter_context(recompute_ctx)
            function(*r_args, **r_kwargs)

    region = _Region(recompute, rebuild, early_stop, opts["determinism_check"] == "default")
    region.debug_logs = debug_logs
    # The anchor requires grad so the input node exists even when no input requires grad.
    anchor = torch.empty(0, requires_grad=True)
    region.inputs_keeper = _save_inputs(anchor, tensors, opts["offload"])

    with _ForwardHooks(region), forward_ctx:
        out = function(*args, **kwargs)
    region.forward_done = True
    if rng is not None and not rng.cuda_was_initialized and torch.cuda.is_initialized():
        raise RuntimeError(
            "llmmem.checkpoint: CUDA was first initialised inside the checkpointed function, so its "
            "RNG state could not be saved; initialise CUDA before (e.g. move the model to the GPU) "
            "or pass preserve_rng_state=False"
        )
    return out
