"""Blocks that a plan compiles itself: ``llmmem.auto_checkpoint(model, ..., compile_blocks=True)``.

Why: under ``torch.compile(model)`` a plan's regions can enter the graph only as torch's checkpoint
operator, one block each, and the compiled backward of the whole model then holds the recompute of
more than one block at once. On ``compare --preset compile``'s GPT (6 blocks, resident set's rise),
every block checkpointed: 21.8 MiB eager, 35.7 MiB compiled as one graph. A plan made with
``compile_blocks`` compiles each block's forward alone and runs its regions eagerly around the
compiled blocks: a region's recompute calls the same compiled block, when autograd needs it, as the
eager plan does (20.2 MiB there, at the one-graph version's step time). The planner then budgets
what the compiled blocks keep, measured here: the tensors a compiled forward saves for backward
pass through saved-tensor hooks, which see them as they see eager ones.

A selective block is compiled with llmmem's policy carried into its graph (torch's
selective-checkpoint contexts: matmul outputs saved, the rest recomputed in the block's compiled
backward). What it does not do: plan the recompute-cheap mode (its hooks cannot see inside a
compiled graph), or let a model compiled as a whole keep one graph: the graph breaks before each
planned block (``torch.compiler.disable``), so ``fullgraph=True`` is refused at its first
compilation, with this module's reason.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import statistics
import time

import torch

from llmmem.checkpointing.calls import BlockCall, hidden_of
from llmmem.checkpointing.core import checkpoint
from llmmem.checkpointing.costs import block_signature
from llmmem.checkpointing.meters import measure_saved_bytes, storage_address
from llmmem.checkpointing.selective import selective_context_fn
from llmmem.checkpointing.timing import sync

__all__ = [
    "BETWEEN_GRAPHS",
    "COMPILED_MODES",
    "disable_between_graphs",
    "compile_bodies",
    "compile_options",
    "compiled_saved_bytes",
    "compiled_seconds",
    "use_compiled_costs",
]

# The modes a plan of compiled blocks uses besides recomputing a block: it keeps its compiled tape,
# or it is compiled with llmmem's selective policy (matmul outputs kept, the rest recomputed inside
# the block's compiled backward, where inductor fuses it).
COMPILED_MODES = ("store-all", "selective")

BETWEEN_GRAPHS = (
    "llmmem.auto_checkpoint(compile_blocks=...) compiles each planned block itself and runs its plan "
    "between the graphs; compile the model without fullgraph=True, or plan without compile_blocks"
)


# torch.compile modes that capture CUDA graphs: a region's recompute runs a block's graph again
# during the backward, while the outputs of its forward run are still in use
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_options(value) -> dict | None:
    """``None`` for ``compile_blocks=False``, else the keyword arguments of ``torch.compile`` for
    each block (``True``: its defaults, inductor).

    :raises TypeError: for anything but a bool or a dict of ``torch.compile``'s keyword arguments.
    :raises ValueError: for a mode that captures CUDA graphs.
    """
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            "auto_checkpoint: compile_blocks must be True, False or a dict of torch.compile keyword arguments "
            f"(e.g. {{'backend': 'inductor', 'mode': 'max-autotune-no-cudagraphs'}}), got {value!r}"
        )
    known = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise TypeError(f"auto_checkpoint: compile_blocks has {unknown}, not torch.compile arguments {sorted(known)}")
    options = value.get("options") or {}
    if value.get("mode") in _CUDA_GRAPH_MODES or options.get("triton.cudagraphs"):
        raise ValueError(
            f"auto_checkpoint: compile_blocks with CUDA graphs ({value!r}): a recomputed block runs its graph again "
            "while the forward's outputs are in use; use mode='max-autotune-no-cudagraphs' or 'default'"
        )
    return dict(value)


def _selective_block(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_context_fn, **kwargs)


def compile_bodies(fns, options: dict) -> dict:
    """Each block's own forward under ``torch.compile(**options)``, per mode of
    :data:`COMPILED_MODES`: ``{"store-all": [...], "selective": [...]}``. Blocks of one class share
    Dynamo's cache of their code: identical blocks compile once per mode."""
    selective = torch.compile(_selective_block, **options)
    return {
        "store-all": [torch.compile(fn, **options) for fn in fns],
        "selective": [functools.partial(selective, fn) for fn in fns],
    }


