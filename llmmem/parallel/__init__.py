"""Tensor parallelism (Megatron-style) over torch.distributed, with llmmem's intra-node collectives.

Layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`
and :func:`vocab_parallel_cross_entropy`. Models: :class:`TensorParallelGPT` (``from_gpt``) and
:class:`SequenceParallelGPT` (sequence parallelism on top of it; sum the sequence-parallel gradients
with :func:`allreduce_sequence_parallel_grads` after backward); Hugging Face causal LMs split in
place by :func:`parallelize` (:mod:`llmmem.parallel.hf`). Groups: :func:`init` (TP x DP under torchrun), or any
``process_group=``. Autograd regions: the ``*_region`` functions. Dropout streams:
:func:`model_parallel_manual_seed` and :func:`get_rng_tracker` (:mod:`llmmem.parallel.random`).
Engines and thresholds: :mod:`llmmem.parallel.collectives`.
"""

from __future__ import annotations

from llmmem.parallel.collectives import get_collective_thresholds, set_collective_thresholds, set_timeout
from llmmem.parallel.cross_entropy import vocab_parallel_cross_entropy
from llmmem.parallel.gpt import TensorParallelGPT
from llmmem.parallel.groups import destroy, get_data_parallel_group, get_tensor_parallel_group, init
from llmmem.parallel.hf import parallelize
from llmmem.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
)
from llmmem.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from llmmem.parallel.random import (
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from llmmem.parallel.sequence_parallel import SequenceParallelGPT

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "TensorParallelGPT",
    "SequenceParallelGPT",
    "parallelize",
    "allreduce_sequence_parallel_grads",
    "init",
    "destroy",
    "get_tensor_parallel_group",
    "get_data_parallel_group",
    "set_collective_thresholds",
    "get_collective_thresholds",
    "set_timeout",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "feature_status",
]


def feature_status() -> tuple[bool, str]:
    """(usable, detail) for ``python -m llmmem info``."""
    import torch.distributed as dist

    from llmmem._native import available, native

    if not dist.is_available():
        return False, "torch.distributed is not available in this torch build"
    engines = []
    if available() and hasattr(native, "shm_comm_open"):
        engines.append("shared-memory CPU collectives")
    if available() and native.build_info().get("cuda_built") and hasattr(native, "cuda_ar_create"):
        engines.append("CUDA IPC all-reduce (opt-in: LLMMEM_TP_CUDA_IPC=1; needs a GPU at run time)")
    backends = [b for b, ok in (("nccl", dist.is_nccl_available()), ("gloo", dist.is_gloo_available())) if ok]
    return True, (
        f"torch.distributed ({', '.join(backends) or 'no backend'})"
        + (f" + llmmem {', '.join(engines)}" if engines else "")
    )
