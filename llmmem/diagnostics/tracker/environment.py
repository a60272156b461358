"""What the tracker reads from outside its own counts: torch's CUDA allocator figures, the llmmem
pool in use, the ``torch.distributed`` rank. Reading them never synchronises the GPU."""

from __future__ import annotations

import sys

import torch

__all__ = ["cuda_stats", "pool_stats", "rank_info", "rank_text"]


def cuda_stats(device: str) -> dict:
    """torch's allocator figures for a CUDA ``device`` (reads counters; no synchronisation)."""
    if not device.startswith("cuda") or not torch.cuda.is_initialized():
        return {}
    try:
        s = torch.cuda.memory_stats(device)
    except RuntimeError:  # an installed pluggable allocator has no statistics
        return {}
    return {
        "allocated": s.get("allocated_bytes.all.current", 0),
        "max_allocated": s.get("allocated_bytes.all.peak", 0),
        "reserved": s.get("reserved_bytes.all.current", 0),
        "max_reserved": s.get("reserved_bytes.all.peak", 0),
        "inactive_split": s.get("inactive_split_bytes.all.current", 0),
        "num_alloc_retries": s.get("num_alloc_retries", 0),
        "num_ooms": s.get("num_ooms", 0),
    }


def pool_stats():
    """Statistics of the llmmem pool in use on this thread (``use_pool``) or installed, if any."""
    pool_mod = sys.modules.get("llmmem.pool")
    if pool_mod is None:
        return None
    from llmmem.pool.memory_pool import installed_pool

    pool = pool_mod.current_pool() or installed_pool()
    if pool is None:
        return None
    try:
        return pool.stats()
    except Exception:  # a closed pool: nothing to say
        return None


def rank_info():
    """``{"rank", "world_size"[, "tensor_parallel_rank", "tensor_parallel_size"]}`` or None."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    info = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    parallel = sys.modules.get("llmmem.parallel")
    if parallel is not None:
        group = parallel.get_tensor_parallel_group()
        info["tensor_parallel_rank"] = dist.get_rank(group)
        info["tensor_parallel_size"] = dist.get_world_size(group)
    return info


def rank_text(rank) -> str:
    if not rank:
        return ""
    text = f", rank {rank['rank']} of {rank['world_size']}"
    if "tensor_parallel_rank" in rank:
        text += f" (tensor-parallel rank {rank['tensor_parallel_rank']} of {rank['tensor_parallel_size']})"
    return text
