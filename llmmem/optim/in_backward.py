"""``step_in_backward``: each parameter is updated as soon as its gradient is accumulated, and the
gradient is freed at once, so no moment of a step holds all gradients (PyTorch's "optimizer step
in backward" recipe, torchtune's ``optimizer_in_bwd``).

Each step reads the optimizer as it is then: its current ``param_groups`` (an LR scheduler's or a
hand-set lr, a group setting) and its current ``state``, also after ``optimizer.load_state_dict()``
replaced them (a resume).

What a step in backward cannot do, it refuses, naming the conflict, rather than silently training
something else:

- clipping (``torch.nn.utils.clip_grad_norm_`` with a finite ``max_norm``, ``clip_grad_value_``)
  on a parameter it steps: each gradient is applied and freed as it arrives, before a global norm
  of all of them exists, and a value clip after backward would come after the update it should
  have changed. ``clip_grad_norm_(params, max_norm=float("inf"))`` clips nothing and is answered:
  it returns the 2-norm of the gradients of the last backward, which the hooks accumulate as each
  gradient passes (what ``transformers.Trainer`` calls to log ``grad_norm``);
- gradient accumulation over several backwards: each backward is applied as an update of its
  own. Seen when ``optimizer.step()`` is called after two or more backwards, or when a backward
  starts after a step-calling loop has not called ``step()`` since the last one; the weights have
  then taken partial updates, which the error counts;
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
  (``use_reentrant=False``, ``llmmem.checkpoint``) is one backward and works;
- a second ``step_in_backward`` on parameters an active one steps (it would step them twice, or
  leave one optimizer never stepped): ``remove()`` the first handle, or keep using it.

The optimizer's own ``step()`` and ``zero_grad()`` may still be called (they find no gradients):
loops written for a normal step keep working. FSDP2 (DTensor) parameters are refused: FSDP2
writes its sharded gradients after its reduce-scatter, where no accumulate hook runs.

Lifetime: the parameters' hooks hold the handle weakly and the handle holds the optimizer weakly;
the optimizer holds the handle (its step pre-hook). A parameter's hooks are out of reach of
Python's cycle collector, so anything they held strongly (the optimizer, its state, the parameters
again) would live until ``remove()``: dropping a model and its optimizer now frees both. Keep a
reference to the optimizer while it steps in backward: a backward that finds it gone raises once,
saying so, and removes the hooks.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Iterable, Optional, Union

import torch

from llmmem.errors import StateError

_lock = threading.RLock()  # re-entrant: a handle's finalizer may run in a collection inside a locked region
_active: weakref.WeakSet = weakref.WeakSet()  # StepInBackward handles not removed
_registrations: weakref.WeakSet = weakref.WeakSet()  # _Hooks still held by some parameter
_patched: dict = {}


def _owner(p) -> Optional[StepInBackward]:
    """The live handle that steps ``p``, if any."""
    for h in list(_active):
        if h.manages(p):
            return h
    return None


def _managed(params) -> bool:
    handles = [h for h in list(_active) if h.active]
    return any(h.manages(p) for h in handles for p in params)


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


def _grad_square(grad: torch.Tensor) -> torch.Tensor:
    """The squared 2-norm of one gradient, a 0-d fp32 tensor on its device (for
    ``clip_grad_norm_(max_norm=inf)``): one read of the gradient, reduced in fp32 or wider. A
    bf16/fp16 gradient on the CPU gives its norm in its own dtype (reduced in fp32, rounded once,
    as torch's ``clip_grad_norm_`` computes each gradient's norm): there torch's reduction that
    casts to fp32 on the way takes about 4x as long, a quarter of an int8 step's time."""
    if grad.layout == torch.sparse_coo:  # (an Embedding(sparse=True) with SGD): no norm kernel; repeats summed
        grad = grad.coalesce()._values()
    widen = grad.dtype in (torch.bfloat16, torch.float16) and grad.device.type != "cpu"
    norm = torch.linalg.vector_norm(grad, dtype=torch.float32) if widen else torch.linalg.vector_norm(grad)
    return norm.float().square()


