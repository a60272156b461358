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
import warnings
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
from llmmem.checkpointing.selective import ThroughHooks, _Keep, compiled_selective_context_fn, selective_context_fn

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
    "respect_saved_tensors_hooks",
)


_BOOL_OPTIONS = ("preserve_rng_state", "debug", "early_stop", "offload")
_OPTIONAL_BOOL_OPTIONS = ("use_reentrant", "respect_saved_tensors_hooks")  # None: not chosen


def _is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _validate_options(opts: dict) -> None:
    # torch takes any object for these and tests its truth: offload="no" would offload. A bool
    # (numpy's too) or, for the three-state ones, None is what they mean.
    for name in _BOOL_OPTIONS + _OPTIONAL_BOOL_OPTIONS:
        value = opts[name]
        if not (
            isinstance(value, bool) or _is_numpy_bool(value) or (value is None and name in _OPTIONAL_BOOL_OPTIONS)
        ):
            expected = "True, False or None" if name in _OPTIONAL_BOOL_OPTIONS else "True or False"
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
        # The options of the non-reentrant region only; the reentrant path (torch's) has none of
        # them. early_stop is not among them: torch ignores it there, and so does llmmem.
        bad = [
            name
            for name, default in (
                ("context_fn", noop_context_fn),
                ("debug", False),
                ("determinism_check", "default"),
                ("offload", False),
                ("respect_saved_tensors_hooks", None),
            )
            if opts[name] is not default and opts[name] != default
        ]
        if bad:
            verb = "is" if len(bad) == 1 else "are"
            raise ValueError(f"checkpoint: {', '.join(bad)} {verb} only supported when use_reentrant=False")


