"""``step_in_backward``: each parameter is updated as soon as its gradient is accumulated, and the
gradient is freed at once, so no moment of a step holds all gradients (PyTorch's "optimizer step
in backward" recipe, torchtune's ``optimizer_in_bwd``).

What a step in backward cannot do, it refuses, naming the conflict, rather than silently training
something else:

- clipping by global norm (``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_`` on a parameter
  it steps): the norm needs every gradient before the first update; by then they are gone;
- gradient accumulation over several backwards: each backward is applied as an update of its
  own. Seen when ``optimizer.step()`` is called after two or more backwards, or when a backward
  starts after a step-calling loop has not called ``step()`` since the last one;
- DistributedDataParallel: its hook fires on the rank's own gradient, before DDP averages it (the
  replicas would drift apart silently); refused when the model given is or holds a DDP module.
- an enabled fp16 ``GradScaler`` (torch's or llmmem's): its inf check must see every gradient
  before any update. bf16 autocast needs no scaler and works;
- reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) where
  it hides what a step in backward needs: each checkpointed segment runs a backward of its own,
  so when the first gradient of a backward is accumulated inside one, the end of the whole
  backward (where the scheduler steps and accumulation is counted) cannot be seen; and a
  parameter used in two segments (or in one and outside) has its gradient accumulated twice,
  which would step it twice on partial gradients. Non-reentrant checkpointing
  (``use_reentrant=False``, ``llmmem.checkpoint``) is one backward and works.

The optimizer's own ``step()`` and ``zero_grad()`` may still be called (they find no gradients):
loops written for a normal step keep working. FSDP2 (DTensor) parameters are refused: FSDP2
writes its sharded gradients after its reduce-scatter, where no accumulate hook runs.
"""

from __future__ import annotations

import sys
import threading
from typing import Iterable, Optional, Union

import torch

from llmmem.errors import StateError

_lock = threading.Lock()
_active: list[StepInBackward] = []
_patched: dict = {}


def _managed(params) -> bool:
    return any(h.manages(p) for h in list(_active) for p in params)


def _in_nested_backward() -> bool:
    """Whether the caller runs inside a backward started from a node of another backward (what
    the reentrant ``torch.utils.checkpoint`` does): a custom autograd Function's backward is
    then on this thread's stack (torch runs every one through ``BackwardCFunction.apply``); the
    engine calls a leaf's accumulate hook with no Python frame of a node otherwise."""
    from torch.autograd.function import BackwardCFunction

    code = BackwardCFunction.apply.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _params_of(arg) -> list:
    if isinstance(arg, torch.Tensor):
        return [arg]
    return list(arg)


def _clip_guard(original, name):
    def guarded(parameters, *args, **kwargs):
        params = _params_of(parameters)
        if _managed(params):
            raise StateError(
                f"torch.nn.utils.{name} on parameters that llmmem.optim.step_in_backward steps: each is updated "
                "and its gradient freed during backward, before any clipping could see the gradients (their "
                "global norm needs all of them first). Remove step_in_backward to clip, or drop the clipping"
            )
        return original(params, *args, **kwargs)

    guarded._llmmem_guard = True
    return guarded


def _scale_guard(original):
    def guarded(self, outputs):
        if _active and self.is_enabled():
            raise StateError(
                f"{type(self).__module__}.{type(self).__name__}.scale while llmmem.optim.step_in_backward is active: "
                "an fp16 loss scaler must find inf/NaN in every gradient before any parameter is updated, and a "
                "step in backward updates each parameter as soon as its gradient exists. Use bf16 autocast "
                "(no scaler), GradScaler(enabled=False), or remove step_in_backward"
            )
        return original(self, outputs)

    guarded._llmmem_guard = True
    return guarded


def _scaler_classes() -> list:
    classes = [torch.amp.GradScaler]
    try:
        from llmmem.amp import GradScaler as LlmmemScaler  # a peer concern, loaded only to guard it
    except ImportError:  # pragma: no cover - the C core missing
        LlmmemScaler = None
    if LlmmemScaler is not None:
        classes.append(LlmmemScaler)
    return classes


