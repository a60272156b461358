"""Recording a model's step: one real training step, with hooks on its chain of blocks.

:func:`record_step` runs the step once and gives a :class:`StepRecord`: each block's first call
(copied), whether each block's input is the previous block's output, the activation bytes of the
step around the chain (held before it and through it, the head's, the peak outside it) and the work
outside the blocks. The blocks run without a graph and unmetered (:class:`_PassThrough`): their own
costs are measured one by one afterwards (:mod:`llmmem.checkpointing.costs`).

Not here: keeping the random state and the gradients as they were (the caller's:
:func:`llmmem.checkpointing.profile.profile_model`), what a sample is and its step
(:mod:`llmmem.checkpointing.samples`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from llmmem.checkpointing.calls import BlockCall, find_hidden, hidden_of, without_cache
from llmmem.checkpointing.costs import block_signature
from llmmem.checkpointing.meters import ActivationMeter, storage_address, storage_bytes, tensor_bytes
from llmmem.checkpointing.samples import SAMPLE_FORMS
from llmmem.checkpointing.work import WorkCounter

__all__ = ["StepRecord", "record_step"]


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
    given = {storage_address(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    anchor = torch.empty(0, device=y.device, requires_grad=True)

    def mark(t):
        if t is y or t.requires_grad or not t.is_floating_point() or storage_address(t) in given:
            return t
        return _Fresh.apply(anchor, t)

    with _disable_current_modes():
        out = pytree.tree_map_only(torch.Tensor, mark, out)
    produced.update(storage_address(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t is not y)
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
                elif t is not h and storage_address(t) in produced:
                    # made by an earlier block (which runs unmetered here) and given to later ones,
                    # as T5's position bias: held until the chain's backward, by their tapes
                    side[storage_address(t)] = storage_bytes(t)
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
            key = block_signature(module, call)
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
                sizes["out"] = tensor_bytes(h)
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
