"""Helpers of the memory pool's tests."""

from __future__ import annotations


def inside(pool, tensor) -> bool:
    """Whether ``tensor``'s data lies in one of ``pool``'s segments."""
    ptr = tensor.data_ptr()
    return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in pool.snapshot())
