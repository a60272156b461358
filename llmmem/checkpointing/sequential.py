"""``checkpoint_sequential``: a chain of modules run in checkpointed segments, as torch's, with
``segments="auto"`` handing the choice of segments to the recompute planner."""

from __future__ import annotations

import torch

from llmmem.checkpointing.auto import auto_checkpoint
from llmmem.checkpointing.core import CHECKPOINT_OPTIONS, _warn_use_reentrant_omitted, checkpoint

__all__ = ["checkpoint_sequential"]


def _torch_split(n: int, segments: int) -> list[tuple[int, int]]:
    """torch's segments: ``segments - 1`` checkpointed ranges of ``n // segments`` functions, then
    the rest (9 functions in 5 segments: ``[1, 1, 1, 1, 5]``)."""
    size = n // segments
    bounds = [(k * size, (k + 1) * size) for k in range(segments - 1)]
    return bounds + [((segments - 1) * size, n)]


def _even_split(n: int, segments: int) -> list[tuple[int, int]]:
    """``segments`` contiguous ranges of ``range(n)`` whose sizes differ by at most one; the larger
    ones come first so the last (not checkpointed) segment is the smallest (9 in 5: ``[2, 2, 2, 2, 1]``)."""
    base, extra = divmod(n, segments)
    bounds, start = [], 0
    for s in range(segments):
        size = base + (1 if s < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


_SPLITS = {"torch": _torch_split, "even": _even_split}


def checkpoint_sequential(
    functions, segments, input, use_reentrant: bool | None = None, *, split: str = "torch", **kwargs
):
    """Run a sequence of modules/functions in ``segments`` chunks, all but the last checkpointed.

    Drop-in for ``torch.utils.checkpoint.checkpoint_sequential``: by default the chunks are torch's,
    so the same functions are recomputed and the memory and time are those the caller asked torch
    for: ``segments - 1`` checkpointed chunks of ``len(functions) // segments`` functions, then a last
    chunk with the rest (9 modules in 5 segments: ``[1, 1, 1, 1, 5]``). The last chunk is not
    checkpointed: its activations are the first ones backward needs, so recomputing them would cost
    time and save nothing.

    :param split: ``"torch"`` (the default, above) or ``"even"``: chunk sizes that differ by at most
        one, larger ones first (9 in 5: ``[2, 2, 2, 2, 1]``), which keeps far fewer activations when
        ``len(functions)`` is not a multiple of ``segments``.

    :param functions: an ``nn.Sequential`` or a list/tuple of callables, each taking one value.
    :param segments: number of segments (``1 <= segments <= len(functions)``), or ``"auto"`` to
        let the C planner choose the region boundaries for ``budget=`` (bytes, ``"6GB"``, or a
        fraction, ``0.5`` or ``"50%"``, of the activation bytes without checkpointing); see :func:`llmmem.auto_checkpoint`.
        With ``"auto"`` the functions must be modules, and they are profiled on ``input`` on every
        call (build ``llmmem.auto_checkpoint`` once instead when calling in a loop); an
        impossible budget raises :class:`llmmem.InfeasibleError` stating the least one.
    :param input: the input of the first function.
    :param kwargs: options of :func:`checkpoint` (``preserve_rng_state``, ``offload``, ...), and
        ``budget`` with ``segments="auto"``. With ``"auto"``, ``offload=True`` (and
        ``host_bandwidth=``) let the planner keep some segments' inputs in host memory, as in
        :func:`llmmem.plan_checkpoints`, instead of offloading every segment.

    :param use_reentrant: as in :func:`checkpoint`; omitted, the segments are non-reentrant and,
        as torch's ``checkpoint_sequential`` does, the call warns that it should be passed
        explicitly (once per call, not per segment).

    Memory: the input of each checkpointed segment plus the activations of the largest segment
    (during its backward) and those of the last one.
    """
    if use_reentrant is None:
        _warn_use_reentrant_omitted(stacklevel=2, what="llmmem.checkpoint_sequential")
        use_reentrant = False
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    # torch accepts any indexable sequence of callables; nn.ModuleList (how models hold their blocks) included
    if not isinstance(functions, (list, tuple, torch.nn.ModuleList)) or not all(callable(f) for f in functions):
        raise TypeError(
            "checkpoint_sequential: functions must be an nn.Sequential, an nn.ModuleList or a list of callables"
        )
    functions = list(functions)
    if not functions:
        raise ValueError("checkpoint_sequential: functions is empty")
    budget = kwargs.pop("budget", None)
    planner_options = {"host_bandwidth": kwargs.pop("host_bandwidth")} if "host_bandwidth" in kwargs else {}
    unknown = set(kwargs) - set(CHECKPOINT_OPTIONS)
    if unknown:
        raise ValueError(f"checkpoint_sequential: unexpected keyword arguments {sorted(unknown)}")
    if split not in _SPLITS:
        raise ValueError(f"checkpoint_sequential: split must be 'torch' or 'even', got {split!r}")
    if isinstance(segments, str):
        if segments != "auto":
            raise ValueError(f"checkpoint_sequential: segments must be an int or 'auto', got {segments!r}")
        if budget is None:
            raise ValueError("checkpoint_sequential: segments='auto' needs budget= (bytes, '6GB' or a fraction)")
        if split != "torch":
            raise ValueError(
                "checkpoint_sequential: split= is for an integer segments; 'auto' lets the planner choose"
            )
        return auto_checkpoint(functions, input, budget=budget, **planner_options, **kwargs)(input)
    if budget is not None or planner_options:
        raise ValueError("checkpoint_sequential: budget= and host_bandwidth= are only used with segments='auto'")
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(functions):
        raise ValueError(f"checkpoint_sequential: segments must be an int in [1, {len(functions)}], got {segments!r}")

    def run_range(start: int, end: int):
        def forward(x):
            for f in functions[start:end]:
                x = f(x)
            return x

        return forward

    bounds = _SPLITS[split](len(functions), segments)
    x = input
    for start, end in bounds[:-1]:
        x = checkpoint(run_range(start, end), x, use_reentrant=use_reentrant, **kwargs)
    start, end = bounds[-1]
    return run_range(start, end)(x)
