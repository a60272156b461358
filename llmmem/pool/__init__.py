"""A caching memory pool (TLSF in C) for host, pinned and CUDA memory, and its wiring into PyTorch."""

from llmmem.pool.host import host_memory
from llmmem.pool.memory_pool import MemoryPool, feature_status
from llmmem.pool.torch_allocator import current_pool, install_allocator, torch_oom_errors, use_pool

__all__ = [
    "MemoryPool",
    "use_pool",
    "install_allocator",
    "torch_oom_errors",
    "current_pool",
    "feature_status",
    "host_memory",
]