def _total_norm(params: list, error_if_nonfinite: bool) -> torch.Tensor:
    """The 2-norm of the last backward's gradients of ``params``: the squared norms the hooks
    recorded for the parameters stepped in backward, and the gradients the others still hold."""
    squares = []
    for p in params:
        owner = _owner(p)
        if owner is not None:
            sq = owner._grad_sq.get(id(p))
        elif p.grad is not None:
            sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
        else:
            sq = None
        if sq is not None:
            squares.append(sq)
    if not squares:
        return torch.tensor(0.0)  # as torch's, for no gradients
    device = squares[0].device
    # summed in fp64 where the device has it: thousands of fp32 squares lose digits in fp32
    acc = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
    total = torch.stack([s.to(device=device, dtype=acc) for s in squares]).sum().sqrt().to(torch.float32)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


def _clip_norm_guard(original):
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = _params_of(parameters)
        if not _managed(params):
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if not (float(max_norm) == math.inf):
            raise StateError(
                f"torch.nn.utils.clip_grad_norm_(max_norm={max_norm}) on parameters that llmmem.optim."
                "step_in_backward steps: each is updated and its gradient freed during backward, before the global "
                "norm of all gradients exists, so nothing is left to clip. Remove step_in_backward to clip, or drop "
                "the clipping (max_norm=float('inf') clips nothing and returns the norm)"
            )
        if float(norm_type) != 2.0:
            raise StateError(
                f"torch.nn.utils.clip_grad_norm_(norm_type={norm_type}) on parameters that llmmem.optim."
                "step_in_backward steps: the hooks record the 2-norm of each gradient only; use norm_type=2.0"
            )
        return _total_norm(params, bool(error_if_nonfinite))

    clip_grad_norm_.__doc__ = original.__doc__
    clip_grad_norm_._llmmem_guard = True
    return clip_grad_norm_


def _clip_value_guard(original):
    def clip_grad_value_(parameters, *args, **kwargs):
        params = _params_of(parameters)
        if _managed(params):
            raise StateError(
                "torch.nn.utils.clip_grad_value_ on parameters that llmmem.optim.step_in_backward steps: each "
                "gradient is applied to its parameter and freed as soon as backward accumulates it, so by the time "
                "clip_grad_value_ runs the updates were made with the unclipped values and no gradient is left to "
                "clip. Remove step_in_backward to clip, or drop the clipping"
            )
        return original(params, *args, **kwargs)

    clip_grad_value_.__doc__ = original.__doc__
    clip_grad_value_._llmmem_guard = True
    return clip_grad_value_


def _scale_guard(original):
    def guarded(self, outputs):
        if self.is_enabled() and any(h.active for h in list(_active)):
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
        for name, make in (("clip_grad_norm_", _clip_norm_guard), ("clip_grad_value_", _clip_value_guard)):
            original = getattr(mod, name)
            _patched[(mod, name)] = original
            setattr(mod, name, make(original))
    for cls in _scaler_classes():
        _patched[(cls, "scale")] = cls.__dict__["scale"]
        cls.scale = _scale_guard(cls.__dict__["scale"])


def _remove_guards() -> None:
    for (owner, name), original in _patched.items():
        setattr(owner, name, original)
    _patched.clear()


def _forget() -> None:
    """A handle removed or collected, or its optimizer collected: the guards go with the last
    active handle."""
    with _lock:
        if _patched and not any(h.active for h in list(_active)):
            _remove_guards()


