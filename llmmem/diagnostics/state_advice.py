"""What the model state of a real optimizer is, and what llmmem.optim would make of it: the
numbers behind the model-state changes :func:`llmmem.diagnostics.advice.suggest` ranks
(int8 moments, the step in backward, bf16 weights without an fp32 master).

Everything is counted from the optimizer's own parameters and state: moments it holds (or, for a
parameter it has not stepped yet, the moments it will make: torch's Adam makes two of the
parameter's dtype), master copies it keeps, and the gradients of its parameters (of the
parameter's dtype). llmmem.optim's formats are counted with
:mod:`llmmem.estimation.model_state`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from llmmem.dtensors import is_dtensor, local
from llmmem.estimation.model_state import DEFAULT_BLOCK, MIN_QUANTIZED_NUMEL, llmmem_state

__all__ = ["OptimizerInfo", "inspect_optimizer", "stepping_in_backward"]

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _llmmem_adam():
    """llmmem.optim's Adam class when llmmem.optim is loaded (an optimizer of it exists only then)."""
    module = sys.modules.get("llmmem.optim.adamw")
    return None if module is None else module.Adam


def stepping_in_backward(optimizer) -> bool:
    """Whether :func:`llmmem.optim.step_in_backward` steps ``optimizer``'s parameters now (its
    handle is registered as the optimizer's step pre-hook)."""
    module = sys.modules.get("llmmem.optim.in_backward")
    if module is None:
        return False
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", {}) or {}
    for hook in hooks.values():
        handle = getattr(hook, "__self__", None)
        if isinstance(handle, module.StepInBackward) and any(
            handle.manages(p) for g in optimizer.param_groups for p in g["params"]
        ):
            return True
    return False


@dataclass
class OptimizerInfo:
    """An optimizer's parameters and state, in bytes.

    ``family``: ``"torch-adam"`` (torch's Adam/AdamW), ``"llmmem-adam"`` (llmmem.optim's),
    ``"sgd"`` or ``"other"``; ``state_dtype`` (llmmem's format, ``"fp32"`` for torch's Adam);
    ``decoupled`` (AdamW); ``amsgrad``; ``numels`` and ``element_sizes`` of its parameters;
    ``moments`` (held, or to be made where a parameter has no state yet); ``int8_moments`` (what
    ``llmmem.optim.AdamW(state_dtype='int8')`` keeps for the same parameters); ``master`` (fp32
    copies it keeps or will make); ``in_backward`` (stepped inside backward now); ``sharded``
    (some parameter is a DTensor, of FSDP2 or tensor parallelism: counts are of its local shard,
    and :func:`llmmem.optim.step_in_backward` refuses it)."""

    family: str
    state_dtype: str | None
    decoupled: bool
    amsgrad: bool
    numels: list
    element_sizes: list
    moments: int
    int8_moments: int
    master: int
    in_backward: bool
    sharded: bool = False

    @property
    def parameters(self) -> int:
        return sum(n * e for n, e in zip(self.numels, self.element_sizes))

    @property
    def gradients(self) -> int:
        """Bytes of all gradients (of the parameters' dtype)."""
        return self.parameters

    @property
    def largest_gradient(self) -> int:
        return max((n * e for n, e in zip(self.numels, self.element_sizes)), default=0)

    @property
    def fp32_numel(self) -> int:
        return sum(n for n, e in zip(self.numels, self.element_sizes) if e == 4)


def _params(optimizer) -> list:
    seen, out = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen and isinstance(p, torch.Tensor):
                seen.add(id(p))
                out.append((p, group))
    return out


def _held(state: dict, keys) -> int:
    # a DTensor's numel() is the whole tensor's; this rank holds its local shard
    return sum(
        local(v).numel() * v.element_size() for k, v in state.items() if k in keys and isinstance(v, torch.Tensor)
    )


def inspect_optimizer(optimizer) -> OptimizerInfo:
    """The :class:`OptimizerInfo` of ``optimizer`` (any ``torch.optim.Optimizer``)."""
    llmmem_adam = _llmmem_adam()
    name = type(optimizer).__name__
    if llmmem_adam is not None and isinstance(optimizer, llmmem_adam):
        family = "llmmem-adam"
    elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        family = "torch-adam"
    elif isinstance(optimizer, torch.optim.SGD):
        family = "sgd"
    else:
        family = "other"
    groups = optimizer.param_groups
    first = groups[0] if groups else {}
    decoupled = name == "AdamW" or bool(first.get("decoupled_weight_decay", False))
    amsgrad = any(bool(g.get("amsgrad", False)) for g in groups)
    state_dtype = first.get("state_dtype", "fp32") if family == "llmmem-adam" else None
    if family == "torch-adam":
        state_dtype = "fp32"  # (of the parameter's dtype, which is what it is for fp32 weights)
    numels, sizes = [], []
    moments = int8 = master = 0
    for p, group in _params(optimizer):
        n, e = local(p).numel(), p.element_size()  # per rank: a sharded (DTensor) parameter's local shard
        numels.append(n)
        sizes.append(e)
        state = optimizer.state.get(p) or {}
        if state:
            moments += _held(state, _MOMENT_KEYS)
            master += _held(state, ("master",))
        elif family == "torch-adam":
            moments += (3 if group.get("amsgrad") else 2) * n * e
        elif family == "llmmem-adam":
            fmt = group.get("state_dtype", "fp32")
            block = group.get("block_size") or DEFAULT_BLOCK.get(fmt)
            moments += llmmem_state(fmt, [n], block, group.get("min_quantized_numel", MIN_QUANTIZED_NUMEL)).bytes
            if group.get("master_weights") and p.dtype != torch.float32:
                master += 4 * n
        mq = group.get("min_quantized_numel", MIN_QUANTIZED_NUMEL) if family == "llmmem-adam" else MIN_QUANTIZED_NUMEL
        int8 += llmmem_state("int8", [n], DEFAULT_BLOCK["int8"], mq).bytes
    return OptimizerInfo(
        family=family,
        state_dtype=state_dtype,
        decoupled=decoupled,
        amsgrad=amsgrad,
        numels=numels,
        element_sizes=sizes,
        moments=moments,
        int8_moments=int8,
        master=master,
        in_backward=stepping_in_backward(optimizer),
        sharded=any(is_dtensor(p) for p, _ in _params(optimizer)),
    )