def _warn_use_reentrant_omitted(stacklevel: int, what: str = "llmmem.checkpoint") -> None:
    """The warning torch gives when ``use_reentrant`` is omitted, with the key phrase torch's own
    tests match, so that code (and test suites) that expect it keep seeing it with llmmem swapped
    in. What llmmem then does differs from torch, and the message says so."""
    if torch.compiler.is_compiling():
        return  # a warning inside a traced region would cost Dynamo a graph break
    warnings.warn(
        f"{what}: the use_reentrant parameter should be passed explicitly. Omitted, llmmem runs the "
        "non-reentrant checkpoint (use_reentrant=False), where torch.utils.checkpoint would run the "
        "reentrant one; pass use_reentrant=False to keep this behaviour without this warning, or "
        "use_reentrant=True for torch's reentrant variant.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


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
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs,
):
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Same signature and semantics as ``torch.utils.checkpoint.checkpoint`` with
    ``use_reentrant=False``, and the same keyword options (those of torch 2.5 to 2.15, plus
    ``offload``); none of them is ever passed on to ``function``.

    ``use_reentrant`` omitted (``None``): llmmem runs the non-reentrant checkpoint, as with
    ``use_reentrant=False``, where torch runs its reentrant one. Like torch, it warns (a
    ``UserWarning`` saying "the use_reentrant parameter should be passed explicitly", once per call
    site under Python's default filter), so that code and test suites written against torch see
    the same warning with llmmem swapped in; pass ``use_reentrant=False`` to silence it.

    :param function: what to run. If omitted (``checkpoint(**options)``), returns a decorator:
        ``checkpoint(use_reentrant=False)(fn)(*args, **kwargs)``, so that the options and the
        function's own keyword arguments never share a namespace.
    :param args: positional arguments; tensors may be nested in lists, tuples and dicts.
    :param use_reentrant: ``True`` delegates to torch's reentrant implementation (no kwargs, no
        ``torch.autograd.grad``, no nested containers; see torch's documentation); ``False`` or
        omitted: llmmem's non-reentrant region (omitted warns, see above).
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
    :param respect_saved_tensors_hooks: what happens to the tensors a *selective* checkpoint keeps
        (the outputs its policy saves: ``context_fn`` from torch's
        ``create_selective_checkpoint_contexts`` or ``llmmem.selective_context_fn``) when the caller
        has ``torch.autograd.graph.saved_tensors_hooks`` (``save_on_cpu``, an offloader) active
        around the call; torch 2.15's option, same semantics. ``False``: they bypass those hooks
        and stay where they are (the behaviour so far). ``True``: each goes through the caller's
        pack hook and comes back through its unpack hook when the recompute needs it. ``None`` (the
        default): as ``False``, with a ``FutureWarning`` when such hooks are active (torch will
        change its default). No effect on a region without a selective policy (it keeps nothing
        but its inputs), nor under ``torch.compile``. Requires ``use_reentrant=False``. Where torch
        packs each kept tensor as the policy keeps it, llmmem does so for its own
        ``selective_context_fn`` but, for torch's selective contexts, when the region's forward
        returns: within one region the kept tensors are on the device until then.
    :returns: what ``function`` returns (any structure; non-tensor outputs are fine).

    Backward calls under one ``torch.utils.checkpoint.GraphExecGroup`` (torch >= 2.10) share one
    recompute of the region, and may not need the same saved tensor twice, as with torch. Every
    bool option must be a bool (``TypeError`` otherwise; torch takes any object's truth). The
    errors carry the phrases of torch's (``A different number of tensors was saved``, ``Unpack is
    being triggered for a tensor that was already unpacked once``, ...), in llmmem's own words
    around them, so that code matching torch's messages keeps working.

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
        respect_saved_tensors_hooks=respect_saved_tensors_hooks,
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
    if use_reentrant is None:
        _warn_use_reentrant_omitted(stacklevel=2)
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
        # warned at each call, as torch's curried form does (the options were checked when built)
        if self._options["use_reentrant"] is None:
            _warn_use_reentrant_omitted(stacklevel=2)
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
    # torch's compile path takes its own no-op (its default) by identity, else dispatch modes;
    # llmmem's selective policy as torch's selective contexts, which the partitioner reads
    context_fn = opts["context_fn"]
    if context_fn is selective_context_fn:
        context_fn = compiled_selective_context_fn
    own = {} if context_fn is noop_context_fn else {"context_fn": context_fn}
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
                "(the function saved fewer tensors the second time)" + self._hints()
            )
        ticket = slot.tickets[key]
        if ticket is None:
            # torch's phrases (its own tests match them) inside llmmem's explanation
            group = (
                " Performing two backward calls that overlap (both needing this saved tensor) is not "
                "allowed under one torch.utils.checkpoint.GraphExecGroup: the calls of a group must "
                "differentiate non-overlapping parts of the graph."
                if not isinstance(key, int)
                else ""
            )
            raise CheckpointError(
                "llmmem.checkpoint: Unpack is being triggered for a tensor that was already unpacked once "
                "in this backward pass (each recomputed tensor is handed out once, then freed)."
                + group
                + " If a custom autograd.Function reads ctx.saved_tensors in its backward, read it only once"
                + (self._hints() if self.debug_logs is not None else "")
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
                "llmmem.checkpoint: trying to save more tensors during recomputation than during the "
                f"original forward ({len(self.slots)}): the function does not do the same work when run "
                "again" + self._hints()
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
                "llmmem.checkpoint: A different number of tensors was saved during the original forward "
                f"and recomputation: {len(self.slots)} in the forward, {self.count[key]} in the recompute. "
                "The function must do the same work when run again (no branches on global state, no "
                "inputs changed in between)" + self._hints()
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
                "llmmem.checkpoint: Recomputed values for the following tensors have different metadata "
                "than in the original forward (determinism_check='default' compares shape, dtype and "
                "device):\n"
                + "\n".join(diffs[:20])
                + ("\n  ..." if len(diffs) > 20 else "")
                + "\nThe function must compute the same thing when run again (determinism_check='none' "
                "skips this check)" + self._hints()
            )

    def _hints(self) -> str:
        """What follows a recompute-mismatch error: the debug logs (or how to get them), and the
        torch.compile cause with its two workarounds."""
        if self.debug_logs is None:
            debug = (
                ". To see the operators of the forward and of the recompute, each with the stack that ran "
                "it, pass debug=True (or use torch.utils.checkpoint.set_checkpoint_debug_enabled(True))."
            )
        else:
            debug = format_op_logs(*self.debug_logs)
        return debug + _COMPILE_HINT


