"""Helpers the GradScaler test files share (pytest puts this directory on sys.path)."""

from __future__ import annotations

import torch


def assert_same(a, b):
    """Bitwise equal, except that NaN only has to be NaN (torch itself writes different NaN bit
    patterns for bf16 from its scalar and vector loops); -0.0 and +0.0 differ here."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a[~nan_a].contiguous().view(ints), b[~nan_b].contiguous().view(ints))


def p_with(grad):
    """A parameter holding ``grad`` (None: a parameter without a gradient)."""
    if grad is None:
        return torch.nn.Parameter(torch.zeros(1))
    p = torch.nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device))
    p.grad = grad
    return p


def odd_layout_param(layout):
    """A parameter whose gradient has ``layout`` (not strided): sparse COO on a dense parameter, as
    nn.Embedding(sparse=True) makes; the others on a parameter of their own layout, which torch
    requires. The C walk does not read layouts: each of these must fail one of its other tests."""
    dense = torch.arange(16.0).reshape(4, 4)
    make = {
        "sparse_coo": lambda: dense.to_sparse(),
        "sparse_csr": lambda: dense.to_sparse_csr(),
        "sparse_csc": lambda: dense.to_sparse_csc(),
        "sparse_bsr": lambda: dense.to_sparse_bsr((2, 2)),
        "sparse_bsc": lambda: dense.to_sparse_bsc((2, 2)),
        "mkldnn": lambda: dense.to_mkldnn(),
    }[layout]
    p = torch.nn.Parameter(torch.zeros(4, 4) if layout == "sparse_coo" else make())
    p.grad = make()
    return p


ODD_LAYOUTS = ["sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "mkldnn"]


def interrupt_once_on(target):
    """A TorchFunctionMode that raises KeyboardInterrupt the first time ``target.is_contiguous()`` is
    called, as a signal handler would from Python code the walk's attribute reads run (under a
    mode, they do). Its ``fired`` attribute says whether it did."""
    from torch.overrides import TorchFunctionMode

    class InterruptOnce(TorchFunctionMode):
        fired = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.is_contiguous and args[0] is target and not InterruptOnce.fired:
                InterruptOnce.fired = True
                raise KeyboardInterrupt
            return func(*args, **(kwargs or {}))

    return InterruptOnce()


class FakeCudaNative:
    """``llmmem._C`` as the GPU probe of :mod:`llmmem.amp.kernels` sees it: a CUDA build for ``archs``
    that sees ``count`` GPUs (or whose device count raises ``error``). Any other attribute is
    ``real``'s (the real core, whose CPU kernels can then stand in for a GPU's)."""

    def __init__(self, archs="sm_90", count=1, error=None, real=None):
        self.archs, self.count, self.error, self._real = archs, count, error, real
        self.calls = 0

    def cuda_device_count(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.count

    def build_info(self):
        return {"cuda_built": True, "cuda_archs": self.archs}

    def __getattr__(self, name):
        if self._real is None:
            raise AttributeError(name)
        return getattr(self._real, name)