def _install_guards() -> None:
    import torch.nn.utils.clip_grad as cg

    for mod in (torch.nn.utils, cg):
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            original = getattr(mod, name)
            _patched[(mod, name)] = original
            setattr(mod, name, _clip_guard(original, name))
    for cls in _scaler_classes():
        _patched[(cls, "scale")] = cls.__dict__["scale"]
        cls.scale = _scale_guard(cls.__dict__["scale"])


def _remove_guards() -> None:
    for (owner, name), original in _patched.items():
        setattr(owner, name, original)
    _patched.clear()


class StepInBackward:
    """The handle :func:`step_in_backward` returns: ``remove()`` restores the normal step."""

    def __init__(self, params: list, optimizer: torch.optim.Optimizer, scheduler) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._params = params
        self._ids = {id(p) for p in params}
        self._group_of = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                self._group_of[id(p)] = g
        missing = [i for i, p in enumerate(params) if id(p) not in self._group_of]
        if missing:
            raise ValueError(
                f"step_in_backward: {len(missing)} parameter(s) requiring grad (the first at position {missing[0]}) "
                "are not in the optimizer's param_groups; pass the optimizer that holds them all"
            )
        self._fused = hasattr(optimizer, "_step_params")  # llmmem's Adam/AdamW step one parameter natively
        self._per_param = {} if self._fused else {id(p): self._sub_optimizer(p) for p in params}
        self._backwards_since_step = 0
        self._step_called = False
        self._in_backward = False
        self._stepped: set = set()  # ids of the parameters stepped in the current backward
        self._removed = False
        self._step_hook = optimizer.register_step_pre_hook(self._before_user_step)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]
        with _lock:
            if not _active:
                _install_guards()
            _active.append(self)

    def manages(self, p) -> bool:
        return not self._removed and id(p) in self._ids

    def _sub_optimizer(self, p) -> torch.optim.Optimizer:
        """A one-parameter optimizer of the user's class and group settings, sharing its state dict
        (so ``optimizer.state_dict()`` sees every parameter's state)."""
        g = self._group_of[id(p)]
        settings = {k: v for k, v in g.items() if k != "params"}
        try:
            sub = type(self.optimizer)([{"params": [p], **settings}])
        except Exception as e:
            raise TypeError(
                f"step_in_backward: cannot make a one-parameter {type(self.optimizer).__name__} from its group "
                f"settings ({type(e).__name__}: {e}); it works with optimizers constructed as cls(params, **defaults)"
            ) from e
        sub.state = self.optimizer.state
        return sub

    # ---- hooks ----------------------------------------------------------------------------

    def _check_accumulation(self) -> None:
        if self._step_called and self._backwards_since_step >= 1:
            raise StateError(
                "a second backward without optimizer.step() in between, in a loop that calls optimizer.step(): "
                "gradient accumulation over several backwards cannot be stepped in backward (the last backward "
                "was already applied as an update of its own). Remove step_in_backward to accumulate"
            )

    def _accumulated(self, p: torch.Tensor) -> None:
        if not self._in_backward:
            self._check_accumulation()
            if _in_nested_backward():
                raise StateError(
                    "step_in_backward: the first gradient of this backward was accumulated inside a nested "
                    "backward (reentrant activation checkpointing, torch.utils.checkpoint(..., use_reentrant=True)): "
                    "each checkpointed segment is a backward of its own, so the end of the whole backward, where "
                    "the scheduler steps and gradient accumulation is counted, cannot be seen. Checkpoint with "
                    "use_reentrant=False (or llmmem.checkpoint), or step after backward"
                )
            self._in_backward = True
            self._stepped.clear()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if id(p) in self._stepped:
            self._in_backward = False  # this backward stops here (see below)
            self._stepped.clear()
            raise StateError(
                f"step_in_backward: a parameter of shape {tuple(p.shape)} had its gradient accumulated twice in one "
                "backward: it is used inside a reentrant checkpointed segment (torch.utils.checkpoint(..., "
                "use_reentrant=True)) and outside it or in another, and each segment runs a backward of its own. "
                "Stepping each part would not equal one step on the whole gradient. Checkpoint with "
                "use_reentrant=False (or llmmem.checkpoint), or step after backward"
            )
        self._stepped.add(id(p))
        try:
            if self._fused:
                self.optimizer._step_params([(self._group_of[id(p)], [p])])
            else:
                sub = self._per_param[id(p)]
                group = self._group_of[id(p)]
                sub.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
                sub.step()
        except BaseException:
            # the backward stops here and its end-of-backward callback never runs: the next
            # backward must start afresh (else it would neither count itself nor step the scheduler)
            self._in_backward = False
            self._stepped.clear()
            raise
        p.grad = None

    def _backward_done(self) -> None:
        self._in_backward = False
        self._backwards_since_step += 1
        self.optimizer._opt_called = True  # torch's schedulers warn of a scheduler step before any optimizer step
        if self.scheduler is not None:
            self.scheduler.step()

    def _before_user_step(self, optimizer, args, kwargs) -> None:
        n = self._backwards_since_step
        self._step_called = True
        self._backwards_since_step = 0
        if n > 1:
            raise StateError(
                f"optimizer.step() after {n} backward passes with step_in_backward: each backward was already "
                "applied as an update of its own, so gradient accumulation over several backwards cannot be done "
                "in backward. Remove step_in_backward to accumulate"
            )

    def remove(self) -> None:
        """Removes the hooks (and the guards, with the last handle); the optimizer steps normally again."""
        if self._removed:
            return
        self._removed = True
        for h in self._hooks:
            h.remove()
        self._step_hook.remove()
        with _lock:
            if self in _active:
                _active.remove(self)
            if not _active:
                _remove_guards()

    def __enter__(self) -> StepInBackward:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def step_in_backward(
    model_or_params: Union[torch.nn.Module, Iterable[torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Optional[object] = None,
) -> StepInBackward:
    """Steps every parameter of ``model_or_params`` that requires grad inside backward, as soon as
    its gradient is accumulated, and frees the gradient.

    :param model_or_params: a module (its parameters) or an iterable of parameters, all held by
        ``optimizer``.
    :param optimizer: a :class:`llmmem.optim.AdamW`/``Adam`` (stepped natively, one parameter at a
        time), or any torch optimizer built as ``cls(params, **defaults)`` (one optimizer per
        parameter is made from its group settings, sharing its state, as torchtune does; a
        group's lr and other settings are read at every step, so schedulers work).
    :param scheduler: stepped once at the end of every backward, if given.
    :returns: a handle; ``handle.remove()`` (or leaving it as a context manager) undoes it.

    Memory: at most the gradients of the parameters whose hooks have not yet run exist at once,
    instead of all of them. Refusals are listed in the module docstring.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    model = model_or_params if isinstance(model_or_params, torch.nn.Module) else None
    params = list(model.parameters() if model is not None else model_or_params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"model_or_params[{i}] is {type(p).__name__}, not a tensor")
    params = [p for p in dict.fromkeys(params) if p.requires_grad]  # once each, in order
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    if any(isinstance(p, DTensor) for p in params):
        raise NotImplementedError(
            "step_in_backward does not support DTensor (FSDP2 / tensor-parallel) parameters: FSDP2 writes the "
            "sharded gradients after its reduce-scatter, where no accumulate hook runs; step after backward instead"
        )
    if not params:
        raise ValueError("step_in_backward: no parameter requires grad")
    if model is not None and any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in model.modules()):
        raise NotImplementedError(
            "step_in_backward does not support DistributedDataParallel: the accumulate hook runs on each rank's "
            "own gradient, before DDP averages it, so the replicas would drift apart; step after backward instead"
        )
    return StepInBackward(params, optimizer, scheduler)
