"""llmmem: train large language models in less accelerator memory.

``import llmmem`` is cheap and never fails: torch and the C core are loaded when a feature that
needs them is first used. ``python -m llmmem info`` says what this installation can do.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it. Resolved lazily (PEP 562) so that importing llmmem does
# not import torch; `python -m llmmem estimate llama-7b` needs neither torch nor a GPU.
_LAZY = {
    "estimate": "llmmem.estimation",
    "Estimate": "llmmem.estimation",
    "parse_bytes": "llmmem.units",
    "format_bytes": "llmmem.units",
    "LlmmemError": "llmmem.errors",
    "InvalidArgumentError": "llmmem.errors",
    "OutOfMemoryError": "llmmem.errors",
    "CudaError": "llmmem.errors",
    "NoDeviceError": "llmmem.errors",
    "NotBuiltError": "llmmem.errors",
    "InfeasibleError": "llmmem.errors",
    "StateError": "llmmem.errors",
    "InternalError": "llmmem.errors",
    "info": "llmmem.diagnostics",
    # where memory goes: tracker, out-of-memory report, batch-size finder, live monitor
    "MemoryTracker": "llmmem.diagnostics.tracker",
    "oom_report": "llmmem.diagnostics.oom",
    "find_batch_size": "llmmem.diagnostics.batch_size",
    "monitor": "llmmem.diagnostics.monitor",
    # activation checkpointing and the recompute planner
    "checkpoint": "llmmem.checkpointing",
    "checkpoint_sequential": "llmmem.checkpointing",
    "CheckpointError": "llmmem.checkpointing",
    "profile_blocks": "llmmem.checkpointing",
    "plan_checkpoints": "llmmem.checkpointing",
    "auto_checkpoint": "llmmem.checkpointing",
    "AutoCheckpointPlan": "llmmem.checkpointing",
    "CheckpointPlan": "llmmem.checkpointing",
    "selective_context_fn": "llmmem.checkpointing",
    "recompute_cheap": "llmmem.checkpointing",
    # mixed precision
    "GradScaler": "llmmem.amp",
    # caching memory pool
    "MemoryPool": "llmmem.pool",
    "use_pool": "llmmem.pool",
    "install_allocator": "llmmem.pool",
    "torch_oom_errors": "llmmem.pool",
    # tensor parallelism
    "ColumnParallelLinear": "llmmem.parallel",
    "RowParallelLinear": "llmmem.parallel",
    "VocabParallelEmbedding": "llmmem.parallel",
    "vocab_parallel_cross_entropy": "llmmem.parallel",
    "parallelize": "llmmem.parallel",
    # the LM head and its loss without the logits
    "linear_cross_entropy": "llmmem.head",
    "patch_lm_loss": "llmmem.head",
}

# Subpackages reached as attributes (``llmmem.optim.AdamW`` after ``import llmmem``), also lazily.
_SUBMODULES = ("optim",)

__all__ = sorted(_LAZY) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"llmmem.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
