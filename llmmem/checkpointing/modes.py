"""The modes a block runs in, and running a call in one.

Modes of a block: ``"store-all"`` (autograd keeps its tape), ``"selective"`` (keeps matmul and
attention outputs, recomputes the rest: :mod:`llmmem.checkpointing.selective`), ``"recompute-cheap"``
(keeps the tape but rebuilds in backward the tensors one elementwise operator or a LayerNorm makes
from kept ones: :mod:`llmmem.checkpointing.remat`), and ``"store-input-only"`` (a checkpoint of the
block alone; a column of its own only when regions cannot span blocks, see
:class:`llmmem.checkpointing.profile.ChainProfile`). :func:`run_call` runs a call in one of them,
for profiling and for the top-level blocks of a plan.

Not here: what a mode costs (:mod:`llmmem.checkpointing.costs`), the checkpoint itself
(:mod:`llmmem.checkpointing.core`).
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from llmmem.checkpointing import remat, selective
from llmmem.checkpointing.core import checkpoint

__all__ = ["MODES", "INPUT_ONLY", "run_call", "run_mode"]


MODES = ("store-all", "selective", "recompute-cheap")
INPUT_ONLY = "store-input-only"


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