# A region with a compiled function inside (checkpoint(torch.compile(block))) can recompute with
# another graph than its forward ran: Dynamo may pick the dynamic-shape graph it compiled meanwhile
# (pytorch/pytorch#166926). torch's mismatch errors name the two ways out; so do these.
_COMPILE_HINT = (
    "\nIf the function is (or calls) a torch.compile'd module and automatic dynamic shapes are on, the "
    "recompute may have run another compiled graph than the forward did (a dynamic-shape graph instead "
    "of the static one). Either mark the dimensions that vary as dynamic from the start with "
    "torch._dynamo.mark_dynamic(), or call torch._C._dynamo.eval_frame._set_lru_cache(False) so that "
    "Dynamo stops reordering its cache and both passes pick the same graph "
    "(see https://github.com/pytorch/pytorch/issues/166926)."
)


class _ForwardHooks(torch.autograd.graph.saved_tensors_hooks):
    """The region's pack/unpack pair. While the forward runs, its pack function carries the
    caller's own hooks (``outer_hooks``), so that a region nested in this one knows which hooks
    are the user's (:func:`_callers_hooks`); only while it runs, so that the saved graph does not
    hold the user's hooks (and through them, perhaps, itself)."""

    def __init__(self, region: _Region, outer_hooks) -> None:
        def pack(x):
            return region.pack(x)

        self._pack, self._outer_hooks = pack, outer_hooks
        super().__init__(pack, region.unpack)

    def __enter__(self):
        self._pack.llmmem_outer_hooks = self._outer_hooks
        return super().__enter__()

    def __exit__(self, *exc):
        del self._pack.llmmem_outer_hooks
        return super().__exit__(*exc)


class _RecomputeHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, region: _Region, key: int) -> None:
        # A weak reference: these hooks can outlive the recompute inside a graph built there
        # (backward inside the function), which must not keep the region alive.
        ref = weakref.ref(region)

        def pack(x):
            return ref().store_recomputed(key, x)

        # a region run again inside a recompute sees no hooks of the caller's (they belong to the forward)
        pack.llmmem_outer_hooks = None
        super().__init__(pack, lambda x: x)


# --------------------------------------------------------------------------------------------
# respect_saved_tensors_hooks: the tensors a selective policy keeps, and the caller's hooks

_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _callers_hooks():
    """The ``(pack, unpack)`` saved-tensor hooks the caller has active around this call, or None.

    The innermost pair on autograd's stack, unless it is a checkpoint's own: an enclosing llmmem
    region's forward hooks stand for the caller's hooks around that region; a recompute's, or
    torch's checkpoint's, for none."""
    if _top_saved_tensors_hooks is None:
        return None
    top = _top_saved_tensors_hooks(False)
    if top is None:
        return None
    pack = top[0]
    if hasattr(pack, "llmmem_outer_hooks"):
        return pack.llmmem_outer_hooks
    if getattr(pack, "__module__", None) == _torch_ckpt.__name__:
        return None
    return top


def _selective_kind(forward_ctx) -> str | None:
    """Which selective policy the forward context is: ``"torch"`` (its SAC caching mode),
    ``"llmmem"`` (``selective_context_fn``'s), or None: a region that keeps nothing of its own."""
    if isinstance(forward_ctx, _Keep):
        return "llmmem"
    caching = getattr(_torch_ckpt, "_CachingTorchDispatchMode", None)
    if (
        caching is not None
        and isinstance(forward_ctx, caching)
        and isinstance(getattr(forward_ctx, "storage", None), dict)
    ):
        return "torch"
    return None


