"""Work units: what running operators costs, counted rather than timed.

:class:`WorkCounter` counts the work of what runs inside it in FLOP-equivalents, forward and backward
apart: matrix products and attention kernels by their FLOPs (torch's ``flop_counter`` formulas),
every other operator by the bytes it reads and writes, plus a fixed price per operator
(:data:`WORK_MODEL`). The planner compares plans in these units, which are counted, not timed, so
the same model and budget give the same plan on every run; the one measured factor that turns them
into seconds is the profiler's (``time_unit``, :mod:`llmmem.checkpointing.profile`).
:func:`in_backward` tells a backward pass from a forward.

Not here: bytes (:mod:`llmmem.checkpointing.meters`, whose :class:`ActivationMeter` can count work
into a WorkCounter in the same dispatch), seconds (:mod:`llmmem.checkpointing.timing`), the Python
price per operator of a mode that dispatches in Python (:mod:`llmmem.checkpointing.costs`).
"""

from __future__ import annotations

import torch
import torch.utils.flop_counter as flop_counter
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WORK_MODEL", "WorkCounter", "in_backward"]


# FLOP-equivalents per byte moved and per operator, by device type: only their ratios choose plans
# (round figures: a few-core CPU ~50 GFLOP/s, ~50 GB/s, ~4 us/op; a GPU ~100 TFLOP/s, ~3 TB/s, ~5 us).
WORK_MODEL = {"cpu": (1.0, 2e5), "cuda": (30.0, 5e8)}


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.layout == torch.strided else 0


_aten = torch.ops.aten
_SDPA_CPU = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SDPA_CPU_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _as_many_heads(q, k, v):
    """Grouped-query attention (fewer key/value heads than query heads, ``enable_gqa``) does the work
    of attention with the key/value heads repeated: torch's FLOP formulas want equal head counts."""
    if len(q) == 4 and len(k) == 4 and k[1] != q[1]:
        k = (k[0], q[1], k[2], k[3])
        v = (v[0], q[1], v[2], v[3])
    return q, k, v


class WorkCounter(TorchDispatchMode):
    """Counts the work of what runs inside, in FLOP-equivalents, forward and backward apart: matrix
    products and attention kernels by their FLOPs (torch's ``flop_counter`` formulas), every other
    operator by the bytes it reads and writes, plus a fixed price per operator (:data:`WORK_MODEL`).
    Deterministic: the same operators give the same count. A dispatch mode; an
    :class:`ActivationMeter` can also count into one (``work=``) in the same pass.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.per_byte, self.per_op = WORK_MODEL.get(device_type, WORK_MODEL["cuda"])
        self.forward = 0.0
        self.backward = 0.0
        self.forward_ops = 0
        self.backward_ops = 0

    def _flops(self, func, args, kwargs, out) -> float | None:
        packet = func.overloadpacket
        if packet in flop_counter.flop_registry:
            try:
                return float(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out))
            except AssertionError:
                # torch's attention formulas want as many key/value heads as query heads (CUDA
                # kernels with enable_gqa): count the attention with the heads repeated; an
                # operator no formula fits is counted by its bytes (still deterministic)
                grad_first = int("backward" in packet.__name__)
                try:
                    q, k, v = _as_many_heads(*(t.shape for t in args[grad_first : grad_first + 3]))
                    forward = float(flop_counter.sdpa_flop_count(q, k, v))
                except (AssertionError, AttributeError, TypeError, ValueError):
                    return None
                return 2.5 * forward if grad_first else forward
        if _SDPA_CPU is not None and packet is _SDPA_CPU:
            q, k, v = _as_many_heads(args[0].shape, args[1].shape, args[2].shape)
            return float(flop_counter.sdpa_flop_count(q, k, v))
        if _SDPA_CPU_BACKWARD is not None and packet is _SDPA_CPU_BACKWARD:
            q, k, v = _as_many_heads(args[1].shape, args[2].shape, args[3].shape)
            return float(flop_counter.sdpa_backward_flop_count(args[0].shape, q, k, v))
        return None

    def count(self, func, args, kwargs, out) -> None:
        work = self._flops(func, args, kwargs, out)
        if work is None:
            work = 0.0 if func.is_view else self.per_byte * sum(map(_nbytes, pytree.tree_leaves((args, kwargs, out))))
        work += self.per_op
        if in_backward():
            self.backward += work
            self.backward_ops += 1
        else:
            self.forward += work
            self.forward_ops += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out
