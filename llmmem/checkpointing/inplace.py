"""A checkpointing plan run on blocks that the model's own code calls one at a time.

:func:`llmmem.auto_checkpoint` on a whole model gives each block of the chain an instance-level
``forward`` (the class, the parameters, ``state_dict`` keys, ``named_modules`` and the model's own
loop are untouched; :meth:`ChainRunner.remove` takes it away). A block called outside any region
runs in its mode. The regions of the plan span several blocks, each called separately, with the
model's code in between; they run as nested non-reentrant checkpoints would:

* forward: entering a region saves its input (through an autograd node, so the enclosing region's
  hooks, or the offload hooks, decide where it lives); every block inside runs under the hooks of
  its innermost region, which keep a placeholder instead of each tensor saved for backward. A
  region's input is such a tensor for the region around it. Each block's call (its other
  arguments, random state and autocast state) is recorded for the recompute.
* backward: the first placeholder of a region that autograd needs, once per backward pass, has the
  region re-run from its input: its blocks one after the other, each fed the previous one's output
  (valid because the forward checked that each block got exactly that), their saved tensors handed
  to the placeholders, the blocks inside a nested region run only to get its input and keep
  nothing. The re-run stops once every placeholder is filled.

If the model feeds a block something other than the previous block's output in the middle of a
region, the region cannot be re-run: from that block on, until the region ends, each block is
checkpointed alone (a warning says so once); gradients stay exact, memory is then not the plan's.

A recompute must not write a key/value cache a second time: while gradients are on, every planned
block gets ``use_cache=False`` and no cache, as Hugging Face's ``GradientCheckpointingLayer`` does for
the layers it checkpoints (with gradients off, for generation, blocks run as they are).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import types
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from llmmem.checkpointing import compile_notes
from llmmem.checkpointing.calls import find_hidden, hidden_of, without_cache
from llmmem.checkpointing.compiled import compile_bodies, disable_between_graphs
from llmmem.checkpointing.core import checkpoint
from llmmem.checkpointing.errors import CheckpointError
from llmmem.checkpointing.modes import run_call
from llmmem.checkpointing.offload import HostCopies, offload_without_prefetch
from llmmem.checkpointing.replay import RngState, accelerator_type, autocast_state
from llmmem.checkpointing.selective import selective_context_fn
from llmmem.errors import user_stacklevel
from llmmem.units import format_bytes

__all__ = ["ChainRunner", "RUNNER_OPTIONS", "checkpointing_flags_off", "own_forward", "restore_flags"]

# llmmem.checkpoint options a plan on a whole model can take
RUNNER_OPTIONS = ("preserve_rng_state", "determinism_check", "early_stop")

_MODULE_CALLS = frozenset(
    f.__code__ for f in (torch.nn.Module._call_impl, getattr(torch.nn.Module, "_wrapped_call_impl", None)) if f
)
_INSIDE = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # llmmem
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def _model_caller_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that points at the
    line that called the outermost module running (the user's ``model(**batch)``), past the model's
    own code (a Hugging Face modeling file calling its layers), llmmem's and torch's: where the user
    can change the call. Without a module call on the stack (a recompute on autograd's thread), the
    first frame outside llmmem and torch, as ``llmmem.errors.user_stacklevel`` finds it."""
    frame, level = sys._getframe(2), 2
    outermost = None
    while frame is not None:
        if frame.f_code in _MODULE_CALLS:
            outermost = (frame.f_back, level + 1)
        frame, level = frame.f_back, level + 1
    frame, level = outermost if outermost is not None else (sys._getframe(2), 2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


class _Keep(torch.autograd.Function):
    """Saves a region's input through the active saved-tensor hooks; its output is never differentiated."""

    @staticmethod
    def forward(ctx, anchor, tensor):
        ctx.save_for_backward(tensor)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - the output is never used
        raise RuntimeError("llmmem.auto_checkpoint: internal node was differentiated (please report)")


class _Stop(Exception):
    """Raised inside a region's re-run once every placeholder of the region is filled."""


class _Ticket:
    __slots__ = ("__weakref__",)


class _Slot:
    """What a block inside a region saves instead of a tensor: per backward pass, its value's ticket."""

    __slots__ = ("tickets", "__weakref__")

    def __init__(self) -> None:
        self.tickets: dict = {}


_unique_pass_ids = itertools.count(start=-2, step=-1)


def _pass_id() -> int:
    gid = torch._C._current_graph_task_id()
    return next(_unique_pass_ids) if gid == -1 else gid


def _never_unpacked(_):  # pragma: no cover - a discarded re-run's graph is never differentiated
    raise RuntimeError("llmmem.auto_checkpoint: a discarded tensor was needed (please report)")


@dataclass
class _Call:
    """One block call inside a region, as its re-run replays it (the chain input left out)."""

    fn: object
    args: tuple
    kwargs: dict
    hidden: int | str
    requires_grad: bool
    rng: RngState | None
    autocast: dict

    def run(self, h):
        h = h.detach().requires_grad_(self.requires_grad)
        if isinstance(self.hidden, int):
            args = list(self.args)
            args[self.hidden] = h
            args, kwargs = tuple(args), self.kwargs
        else:
            args, kwargs = self.args, {**self.kwargs, self.hidden: h}
        with contextlib.ExitStack() as stack:
            if self.rng is not None:
                stack.enter_context(self.rng.restored())
            for dev, state in self.autocast.items():
                stack.enter_context(torch.amp.autocast(dev, **state))
            stack.enter_context(torch.enable_grad())
            return hidden_of(self.fn(*args, **kwargs))


class _Span:
    """One region of the plan during one forward pass, alive while its placeholders are."""

    def __init__(self, runner: ChainRunner, start: int, end: int, calls: dict) -> None:
        self.start, self.end = start, end
        self.children = runner.children.get((start, end), {})
        self.calls = calls  # block index -> _Call, shared by the regions of one forward pass
        self.early_stop = runner.options.get("early_stop", True)
        self.check = runner.options.get("determinism_check", "default") == "default"
        self.keeper = None
        self.last = start - 1  # the last block that ran inside it (less than end - 1 if the chain broke)
        self.slots: list = []
        self.meta: list = []
        self.values: dict = defaultdict(weakref.WeakKeyDictionary)
        self.count: dict = defaultdict(int)
        self.recomputed: set = set()

    def keep_input(self, h: torch.Tensor, parent: _Span | None, offload: bool) -> None:
        anchor = torch.empty(0, requires_grad=True)  # so the node exists even if h needs no grad
        if parent is not None:
            with parent.hooks():
                self.keeper = _Keep.apply(anchor, h)
        elif offload:
            with offload_without_prefetch():
                copies = HostCopies()
            with torch.autograd.graph.saved_tensors_hooks(copies.pack, copies.unpack):
                self.keeper = _Keep.apply(anchor, h)
        else:
            self.keeper = _Keep.apply(anchor, h)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # forward ---------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Slot:
        slot = _Slot()
        self.slots.append(weakref.ref(slot))
        if self.check:
            self.meta.append((tuple(t.shape), t.dtype, t.device))
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        key = _pass_id()
        if key not in self.recomputed:
            self._recompute(key)
        ticket = slot.tickets.get(key)
        if ticket is None:
            raise CheckpointError(
                "llmmem.auto_checkpoint: a saved tensor was not rebuilt by the recompute, or was needed twice in one "
                f"backward pass (region of blocks [{self.start}, {self.end}))"
            )
        slot.tickets[key] = None
        return self.values[key].pop(ticket)

    # backward --------------------------------------------------------------------------------
    def _store(self, key: int, t: torch.Tensor) -> torch.Tensor:
        t = t.detach() if t.requires_grad else t
        index = self.count[key]
        self.count[key] += 1
        if index >= len(self.slots):
            raise CheckpointError(
                f"llmmem.auto_checkpoint: the recompute of blocks [{self.start}, {self.end}) saved more tensors for "
                f"backward than their forward ({len(self.slots)}): the blocks do not do the same work when run again"
            )
        slot = self.slots[index]()
        if slot is not None:
            ticket = _Ticket()
            slot.tickets[key] = ticket
            self.values[key][ticket] = t
        if self.early_stop and self.count[key] == len(self.slots):
            raise _Stop
        return t

    def _recompute(self, key: int) -> None:
        (h,) = self.keeper.grad_fn.saved_tensors  # may re-run the region around this one first
        store = torch.autograd.graph.saved_tensors_hooks(lambda t: self._store(key, t), lambda t: t)
        discard = torch.autograd.graph.saved_tensors_hooks(lambda t: None, _never_unpacked)
        try:
            j = self.start
            while j <= self.last:
                child_end = self.children.get(j)
                if child_end is not None:
                    child_end = min(child_end, self.last + 1)
                    # the forward saved the nested region's input here, and nothing of its blocks
                    self._store(key, h)
                    with discard:
                        for b in range(j, child_end):
                            h = self.calls[b].run(h)
                    j = child_end
                else:
                    with store:
                        h = self.calls[j].run(h)
                    j += 1
        except _Stop:
            pass
        self.recomputed.add(key)
        self._check(key)

    def _check(self, key: int) -> None:
        if self.count[key] != len(self.slots):
            raise CheckpointError(
                f"llmmem.auto_checkpoint: the recompute of blocks [{self.start}, {self.end}) saved {self.count[key]} "
                f"tensors for backward, their forward {len(self.slots)}: the blocks must do the same work when run again"
            )
        if not self.check:
            return
        for i, ref in enumerate(self.slots):
            slot = ref()
            ticket = slot.tickets.get(key) if slot is not None else None
            if ticket is None:
                continue
            t = self.values[key][ticket]
            got = (tuple(t.shape), t.dtype, t.device)
            if got != self.meta[i]:
                raise CheckpointError(
                    f"llmmem.auto_checkpoint: the recompute of blocks [{self.start}, {self.end}) gave tensor #{i} as "
                    f"shape={list(got[0])} dtype={got[1]} device={got[2]}, the forward saved shape="
                    f"{list(self.meta[i][0])} dtype={self.meta[i][1]} device={self.meta[i][2]}"
                )


class _Pass:
    """State of one forward pass through the chain."""

    def __init__(self) -> None:
        self.stack: list = []  # open regions, outermost first
        self.calls: dict = {}
        self.last = -1
        self.last_out = None


def checkpointing_flags_off(blocks) -> list:
    """Turn Hugging Face's own checkpointing of each block off (it would recompute a planned block a
    second time, and profile it as keeping nothing); returns what to give :func:`restore_flags`."""
    saved = []
    for block in blocks:
        saved.append(("gradient_checkpointing" in block.__dict__, block.__dict__.get("gradient_checkpointing")))
        if getattr(block, "gradient_checkpointing", False) is True:
            block.gradient_checkpointing = False
    return saved


def restore_flags(blocks, saved: list) -> None:
    for block, (had, flag) in zip(blocks, saved):
        if had:
            block.__dict__["gradient_checkpointing"] = flag
        else:
            block.__dict__.pop("gradient_checkpointing", None)


def _flags_guard(runner, module, args) -> None:
    """The model's forward pre-hook of :meth:`ChainRunner.guard` (a module-level function, so that
    a model saved whole keeps it)."""
    if runner.active and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        for j, block in enumerate(runner.blocks):
            if block.__dict__.get("gradient_checkpointing") is True:
                runner._hf_checkpointing_on_again(j, before_step=True)
                return


def _planned_forward(self, *args, **kwargs):
    """The instance-level ``forward`` of a planned block, as ``functools.partial(_planned_forward,
    block)``: a bound method would be pickled as a lookup of its name on the loaded block, which has
    no such attribute; a partial of a module-level function pickles (and deep-copies) as itself."""
    runner, index = self.__dict__["_llmmem_chain"]
    return runner.call(index, args, kwargs)


def own_forward(block):
    """The forward a block runs without a plan: its instance-level one if it has one, else its
    class's, bound to it."""
    own = block.__dict__.get("forward")
    return own if own is not None else types.MethodType(type(block).forward, block)


def _planned_forward_between_graphs(self, *args, **kwargs):
    """The instance-level ``forward`` of a block of a plan that compiles its blocks: where Dynamo
    traces the model, its graph breaks at the block's call (once per block, with no guard on which
    block it is, so no recompilation per block) and the plan runs eagerly."""
    runner, index = self.__dict__["_llmmem_chain"]
    return runner.call(index, args, kwargs)


_planned_forward_between_graphs = disable_between_graphs(_planned_forward_between_graphs)


class ChainRunner:
    """Runs ``plan`` on ``blocks`` called by the model's own code (module docstring).

    :param blocks: the chain's modules, in order.
    :param plan: a :class:`llmmem.checkpointing.plan.CheckpointPlan` for them.
    :param hidden: where each block's chain input is in its call (index or keyword).
    :param options: :data:`RUNNER_OPTIONS` of :func:`llmmem.checkpoint`.
    """

    def __init__(
        self,
        blocks,
        plan,
        hidden,
        options: dict,
        saved_flags: list | None = None,
        shapes=None,
        starts=None,
        compile_options: dict | None = None,
        bodies: dict | None = None,
    ) -> None:
        unknown = set(options) - set(RUNNER_OPTIONS)
        if unknown:
            raise TypeError(
                f"auto_checkpoint: unexpected option(s) {sorted(unknown)}; a plan on a whole model takes "
                f"{list(RUNNER_OPTIONS)}"
            )
        self.blocks = list(blocks)
        self.hidden = list(hidden) if hidden else [0] * len(self.blocks)
        self.options = dict(options)
        self.shapes = shapes  # a llmmem.checkpointing.reshape.ShapePlans: re-plans at other shapes
        # the first block of each stack (the chain's, a decoder's after an encoder): shapes are checked there
        self.starts = list(starts) if starts else plan.profile.stack_starts
        # the shape buckets of the stacks in the pass under way, and the largest each has met
        self.shape_key = self.largest_key = shapes.base_key if shapes is not None else None
        # torch.compile's options for the blocks the plan compiles itself (None: it compiles none;
        # llmmem.checkpointing.compiled), and those compiled blocks, made at their first call
        self.compile_options = compile_options
        self._bodies: dict | None = bodies
        self._use(plan)
        self.originals: list = []
        self._saved_flags = saved_flags
        self._pass: _Pass | None = None
        self._warned: set = set()
        self.active = False
        self.owner = None  # the AutoCheckpointPlan that runs it, if any

    def _use(self, plan) -> None:
        """Run ``plan`` from the next forward pass on (the regions of a pass under way keep theirs)."""
        self.plan = plan
        self.modes = list(plan.modes)
        self.offloaded = set(plan.offloaded)
        regions = sorted({tuple(r) for r in plan.regions}, key=lambda r: (r[0], -r[1]))
        self.starting = defaultdict(list)  # block -> regions starting there, outermost first
        self.enclosing = defaultdict(list)  # block -> regions containing it that start before it
        self.children: dict = {}  # region -> {start: end} of the regions directly inside it
        for s, e in regions:
            self.starting[s].append((s, e))
            for j in range(s + 1, e):
                self.enclosing[j].append((s, e))
            inside = [r for r in regions if s <= r[0] and r[1] <= e and r != (s, e)]
            direct, reach = {}, s
            for rs, re_ in inside:
                if rs >= reach:
                    direct[rs] = re_
                    reach = re_
            self.children[(s, e)] = direct
        # what a compiled model does otherwise than the plan (see _traced_call)
        changes = []
        if any(e - s > 1 for s, e in regions):
            changes.append("regions of several blocks run as one checkpoint per block")
        if "recompute-cheap" in self.modes:
            changes.append("recompute-cheap blocks run as selective checkpoints (matmul outputs kept)")
        if self.offloaded:
            changes.append("offloaded region inputs stay on the device")
        # a plan of compiled blocks runs as made, compiled model or not
        self.compile_changes = "; ".join(changes) if self.compile_options is None else ""
        self._watch_compile()

    def _watch_compile(self) -> None:
        """Have the next compilation say what a compiled model does otherwise than this plan."""
        if self.compile_changes and not torch.compiler.is_compiling():
            compile_notes.watch(
                f"llmmem.auto_checkpoint and torch.compile: where a compiled model runs the blocks of this plan "
                f"({type(self.blocks[0]).__name__} x {len(self.blocks)}), {self.compile_changes}: it recomputes "
                "what the plan recomputes, but its memory is not the plan's and may exceed the budget. The plan "
                "runs as made when the model is not compiled as a whole, or when planned with compile_blocks=True "
                "(the plan compiles the blocks itself and budgets them as compiled)",
                owner=self,
            )

    # saving --------------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """A planned model pickled whole (``torch.save(model)``, ``copy.deepcopy``) keeps its plan.
        A block's own class ``forward`` is kept as None: pickled as a bound method it would be looked
        up by name on the loaded block, and found to be the planned one. A forward pass under way is
        not kept (it holds weak references to tensors)."""
        state = self.__dict__.copy()
        state["originals"] = [
            None if isinstance(f, types.MethodType) and f.__func__ is type(b).forward and f.__self__ is b else f
            for f, b in zip(self.originals, self.blocks)
        ]
        state["_pass"] = None
        state["_bodies"] = None  # compiled again when first called
        return state

    def __setstate__(self, state: dict) -> None:
        # saved before they existed
        self.__dict__.update(
            {
                "shapes": None,
                "starts": [0],
                "shape_key": None,
                "largest_key": None,
                "compile_changes": "",
                "compile_options": None,
                "_bodies": None,
                **state,
            }
        )
        # the blocks may not have their state yet (they are being loaded): only their type is read
        self.originals = [
            types.MethodType(type(b).forward, b) if f is None else f for f, b in zip(self.originals, self.blocks)
        ]
        if self.compile_changes and self.blocks:
            self._watch_compile()

    # installing --------------------------------------------------------------------------------
    def install(self) -> None:
        for i, block in enumerate(self.blocks):
            if "_llmmem_chain" in block.__dict__:
                raise ValueError(
                    f"auto_checkpoint: block {i} ({type(block).__name__}) already runs a plan; remove() it first"
                )
        if self._saved_flags is None:
            self._saved_flags = checkpointing_flags_off(self.blocks)
        for i, block in enumerate(self.blocks):
            self.originals.append(own_forward(block))
            block.__dict__["_llmmem_chain"] = (self, i)
            forward = _planned_forward if self.compile_options is None else _planned_forward_between_graphs
            block.__dict__["forward"] = functools.partial(forward, block)
        self.active = True

    def remove(self) -> None:
        """Give every block its own ``forward`` back (and Hugging Face's checkpointing flag)."""
        if not self.active:
            return
        model = self.__dict__.pop("guarded", None)
        if model is not None:
            hooks = model._forward_pre_hooks
            for key, hook in list(hooks.items()):
                if isinstance(hook, functools.partial) and hook.func is _flags_guard and hook.args[0] is self:
                    del hooks[key]
        for block, original in zip(self.blocks, self.originals):
            block.__dict__.pop("_llmmem_chain", None)
            if isinstance(original, types.MethodType) and original.__func__ is type(block).forward:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = original
        restore_flags(self.blocks, self._saved_flags)
        self._pass = None
        self._bodies = None  # the compiled blocks are freed with the plan
        self.active = False

    # running -------------------------------------------------------------------------------------
    def _warn_once(self, key: str, message: str, *, at_model_call: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            level = _model_caller_stacklevel() if at_model_call else user_stacklevel()
            warnings.warn(message, stacklevel=level)

    def guard(self, model) -> None:
        """Check Hugging Face's checkpointing flags of the blocks at each call of ``model``, before
        any block runs (a forward pre-hook, removed with the plan)."""
        model.register_forward_pre_hook(functools.partial(_flags_guard, self))
        self.guarded = model

    def _hf_checkpointing_on_again(self, j: int, before_step: bool) -> None:
        """Hugging Face's checkpointing was turned on after planning (``gradient_checkpointing_enable()``,
        which the Trainer's ``activation_checkpointing=True`` calls): it would wrap each planned block's
        call in a checkpoint of its own, recomputing the blocks twice. Turned off again (``remove()``
        turns it back on)."""
        self._saved_flags = checkpointing_flags_off(self.blocks)
        when = (
            "before this step: the plan alone recomputes them"
            if before_step
            else "(this step recomputes them twice, the next ones follow the plan)"
        )
        self._warn_once(
            "hf-checkpointing",
            f"llmmem.auto_checkpoint: Hugging Face's gradient checkpointing was enabled on the planned blocks "
            f"({type(self.blocks[j]).__name__}) after planning; the plan turns it off again {when}; plan.remove() "
            "turns it back on. With a plan leave it off: Trainer's activation_checkpointing (gradient_checkpointing) False",
            at_model_call=True,
        )

    def _adapt(self, h: torch.Tensor, stack: int) -> None:
        """At the first block of a stack (the chain's first, or a decoder's after an encoder): the
        plan for this input's shape (re-planned from the profile the first time its bucket is met;
        a stack's blocks never share a region with the stack before, so the later stacks may change
        plan while the earlier ones have run), or, without re-planning, a warning when the chain's
        input is larger than the plan's."""
        shapes = self.shapes
        if shapes is None:
            self._check_shape(h, self.starts[stack])
            return
        now = h.numel() * h.element_size()
        # The first stack plans with the later stacks at the largest bucket they have met (a decoder
        # runs after the encoder has: its length is not known yet, and the last step's may be short);
        # each later stack then plans for its own, its plan never holding more of the earlier ones.
        seen = list(self.largest_key)
        key = list(seen if stack == 0 else self.shape_key)
        assumed = key[stack]
        key[stack] = shapes.bucket(stack, now)
        if stack > 0 and key[stack] > assumed:
            self._warn_once(
                f"longer{stack}:{key[stack]}",
                f"llmmem.auto_checkpoint: block {self.starts[stack]} starts a stack whose input ({list(h.shape)}, "
                f"{format_bytes(now)}) is larger than the stacks before it were planned for in this step (they "
                "ran first): this step may exceed the budget; the next ones plan them for this size (warned once "
                "per size)",
                at_model_call=True,
            )
        seen[stack] = max(seen[stack], key[stack])
        key = tuple(key)
        self.shape_key, self.largest_key = key, seen
        plan, new = shapes.plan_for(key)
        if plan is not self.plan:
            self._use(plan)
        if new and key in shapes.infeasible:
            self._warn_once(
                f"infeasible{key}",
                f"llmmem.auto_checkpoint: at this forward's input ({list(h.shape)}, {h.dtype}, {format_bytes(now)}; "
                f"the plan was made for {format_bytes(shapes.input_bytes[stack])}) {shapes.infeasible[key][1]}. "
                f"Running the plan of least memory, predicted peak {format_bytes(plan.predicted_peak_bytes)} (warned "
                "once per shape)",
                at_model_call=True,
            )

    def _check_shape(self, h: torch.Tensor, j: int) -> None:
        """Warns once if a stack's input (the chain's, a decoder's) is larger than the one the plan
        was made for: the plan's peak grows with the tokens of a batch, past its budget. Smaller
        inputs fit."""
        if "shape" in self._warned:
            return
        planned = int(self.plan.profile.input_bytes[j]) if self.plan.profile.input_bytes else 0
        now = h.numel() * h.element_size()
        if not planned or now <= planned * 1.05:
            return
        ratio = now / planned
        peak = self.plan.predicted_peak_bytes * ratio
        which = "first block" if j == 0 else f"block {j} (a stack's first)"
        self._warn_once(
            "shape",
            f"llmmem.auto_checkpoint: the plan was made for a {which} input of {format_bytes(planned)}; this "
            f"forward's ({list(h.shape)}, {h.dtype}) is {format_bytes(now)}, {ratio:.2f}x as large. The step's "
            f"activations grow with it: expect a peak of about {format_bytes(peak)} (more where attention keeps "
            f"s x s scores) against the budget of {format_bytes(self.plan.budget_bytes)}. Plan with a batch of the "
            "largest shape the loop will see (warned once).",
            at_model_call=True,
        )

    def _hidden(self, j: int, args: tuple, kwargs: dict):
        where = self.hidden[j]
        if isinstance(where, int) and where < len(args) and isinstance(args[where], torch.Tensor):
            return where, args[where]
        if isinstance(where, str) and isinstance(kwargs.get(where), torch.Tensor):
            return where, kwargs[where]
        where, _ = find_hidden(args, kwargs)
        if where is None:
            return None, None
        return where, args[where] if isinstance(where, int) else kwargs[where]

    def _strip_cache(self, j: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs, changed = without_cache(args, kwargs)
        if changed:
            self._warn_once(
                "cache",
                f"llmmem.auto_checkpoint: caching is incompatible with recomputing {type(self.blocks[j]).__name__}: "
                f"{', '.join(changed)} for the planned blocks while gradients are on",
                at_model_call=True,  # the user's call of the model is where use_cache=False goes
            )
        return args, kwargs

    def body(self, j: int, mode: str = "store-all"):
        """What runs block ``j``: its own forward, or that forward compiled by the plan (in ``mode``:
        ``"store-all"``, or ``"selective"`` with the policy compiled in)."""
        if self.compile_options is None:
            return self.originals[j]
        if self._bodies is None:
            self._bodies = compile_bodies(self.originals, self.compile_options)
        return self._bodies[mode][j]

    def call(self, j: int, args: tuple, kwargs: dict):
        if torch.compiler.is_compiling():
            # (a plan of compiled blocks never gets here: its blocks' forward is not traced)
            return self._traced_call(j, args, kwargs)
        fn = self.body(j)
        if not torch.is_grad_enabled():
            self._pass = None
            return fn(*args, **kwargs)
        where, h = self._hidden(j, args, kwargs)
        if h is None:
            self._pass = None
            return fn(*args, **kwargs)
        if self.blocks[j].__dict__.get("gradient_checkpointing") is True:
            self._hf_checkpointing_on_again(j, before_step=False)
        if j in self.starts:
            self._adapt(h, self.starts.index(j))
        st = self._pass
        if st is None or j != st.last + 1 or st.last_out is None or st.last_out() is not h:
            st = self._pass = _Pass()
        while st.stack and st.stack[-1].end <= j:
            st.stack.pop()
        expected = self.enclosing.get(j, [])
        if [(s.start, s.end) for s in st.stack] != expected:
            # a region of the plan started before j and cannot be re-run up to here: check the
            # blocks one by one until it ends
            self._warn_once(
                "broken",
                f"llmmem.auto_checkpoint: block {j} did not get the previous block's output, inside a region of the "
                "plan that spans several blocks; such blocks are checkpointed one by one (gradients are exact, "
                "memory is not the plan's). Give the blocks the model calls one after the other.",
            )
            st.stack = []
            regions = self.starting.get(j) or [(j, j + 1)]
        else:
            regions = self.starting.get(j, [])
        for s, e in regions:
            span = _Span(self, s, e, st.calls)
            parent = st.stack[-1] if st.stack else None
            span.keep_input(h, parent, offload=parent is None and (s, e) in self.offloaded)
            st.stack.append(span)
        mode = self.modes[j]
        # every block, recomputed or not: a cache written by some layers only is of no use, and the
        # plan's memory is that of blocks that write none
        args, kwargs = self._strip_cache(j, args, kwargs)
        if st.stack:
            st.calls[j] = self._record(fn, args, kwargs, where, h)
            for span in st.stack:
                span.last = j
            with st.stack[-1].hooks():
                out = fn(*args, **kwargs)
        elif mode == "store-all":
            out = fn(*args, **kwargs)
        elif self.compile_options is not None:
            out = self.body(j, mode)(*args, **kwargs)
        else:
            opts = {k: v for k, v in self.options.items() if k in RUNNER_OPTIONS}
            out = run_call(fn, args, kwargs, mode, self.blocks[j], **opts)
        st.last = j
        st.last_out = weakref.ref(hidden_of(out))
        if j == len(self.blocks) - 1:
            self._pass = None
        return out

    def _traced_call(self, j: int, args: tuple, kwargs: dict):
        """Block ``j`` while Dynamo traces the model (``torch.compile``): each block alone, as the
        compiled graph can carry it (torch's checkpoint, lowered to a higher-order operator, with a
        selective policy for the modes that keep part of the tape). A region spanning several blocks
        is a chain of one-block checkpoints here, which keeps each block's input instead of the
        region's first: the plan's recompute, not exactly its memory."""
        fn = self.originals[j]
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        args, kwargs, _ = without_cache(args, kwargs)
        mode = self.modes[j]
        options = {k: v for k, v in self.options.items() if k in RUNNER_OPTIONS}
        if self.enclosing.get(j) or self.starting.get(j) or mode == "store-input-only":
            return checkpoint(fn, *args, use_reentrant=False, **options, **kwargs)
        if mode in ("selective", "recompute-cheap"):
            # recompute-cheap's hooks see the compiled graph's saved tensors, not the block's: the
            # selective policy (keep matmuls, recompute the rest) is what the graph can carry
            return checkpoint(fn, *args, use_reentrant=False, context_fn=selective_context_fn, **options, **kwargs)
        return fn(*args, **kwargs)

    def _record(self, fn, args: tuple, kwargs: dict, where, h: torch.Tensor) -> _Call:
        if isinstance(where, int):
            args = args[:where] + (None,) + args[where + 1 :]
        else:
            kwargs = {**kwargs, where: None}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)] + [h]
        rng = RngState(tensors) if self.options.get("preserve_rng_state", True) else None
        autocast = {"cpu": autocast_state("cpu")}
        accel = accelerator_type(tensors)
        if accel is not None and torch.amp.is_autocast_available(accel):
            autocast[accel] = autocast_state(accel)
        return _Call(fn, args, kwargs, where, h.requires_grad, rng, autocast)