class _Hooks:
    """The accumulate hook of one :func:`step_in_backward` call, one object that every parameter's
    hook dict holds. It holds its handle weakly, the ids of its parameters and torch's hook handles
    (which hold each parameter's hook dict weakly): nothing that keeps a parameter or the optimizer
    alive."""

    __slots__ = ("handle", "param_ids", "removables", "optimizer_name", "__weakref__")

    def __init__(self, handle: StepInBackward) -> None:
        self.handle = weakref.ref(handle)
        self.param_ids = frozenset(handle._ids)
        self.optimizer_name = type(handle.optimizer).__name__
        self.removables: list = []

    def register(self, params: list) -> None:
        for p in params:
            self.removables.append(p.register_post_accumulate_grad_hook(self))

    def stale(self) -> bool:
        h = self.handle()
        return h is None or h.optimizer is None

    def remove(self) -> None:
        for r in self.removables:
            r.remove()
        self.removables = []

    def __call__(self, p: torch.Tensor) -> None:
        h = self.handle()
        if h is not None and h.optimizer is not None:
            h._accumulated(p)
            return
        # the optimizer was collected: nothing can step these parameters any more. Say so once and
        # go: left in place, every later backward of the model would fail the same way, with no
        # handle left to remove them
        self.remove()
        raise StateError(
            f"llmmem.optim.step_in_backward: the {self.optimizer_name} it steps with no longer exists (nothing else "
            "held a reference to it; step_in_backward holds it weakly, so that dropping a model and its optimizer "
            "frees them). This backward stopped before any update, and the step-in-backward hooks of its "
            f"{len(self.param_ids)} parameter(s) are removed. Keep a reference to the optimizer while it steps in "
            "backward, and call handle.remove() before dropping it"
        )


class _Tables:
    """What a handle reads its optimizer's groups through: ``optimizer.param_groups`` as last mapped
    (``groups``, and its dicts in ``group_list``), each parameter's group by id (``group_of``), and
    the one-parameter optimizers of a torch optimizer (``per_param``). Emptied when the optimizer is
    collected: they hold its parameters and state."""

    __slots__ = ("groups", "group_list", "group_of", "per_param")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.groups, self.group_list, self.group_of, self.per_param = None, [], {}, {}