class _CachedThroughHooks:
    """An entry of torch's selective-checkpoint cache, handed to the caller's hooks: what torch's
    cached mode reads back (``get_val``, ``val``) with its mutation check kept."""

    __slots__ = ("_through",)

    def __init__(self, entry, pack, unpack) -> None:
        self._through = ThroughHooks(entry.val, pack, unpack, version=entry.version)

    @property
    def val(self) -> torch.Tensor:
        return self._through.unpack()

    def get_val(self, allow_cache_entry_mutation: bool):
        if not allow_cache_entry_mutation and self._through.mutated():
            # torch's message for this case, so that code matching it keeps working
            raise RuntimeError("Tensor cached during selective activation checkpoint has been mutated")
        return self._through.unpack()


def _route_torch_cache(storage: dict, hooks) -> None:
    """Hand every tensor torch's selective caching mode kept in ``storage`` (per operator: a list,
    or a dict by call index, of output structures of ``_VersionWrapper``) to ``hooks``."""
    wrapper = getattr(_torch_ckpt, "_VersionWrapper", None)
    if wrapper is None:
        return

    def route(leaf):
        if isinstance(leaf, wrapper) and isinstance(leaf.val, torch.Tensor):
            return _CachedThroughHooks(leaf, *hooks)
        return leaf

    for per_op in storage.values():
        if isinstance(per_op, (list, dict)):
            for k in list(per_op.keys() if isinstance(per_op, dict) else range(len(per_op))):
                per_op[k] = pytree.tree_map(route, per_op[k])


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


def _hooks_for_kept(forward_ctx, callers_hooks, respect: bool | None):
    """The hooks the selective policy's kept tensors go through (``respect_saved_tensors_hooks``),
    or None: they stay as they are. Warns, as torch does, when the option was not chosen and it
    would make a difference."""
    kind = _selective_kind(forward_ctx)
    if kind is None or callers_hooks is None or respect is False:
        return None
    if respect is None:
        warnings.warn(
            "llmmem.checkpoint: this region's selective policy keeps tensors outside the "
            "saved_tensors_hooks active around the call, which therefore do not see them (the "
            "behaviour so far; torch will change its default). Pass respect_saved_tensors_hooks=True "
            "to hand the kept tensors to those hooks, or respect_saved_tensors_hooks=False to keep the "
            "present behaviour without this warning.",
            FutureWarning,
            stacklevel=5,  # _hooks_for_kept < _run_region < _run < checkpoint (or its decorator) < caller
        )
        return None
    if kind == "llmmem":
        forward_ctx.hooks = callers_hooks  # routed as each is kept
    return callers_hooks


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

    callers_hooks = _callers_hooks()
    route_kept_to = _hooks_for_kept(forward_ctx, callers_hooks, opts["respect_saved_tensors_hooks"])

    region = _Region(recompute, rebuild, early_stop, opts["determinism_check"] == "default")
    region.debug_logs = debug_logs
    # The anchor requires grad so the input node exists even when no input requires grad.
    anchor = torch.empty(0, requires_grad=True)
    region.inputs_keeper = _save_inputs(anchor, tensors, opts["offload"])

    with _ForwardHooks(region, callers_hooks), forward_ctx:
        out = function(*args, **kwargs)
    region.forward_done = True
    if route_kept_to is not None and not isinstance(forward_ctx, _Keep):
        # torch's caching mode has no place to route each tensor as it keeps it: done now, once the
        # region's forward has returned
        _route_torch_cache(forward_ctx.storage, route_kept_to)
    if rng is not None and not rng.cuda_was_initialized and torch.cuda.is_initialized():
        raise RuntimeError(
            "llmmem.checkpoint: CUDA was first initialised inside the checkpointed function, so its "
            "RNG state could not be saved; initialise CUDA before (e.g. move the model to the GPU) "
            "or pass preserve_rng_state=False"
        )
    return out
