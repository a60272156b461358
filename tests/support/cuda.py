"""CUDA helpers of the tests: whether a GPU is usable, and raw device memory seen as a tensor."""

from __future__ import annotations


def cuda_usable() -> bool:
    """Whether torch can use a CUDA GPU here (False where torch itself is missing or broken)."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


class CudaArray:
    """``n`` elements of ``typestr`` (numpy's codes: ``"<f4"`` float32, ``"|u1"`` uint8) at device
    address ``addr``, for ``torch.as_tensor(CudaArray(...), device="cuda")``: a view, no copy."""

    def __init__(self, addr: int, n: int, typestr: str = "<f4"):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (addr, False), "version": 2}