class StepInBackward:
    """The handle :func:`step_in_backward` returns: ``remove()`` restores the normal step.

    ``optimizer`` is the optimizer it steps with (None once that was collected: the handle holds
    it weakly), ``scheduler`` the scheduler it steps at the end of each backward (held, and
    through it the optimizer: a scheduler is often made in the call)."""

    def __init__(self, params: list, optimizer: torch.optim.Optimizer, scheduler) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.scheduler = scheduler
        # ids, not the parameters: a handle the user keeps must not keep a dropped model alive. They
        # stay unique while the handle is active (its optimizer, alive, holds the parameters)
        self._id_list = [id(p) for p in params]
        self._ids = set(self._id_list)
        self._removed = False
        self._t = _Tables()
        self._map_groups(optimizer, where="step_in_backward")
        self._fused = hasattr(optimizer, "_step_params")  # llmmem's Adam/AdamW step one parameter natively
        if not self._fused:
            self._t.per_param = {id(p): self._sub_optimizer(optimizer, p) for p in params}
        self._backwards_since_step = 0
        self._step_called = False
        self._in_backward = False
        self._stepped: set = set()  # ids of the parameters stepped in the current backward
        self._grad_sq: dict = {}  # id(p) -> fp32 squared 2-norm of p's gradient in the last backward
        with _lock:
            for h in list(_active):
                if h.active and any(id(p) in h._ids for p in params):
                    shared = sum(1 for p in params if h.manages(p))
                    raise StateError(
                        f"step_in_backward: {shared} of these {len(params)} parameters are already stepped in "
                        f"backward by {h!r}, returned by an earlier step_in_backward call: a second one would "
                        "step them twice (or leave one optimizer never stepped). Call remove() on that handle "
                        "first, or keep using it"
                    )
            for reg in list(_registrations):  # hooks left by a collected optimizer on these parameters
                if reg.stale() and not reg.param_ids.isdisjoint(self._ids):
                    reg.remove()
            # active before the guards go in: a collection here may finalize another handle, whose
            # _forget must see this one
            _active.add(self)
            self._hooks = _Hooks(self)
            # the optimizer holds the handle (this bound method): it lives as long as the optimizer
            self._step_hook = optimizer.register_step_pre_hook(self._before_user_step)
            try:
                self._hooks.register(params)
                if not _patched:
                    _install_guards()
            except BaseException:  # e.g. a tensor that takes no accumulate hook (not a leaf)
                self._hooks.remove()
                self._step_hook.remove()
                self._removed = True
                _active.discard(self)
                _forget()
                raise
            _registrations.add(self._hooks)
        weakref.finalize(self, _forget)
        weakref.finalize(optimizer, _forget)
        # the tables hold groups, parameters and state: they go with the optimizer (not with the
        # handle, which its user may keep)
        weakref.finalize(optimizer, self._t.clear)

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self._optimizer()

    @property
    def active(self) -> bool:
        """Whether it steps its parameters now: not removed, and its optimizer exists."""
        return not self._removed and self._optimizer() is not None

    def manages(self, p) -> bool:
        return self.active and id(p) in self._ids

    def __repr__(self) -> str:
        opt = self.optimizer
        what = type(opt).__name__ if opt is not None else "a collected optimizer"
        state = "removed" if self._removed else ("active" if opt is not None else "inactive")
        return f"<StepInBackward of {what} over {len(self._id_list)} parameters, {state}, at {id(self):#x}>"

    def _map_groups(self, optimizer, where: str = "step_in_backward") -> None:
        """Which of ``optimizer.param_groups`` (as they are now) holds each parameter."""
        groups = optimizer.param_groups
        group_of = {}
        for g in groups:
            for p in g["params"]:
                group_of[id(p)] = g
        missing = [i for i, pid in enumerate(self._id_list) if pid not in group_of]
        if missing:
            raise (ValueError if where == "step_in_backward" else StateError)(
                f"{where}: {len(missing)} parameter(s) requiring grad (the first at position {missing[0]}) "
                "are not in the optimizer's param_groups; pass the optimizer that holds them all"
                + ("" if where == "step_in_backward" else " (were its groups replaced by others?)")
            )
        self._t.groups, self._t.group_list, self._t.group_of = groups, list(groups), group_of

    def _group(self, optimizer, p) -> dict:
        """``p``'s group in the optimizer's current param_groups: ``load_state_dict`` replaces the
        list and its dicts, and a group's settings must be read from the new ones."""
        if optimizer.param_groups is not self._t.groups:
            self._map_groups(optimizer, where="step_in_backward (after the optimizer's param_groups changed)")
        return self._t.group_of[id(p)]

    def _sub_optimizer(self, optimizer, p) -> torch.optim.Optimizer:
        """A one-parameter optimizer of the user's class and group settings (refreshed from the
        user's optimizer at every step), sharing its state dict (so ``optimizer.state_dict()``
        sees every parameter's state)."""
        g = self._t.group_of[id(p)]
        settings = {k: v for k, v in g.items() if k != "params"}
        try:
            sub = type(optimizer)([{"params": [p], **settings}])
        except Exception as e:
            raise TypeError(
                f"step_in_backward: cannot make a one-parameter {type(optimizer).__name__} from its group "
                f"settings ({type(e).__name__}: {e}); it works with optimizers constructed as cls(params, **defaults)"
            ) from e
        sub.state = optimizer.state
        return sub

    # ---- hooks ----------------------------------------------------------------------------

    def _check_accumulation(self) -> None:
        if self._step_called and self._backwards_since_step >= 1:
            n = self._backwards_since_step
            raise StateError(
                "a second backward without optimizer.step() in between, in a loop that calls optimizer.step(): "
                "gradient accumulation over several backwards cannot be stepped in backward. This backward was "
                f"stopped before any update, but the weights and the optimizer state have taken {n} partial "
                f"update{'s' if n > 1 else ''} since the last optimizer.step() (each backward is applied as an "
                "update of its own, on its own gradient). Restore the last checkpoint (model and optimizer), then "
                "remove step_in_backward to accumulate, or call optimizer.step() after every backward"
            )

    def _start_backward(self, optimizer) -> None:
        self._check_accumulation()
        if _in_nested_backward():
            raise StateError(
                "step_in_backward: the first gradient of this backward was accumulated inside a nested "
                "backward (reentrant activation checkpointing, torch.utils.checkpoint(..., use_reentrant=True)): "
                "each checkpointed segment is a backward of its own, so the end of the whole backward, where "
                "the scheduler steps and gradient accumulation is counted, cannot be seen. Checkpoint with "
                "use_reentrant=False (or llmmem.checkpoint), or step after backward"
            )
        groups = optimizer.param_groups
        if groups is not self._t.groups or len(groups) != len(self._t.group_list):
            self._map_groups(optimizer, where="step_in_backward (after the optimizer's param_groups changed)")
        elif any(a is not b for a, b in zip(groups, self._t.group_list)):  # a group replaced in place
            self._map_groups(optimizer, where="step_in_backward (after the optimizer's param_groups changed)")
        self._in_backward = True
        self._stepped.clear()
        self._grad_sq = {}
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _accumulated(self, p: torch.Tensor) -> None:
        optimizer = self.optimizer
        if not self._in_backward:
            self._start_backward(optimizer)
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
            group = self._group(optimizer, p)
            grad = p.grad
            if grad is not None:
                self._grad_sq[id(p)] = _grad_square(grad)
            if self._fused:
                optimizer._step_params([(group, [p])])
            else:
                sub = self._t.per_param[id(p)]
                if sub.state is not optimizer.state:  # replaced by load_state_dict
                    sub.state = optimizer.state
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
        optimizer = self.optimizer
        if optimizer is not None:
            optimizer._opt_called = True  # torch's schedulers warn of a scheduler step before any optimizer step
        if self.scheduler is not None:
            self.scheduler.step()

    def _before_user_step(self, optimizer, args, kwargs) -> None:
        n = self._backwards_since_step
        self._step_called = True
        self._backwards_since_step = 0
        if n > 1:
            raise StateError(
                f"optimizer.step() after {n} backward passes with step_in_backward: gradient accumulation over "
                "several backwards cannot be done in backward. Each backward was already applied as an update "
                f"of its own as its gradients arrived, so the weights and the optimizer state have taken {n} "
                "partial updates (each on one backward's gradient) where one accumulated update was meant; they "
                "cannot be undone. Restore the last checkpoint (model and optimizer), then remove step_in_backward "
                "to accumulate, or call optimizer.step() after every backward"
            )

    def remove(self) -> None:
        """Removes the hooks (and the guards, with the last handle); the optimizer steps normally again."""
        if self._removed:
            return
        self._removed = True
        self._hooks.remove()
        self._step_hook.remove()
        with _lock:
            _registrations.discard(self._hooks)
            _active.discard(self)
        _forget()

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
        parameter is made from its group settings, sharing its state, as torchtune does). Every
        step reads the optimizer's groups and state as they are then (schedulers, a hand-set lr,
        ``load_state_dict`` before or after this call). Held weakly: keep a reference to it.
    :param scheduler: stepped once at the end of every backward, if given.
    :returns: a handle; ``handle.remove()`` (or leaving it as a context manager) undoes it.
    :raises StateError: when an active handle already steps some of the parameters.

    Memory: at most the gradients of the parameters whose hooks have not yet run exist at once,
    instead of all of them, plus one 0-d fp32 tensor a parameter (its gradient's squared norm, for
    ``clip_grad_norm_(params, float("inf"))``, which returns the last backward's gradient norm).
    Refusals are listed in the module docstring. No host synchronisation beyond the step's own.
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
