"""llmmem: train large language models in less accelerator memory.

``import llmmem`` is cheap and never fails: torch and the C core are loaded when a feature that
needs them is first used. ``python -m llmmem info`` says what this installation can do.
"""

from __future__ import annotations

import importlib
import sys as _sys
import types as _types

__version__ = "0.1.0"

# Public name -> module that defines it. Resolved lazily (PEP 562) so that importing llmmem does
# not import torch; `python -m llmmem estimate llama-7b` needs neither torch nor a GPU.
_LAZY = {
    "estimate": "llmmem.estimate",
    "Estimate": "llmmem.estimate",
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
    # activation checkpointing and the recompute planner (issue 4). The module is not named
    # llmmem/checkpoint.py: importing a submodule sets it as an attribute of the package, which
    # would replace the function llmmem.checkpoint by a module depending on import order.
    "checkpoint": "llmmem.checkpointing",
    "checkpoint_sequential": "llmmem.checkpointing",
    "CheckpointError": "llmmem.checkpointing",
    "profile_blocks": "llmmem.planner",
    "plan_checkpoints": "llmmem.planner",
    "auto_checkpoint": "llmmem.planner",
    "selective_context_fn": "llmmem.selective",
    "recompute_cheap": "llmmem.remat",
    # dynamic loss scaling (issue 3)
    "GradScaler": "llmmem.amp",
    # caching memory pool (issue 5)
    "MemoryPool": "llmmem.pool",
    "use_pool": "llmmem.pool",
    "install_allocator": "llmmem.pool",
    "torch_oom_errors": "llmmem.pool",
    # tensor parallelism (issue 6)
    "ColumnParallelLinear": "llmmem.parallel",
    "RowParallelLinear": "llmmem.parallel",
    "VocabParallelEmbedding": "llmmem.parallel",
    "vocab_parallel_cross_entropy": "llmmem.parallel",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(_types.ModuleType):
    # Importing a submodule binds it as an attribute of its package. llmmem/estimate.py shares its
    # name with the function llmmem.estimate, so `import llmmem.estimate` (or llmmem.Estimate, which
    # imports it) would replace the function by the module. Public names keep their objects; the
    # submodule stays reachable through sys.modules and `from llmmem.estimate import ...`.
    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
