"""Where a model's repeated blocks are: :func:`find_blocks` (one chain) and :func:`find_stacks` (every
stack a step runs one after the other: the encoder and decoder of T5, BART or Whisper, a vision
tower before a language model), and what :func:`llmmem.auto_checkpoint` left out and why."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from llmmem.checkpointing.blocks import check_distinct
from llmmem.checkpointing.profile import kept_state
from llmmem.checkpointing.samples import forward_of, is_step

__all__ = ["Stack", "find_blocks", "find_stacks", "order_by_calls", "resolve_blocks"]


@dataclass(frozen=True)
class Stack:
    """A container of repeated blocks: its dotted path in the model, its blocks, and whether it is
    planned (``reason`` says why not)."""

    name: str
    blocks: tuple
    planned: bool = True
    reason: str = ""

    @property
    def kinds(self) -> str:
        return ", ".join(sorted({type(b).__name__ for b in self.blocks}))

    def describe(self) -> str:
        text = f"{self.name!r} ({len(self.blocks)} x {self.kinds})"
        return text if self.planned else f"{text}: {self.reason}"


def _is_stack(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2 and len({type(c) for c in m}) == 1


def _candidates(model: nn.Module) -> tuple[list, int]:
    """The stacks of ``model`` worth listing, in registration order, and which of them is the
    longest (the first on a tie, as :func:`find_blocks` picks it). Left out silently: a stack inside
    another's blocks (a mixture of experts' experts) and one holding the longest (the stages of a
    hierarchical model, whose blocks are the stacks inside them)."""
    stacks = [(name, m) for name, m in model.named_modules() if _is_stack(m)]
    if not stacks:
        return [], -1
    longest = max(range(len(stacks)), key=lambda i: (len(stacks[i][1]), -i))
    top = stacks[longest][1]
    found, inside = [], set()
    for i, (name, m) in enumerate(stacks):
        if id(m) in inside or (i != longest and any(d is top for d in m.modules())):
            continue
        found.append((name, m, i == longest))
        inside.update(id(d) for d in m.modules() if d is not m)
    return found, next(j for j, f in enumerate(found) if f[2])


def _composite(block: nn.Module) -> bool:
    """A block of a model's own (a layer of several modules), not one of torch.nn's leaves."""
    return not type(block).__module__.startswith("torch.nn") and any(True for _ in block.children())


def _longest(model: nn.Module) -> tuple[str, list]:
    found, longest = _candidates(model)
    if not found:
        find_stacks(model)  # raises, saying what to do
    return found[longest][0], list(found[longest][1])


def find_stacks(model: nn.Module) -> list:
    """Every stack of repeated blocks in ``model``, as :class:`Stack` objects in the order the model
    holds them: the longest (the first on a tie) and every other stack of composite blocks
    (classes of the model's own, not torch.nn layers) that has a parameter that trains are planned;
    the others are listed with the reason they are left out."""
    found, longest = _candidates(model)
    if not found:
        raise ValueError(
            f"auto_checkpoint: found no nn.ModuleList or nn.Sequential of two or more blocks of one class in "
            f"{type(model).__name__}; name the blocks with blocks= (a path such as 'model.layers', or the modules)"
        )
    stacks = []
    for i, (name, m, _) in enumerate(found):
        reason = ""
        if i != longest:
            if not _composite(m[0]):
                reason = f"{type(m[0]).__name__} is a torch.nn layer, not a block of the model's own"
            elif not any(p.requires_grad for p in m.parameters()):
                reason = "frozen (no parameter trains); name it in blocks= to plan it if its input needs a gradient"
        stacks.append(Stack(name, tuple(m), planned=not reason, reason=reason))
    return stacks


def find_blocks(model: nn.Module, blocks=None) -> tuple[str, list]:
    """``(name, blocks)``: the chain of repeated blocks of ``model``.

    ``blocks=None``: the longest ``nn.ModuleList`` or ``nn.Sequential`` whose children (at least two)
    are all of one class, the first found (outermost) on a tie (a transformer's layers). Or name it:
    a dotted path (``"model.layers"``), the container itself, or a list of ``model``'s submodules.
    :func:`find_stacks` finds every stack (an encoder and a decoder).
    """
    if blocks is None:
        name, found = _longest(model)
    else:
        name, found = _named_blocks(model, blocks)
    check_distinct(found, f"auto_checkpoint: {name!r}")
    return name, found


def resolve_blocks(model: nn.Module, blocks) -> list:
    """The stacks :func:`llmmem.auto_checkpoint` plans, planned ones first in the model's order,
    then those left out: every stack (``blocks=None``), one (a path, a container, a list of
    modules) or several (a list of dotted paths or of ``nn.ModuleList``, in the order the model
    calls them)."""
    if blocks is None:
        stacks = find_stacks(model)
    elif isinstance(blocks, (list, tuple)) and blocks and all(isinstance(b, (str, nn.ModuleList)) for b in blocks):
        # dotted paths, or the containers (a ModuleList is never a block: it has no forward)
        stacks = [Stack(*_as_stack(_named_blocks(model, b))) for b in blocks]
    else:
        stacks = [Stack(*_as_stack(_named_blocks(model, blocks)))]
    planned = [s for s in stacks if s.planned]
    check_distinct(
        [b for s in planned for b in s.blocks], f"auto_checkpoint: {' + '.join(repr(s.name) for s in planned)}"
    )
    return planned + [s for s in stacks if not s.planned]


def _as_stack(named: tuple) -> tuple:
    return named[0], tuple(named[1])


def _named_blocks(model: nn.Module, blocks) -> tuple[str, list]:
    if isinstance(blocks, str):
        try:
            container = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(
                f"auto_checkpoint: blocks={blocks!r} is not a submodule of {type(model).__name__} ({e})"
            ) from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
            raise ValueError(
                f"auto_checkpoint: blocks={blocks!r} is a {type(container).__name__}; expected a non-empty "
                "nn.ModuleList or nn.Sequential"
            )
        return blocks, list(container)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential, list, tuple)):
        found = list(blocks)
        if not found or not all(isinstance(b, nn.Module) for b in found):
            raise TypeError("auto_checkpoint: blocks must hold one or more nn.Module")
        names = {id(m): n for n, m in model.named_modules()}
        name = names.get(id(blocks))
        outside = [i for i, b in enumerate(found) if id(b) not in names]
        if outside:
            raise ValueError(f"auto_checkpoint: blocks[{outside[0]}] is not a submodule of {type(model).__name__}")
        return (name if name is not None else f"{len(found)} blocks"), found
    raise TypeError(
        f"auto_checkpoint: blocks must be None, a dotted submodule path, an nn.ModuleList/nn.Sequential, a list "
        f"of modules or a list of paths, got {type(blocks).__name__}"
    )


def order_by_calls(model: nn.Module, stacks: list, sample) -> list:
    """``stacks`` (planned ones first, as :func:`resolve_blocks` gives them) with the planned ones
    that a forward on ``sample`` runs in the order it first runs them. Left out, with the reason: a
    stack it does not run (a vision tower on a text-only batch) and one it runs interleaved with a
    longer one (a list of adapters called between the layers). One forward without a graph, the
    random state and the buffers kept; a callable ``sample`` (a step with side effects), or a forward
    that fails without a graph, keeps the model's order."""
    planned = [s for s in stacks if s.planned]
    if len(planned) < 2 or is_step(sample):
        return stacks
    owner = {id(b): k for k, s in enumerate(planned) for b in s.blocks}
    seen: list = []
    handles = [
        b.register_forward_pre_hook(lambda module, args, k=owner[id(b)]: seen.append(k))
        for s in planned
        for b in s.blocks
    ]
    params = list(model.parameters())
    buffers = [(b, b.detach().clone()) for b in model.buffers()]  # running statistics, step counters
    try:
        with kept_state(params, {p.device for p in params}), torch.no_grad():
            forward_of(model, sample)()
    except Exception:
        # a forward that needs a graph, or a sample of the wrong form: the model's order stands, and
        # the recording step says what is wrong
        return stacks
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
    span = {}
    for at, k in enumerate(seen):
        first, _ = span.get(k, (at, at))
        span[k] = (first, at)
    kept, out = [], []
    for k in sorted(span, key=lambda k: -len(planned[k].blocks)):  # the longest first
        first, last = span[k]
        clash = next((j for j in kept if not (last < span[j][0] or span[j][1] < first)), None)
        if clash is None:
            kept.append(k)
        else:
            out.append(replace(planned[k], planned=False, reason=f"runs interleaved with {planned[clash].name!r}"))
    missing = [
        replace(s, planned=False, reason="the sample's forward does not run it")
        for k, s in enumerate(planned)
        if k not in span
    ]
    if not kept:
        return stacks  # nothing ran: the recording says so, naming the blocks
    ordered = [planned[k] for k in sorted(kept, key=lambda k: span[k][0])]
    return ordered + out + missing + [s for s in stacks if not s.planned]