def compiled_saved_bytes(body, block, call: BlockCall) -> int:
    """Bytes the compiled ``body`` keeps for backward on ``call``, beyond the block's input and
    output, its parameters and buffers and the call's other tensors: the store-all mode's kept
    bytes of a compiled block. Runs two forwards and backwards: the first compiles, the second is measured."""
    exclude = list(block.parameters()) + list(block.buffers()) if isinstance(block, torch.nn.Module) else []
    exclude += call.other_tensors()
    # compiled first, outside the meter: tracing runs a selective policy on fake tensors, which the
    # meter's observers cannot take
    for measured in (False, True):
        x = call.fresh_input()
        args, kwargs = call.with_hidden(x)
        with measure_saved_bytes(exclude=exclude) if measured else contextlib.nullcontext() as saved:
            out = body(*args, **kwargs)
        y = hidden_of(out)
        if y.requires_grad:
            torch.autograd.backward(y, torch.ones_like(y), inputs=[x] if x.requires_grad else None)
    saved.storages.pop(storage_address(x), None)
    saved.storages.pop(storage_address(y), None)
    return saved.bytes


def compiled_seconds(body, call: BlockCall, repeats: int) -> tuple[float, float]:
    """Median seconds of the compiled ``body``'s forward and of its backward on ``call`` (compiled
    already: :func:`compiled_saved_bytes` ran it)."""
    device = call.hidden_tensor.device
    fwd, bwd = [], []
    for _ in range(repeats):
        x = call.fresh_input()
        args, kwargs = call.with_hidden(x)
        sync(device)
        t0 = time.perf_counter()
        y = hidden_of(body(*args, **kwargs))
        sync(device)
        t1 = time.perf_counter()
        if y.requires_grad:
            torch.autograd.backward(y, torch.ones_like(y), inputs=[x] if x.requires_grad else None)
        sync(device)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd), statistics.median(bwd)


def use_compiled_costs(prof, blocks, calls, bodies: dict, repeats: int = 0) -> None:
    """Replace ``prof``'s kept bytes of the modes in ``bodies`` (:func:`compile_bodies`) by those
    of the compiled blocks (one measure per block class, call signature and mode), in place; with
    ``repeats`` and a timed profile, their times too. Eager work units would misprice them: the
    selective mode's recompute, dozens of operators eagerly, is fused into the compiled backward.
    Timed, the planner then chooses among compiled blocks on measured seconds (expressed in the
    profile's work units through its ``time_unit``), not on counted work: a plan can differ from
    one run to the next where two choices cost about the same."""
    timed = repeats > 0 and prof.seconds is not None and math.isfinite(prof.time_unit) and prof.time_unit > 0
    measured: dict = {}
    for mode, fns in bodies.items():
        if mode not in prof.modes:
            continue
        k = prof.modes.index(mode)
        for i, (block, call) in enumerate(zip(blocks, calls)):
            key = (mode, block_signature(block, call))
            if key not in measured:
                kept = compiled_saved_bytes(fns[i], block, call)
                measured[key] = (kept, compiled_seconds(fns[i], call, repeats) if timed else None)
            kept, seconds = measured[key]
            prof.saved_bytes[i][k] = kept
            if seconds is None:
                continue
            for field, value in zip(("fwd_time", "bwd_time"), seconds):
                prof.seconds[field][i][k] = value
                getattr(prof, field)[i][k] = value / prof.time_unit
            if mode == "store-all":
                # a region's forward and its recompute run the compiled block
                prof.seconds["fwd_nostore_time"][i] = seconds[0]
                prof.fwd_nostore_time[i] = seconds[0] / prof.time_unit
    if timed:
        prof.measured_step_time = sum(f[0] + b[0] for f, b in zip(prof.seconds["fwd_time"], prof.seconds["bwd_time"]))
    prof.compiled_blocks = True


def disable_between_graphs(fn):
    """``fn`` run eagerly where Dynamo meets it (``torch.compiler.disable``, with the reason a
    ``fullgraph=True`` compilation reports). The wrapper keeps ``fn``'s name: bound to that name in
    ``fn``'s module, it pickles as itself."""
    try:
        return torch.compiler.disable(fn, reason=BETWEEN_GRAPHS)
    except TypeError:  # torch < 2.8: no reason=
        return torch.compiler.disable(fn)
