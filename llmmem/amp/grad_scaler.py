"""Dynamic loss scaling: :class:`GradScaler`, a drop-in for :class:`torch.amp.GradScaler`.

Same constructor, methods, per-optimizer state machine (READY -> UNSCALED -> STEPPED), misuse
errors, ``state_dict`` keys and fused-optimizer contract as torch's scaler, so one replaces the
other unchanged. What differs is underneath and on top:

- the unscale + inf/NaN check is llmmem's multi-tensor C kernel on the CPU (all gradients of a
  device in one threaded pass, any mix of fp32/fp16/bf16/fp64) and its CUDA kernels on GPUs
  (one launch per dtype group, bf16 included, no host synchronisation); the scale update is
  llmmem's too (a one-thread kernel on GPUs);
- the same pass records which gradient overflowed, so after a skipped step
  :meth:`GradScaler.overflowed_params` names the culprits, and counters say how many steps were
  skipped (:meth:`GradScaler.skipped_steps`, :meth:`GradScaler.last_step_skipped`);
- options that torch lacks, off by default: ``hysteresis`` (back off only after N overflows:
  consecutive ones, or with ``hysteresis_mode="on_growth"`` Megatron's rule) and ``min_scale``
  (a floor for the scale, with a warning when hit);
- DTensor gradients (FSDP2's ``fully_shard``, tensor parallelism) are checked on their local shards
  by the same kernels, and the per-gradient flags are agreed over the mesh (one all-reduce per
  check, :mod:`llmmem.amp.sharded`): every rank skips the same steps and names the same culprits.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections import abc, defaultdict
from typing import Any, Iterable, Optional, Union

import torch
from torch.amp.grad_scaler import OptState  # the same enum, so `stage is OptState.READY` works with both

from llmmem._native import available, load_error
from llmmem.amp import cpu_unscale
from llmmem.amp import kernels as _k
from llmmem.amp import sharded as _sharded
from llmmem.amp.args import (
    ScaleInputError,
    _check_backoff_factor,
    _check_growth_factor,
    _check_growth_interval,
    _check_hysteresis,
    _check_hysteresis_mode,
    _check_init_scale,
    _check_min_scale,
    checked_state_dict,
)
from llmmem.amp.cpu_unscale import Checked
from llmmem.amp.visibility import _ScalerVisibility
from llmmem.dtensors import is_dtensor, local

__all__ = ["GradScaler", "OptState", "feature_status"]

_Parameter = torch.nn.Parameter


def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class _MultiDeviceReplicator:
    """One master tensor, copied lazily to each device asked for (copies cached). With
    ``share_own_device`` the master's own device gets the master itself: for the found_inf of
    :meth:`GradScaler._unscale_grads_`, which its callers create afresh per call and keep only
    through what ``get`` returned, so a copy (one more tensor op per unscale) would serve nobody.
    The scale's replicators copy, as torch's: a scaled output records its own copy for backward."""

    def __init__(self, master_tensor: torch.Tensor, share_own_device: bool = False) -> None:
        self.master = master_tensor
        self._share_own_device = share_own_device
        self._per_device_tensors: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        retval = self._per_device_tensors.get(device)
        if retval is None:
            master = self.master
            if self._share_own_device and device == master.device:
                retval = master
            else:
                retval = master.to(device=device, non_blocking=True, copy=True)
            self._per_device_tensors[device] = retval
        return retval


class _InverseOf:
    """Marks "the inverse of this scale tensor": the kernels take the fp64 reciprocal themselves,
    which saves torch's three small ops (double, reciprocal, float) per unscale."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale


def _weak(obj: Any) -> Any:
    """A weak reference to ``obj``, or a strong one (a callable returning it) for the rare object
    that does not support weak references."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _where(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> str:
    """Names a parameter by its place in the optimizer, for error messages."""
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if p is param:
                return f"param_groups[{gi}]['params'][{pi}]"
    return "a parameter"


class GradScaler(_ScalerVisibility):
    """Scales the loss, unscales and checks gradients, skips steps with inf/NaN gradients and
    adapts the scale: :class:`torch.amp.GradScaler`'s behaviour on llmmem's kernels.

    Example::

        scaler = llmmem.GradScaler("cuda")
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)                 # optional, e.g. to clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            if not scaler.last_step_skipped():         # synchronises: read it only when needed
                scheduler.step()

    Args:
        device (str): device type of the scale, ``"cuda"`` or ``"cpu"`` (others fall back to torch's ops).
        init_scale (float): initial scale, > 0. Default ``2.0**16``.
        growth_factor (float): multiplier after ``growth_interval`` clean steps, > 1. Default 2.0.
        backoff_factor (float): multiplier after an overflow, in (0, 1). Default 0.5.
        growth_interval (int): clean steps before growing, >= 1. Default 2000.
        enabled (bool): ``False`` makes every method a no-op (``step`` just calls ``optimizer.step()``).

    Keyword args:
        hysteresis (int): back off only after this many consecutive overflowing steps. Default 1:
            torch's rule (back off on every overflow). This is the *consecutive* variant (apex's
            ``update_scale_hysteresis``, DeepSpeed with ``consecutive_hysteresis=True``): a budget
            starts at ``hysteresis``; each overflowing step spends one and backs off once it is
            spent, and every overflowing step after that backs off too, until a clean step; *any*
            clean step refills the budget. Megatron-LM's ``DynamicGradScaler`` and DeepSpeed's
            default (``consecutive_hysteresis=False``) refill the budget only when the scale
            *grows* (after ``growth_interval`` clean steps), so there overflows separated by
            clean steps still add up within a growth interval. Example with ``hysteresis=2``,
            steps overflow / clean / overflow (``growth_interval`` > 1): here no backoff (the clean step refilled the
            budget); in Megatron/DeepSpeed's default the scale backs off at the second overflow.
            The budget is in :meth:`state_dict` (``"_hysteresis_tracker"``).
        hysteresis_mode (str): ``"consecutive"`` (default: the rule above) or ``"on_growth"``:
            Megatron-LM's and DeepSpeed's default rule, where only a growth of the scale refills
            the budget. No effect when ``hysteresis`` is 1.
        min_scale (float or None): never back off below this scale (a warning is issued, once, the
            first time it is hit: right away on the CPU; on GPUs an update or two later, from a copy of
            the counters that is read only once it has arrived, so no update waits for the GPU).
            Default ``None``: no floor, as torch.

    With the defaults the scale trajectory, growth tracker, skipped steps and ``state_dict`` are
    those of ``torch.amp.GradScaler``.

    Invalid settings raise :class:`ValueError` naming the setting, never a bare ``assert`` (the
    error is also an ``AssertionError``, what torch raises for a bad growth or backoff factor, so
    code written against torch keeps catching it); wrong types raise :class:`TypeError`.

    .. note::
        Synchronisation: :meth:`unscale_` and :meth:`update` never synchronise with the GPU; neither
        does :meth:`step` with a fused optimizer (``fused=True``). A non-fused :meth:`step` reads the
        inf flag on the host (one sync, as torch). :meth:`get_scale`, :meth:`state_dict` and the
        visibility readers (:meth:`skipped_steps`, :meth:`last_step_skipped`,
        :meth:`overflowed_params`, :meth:`stats`) synchronise. Exception: the first use of llmmem's
        CUDA kernels on a GPU in a process runs a known-answer self-check of them there (a few small
        kernel runs compared with torch's ops) and synchronises once to read its verdict; kernels
        that fail it are not used on that GPU (torch's ops are, with one warning). When that first
        use falls inside a CUDA graph capture, the check waits for a later call outside capture
        and the captured step uses torch's ops.

    Memory: a few scalars per device plus one byte per gradient (the overflow flags).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: Optional[float] = None,
        hysteresis_mode: str = "consecutive",
    ) -> None:
        self._device = device
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("llmmem.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        if self._enabled:
            _check_init_scale(init_scale)
            _check_growth_factor(growth_factor)
            _check_backoff_factor(backoff_factor)
            _check_growth_interval(growth_interval)
            _check_hysteresis(hysteresis)
            _check_hysteresis_mode(hysteresis_mode)
            _check_min_scale(min_scale, init_scale)
            self._init_scale = init_scale
            self._scale: Optional[torch.Tensor] = None  # created on the first scale(), on its tensor's device
            self._growth_factor = growth_factor
            self._backoff_factor = backoff_factor
            self._growth_interval = growth_interval
            self._init_growth_tracker = 0
            self._growth_tracker: Optional[torch.Tensor] = None
            self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
            self._hysteresis = int(hysteresis)
            self._hysteresis_mode = hysteresis_mode
            self._min_scale = min_scale
            self._init_hysteresis_tracker = int(hysteresis)
            self._hysteresis_tracker: Optional[torch.Tensor] = None
            self._stats: Optional[torch.Tensor] = None  # int64 [updates, skipped, last_skipped, min_scale_hits]
            self._init_stats = [0, 0, 0, 0]
            self._min_scale_warned = False
            # id(optimizer) -> (weak reference to it, flat param_groups positions of the checked grads,
            # {device: (flags, positions)}): nothing here keeps the optimizer or its tensors alive
            self._overflow: dict[int, tuple[Any, list, dict]] = {}
            self._overflow_stale = False

    # ------------------------------------------------------------------ lazy state

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"llmmem.GradScaler: Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"llmmem.GradScaler: Attempted {funcname} but _growth_tracker is None.  " + fix)
        return (self._scale, self._growth_tracker)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("llmmem.GradScaler: _growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._ensure_extras(dev)

    def _ensure_extras(self, dev: torch.device) -> None:
        # Subclasses or users may set _scale themselves; the extra state follows its device.
        if self._hysteresis_tracker is None or self._hysteresis_tracker.device != dev:
            self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        if self._stats is None or self._stats.device != dev:
            # zeros() is a device fill; torch.tensor(list, device="cuda") would be a synchronising copy
            self._stats = torch.zeros(4, dtype=torch.int64, device=dev)
            if any(self._init_stats):  # counters carried over by pickling
                self._stats.copy_(torch.tensor(self._init_stats, dtype=torch.int64), non_blocking=True)

    # ------------------------------------------------------------------ torch's API

    def scale(
        self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]
    ) -> Union[torch.Tensor, Iterable[torch.Tensor]]:
        """Multiplies a tensor, or (nested) lists/tuples/iterables of tensors, by the scale.

        Returns the scaled outputs (lists and tuples keep their type, other iterables come back as
        a lazy ``map``, as torch). Disabled: returns ``outputs`` unchanged. No synchronisation.

        Raises:
            TypeError: a leaf is not a tensor (the error is also a ``ValueError``, torch's type).
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        stash: list[_MultiDeviceReplicator] = []

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                if not stash:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    stash.append(_MultiDeviceReplicator(self._scale))
                return val * stash[0].get(val.device)
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ScaleInputError(
                f"llmmem.GradScaler: outputs must be a Tensor or an iterable of Tensors, got {type(val).__name__}"
            )

        return apply_scale(outputs)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: Union[torch.Tensor, _InverseOf],
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscales and checks ``optimizer``'s gradients, one kernel call per device.

        ``inv_scale``: a tensor holding the inverse scale (torch's contract, kept for subclasses), or
        :class:`_InverseOf` the scale. Returns ``{device: found_inf}``; also records which gradient
        overflowed for :meth:`overflowed_params`. Unlike torch's, the entry for ``found_inf``'s own
        device is ``found_inf`` itself, not a copy: pass a fresh zero tensor on every call.
        """
        if isinstance(inv_scale, _InverseOf):
            per_device_scale, is_inverse = _MultiDeviceReplicator(inv_scale.scale), False
        else:
            per_device_scale, is_inverse = _MultiDeviceReplicator(inv_scale), True
        per_device_found_inf = _MultiDeviceReplicator(found_inf, share_own_device=True)

        def general(resume: int) -> Checked:
            return self._unscale_general_(
                optimizer, per_device_scale, is_inverse, per_device_found_inf, allow_fp16, resume
            )

        checked = None
        # DTensor parameters take the general walk, on every rank, whatever gradients it holds: it
        # agrees their flags over the mesh (a collective) even where a rank has none of them. The C
        # walk takes exact Tensor/Parameter parameters only, so it hands over at or before the first
        # DTensor parameter, and general(resume) sees all of them; no walk in Python to find them.
        if found_inf.is_cpu:
            checked = cpu_unscale.unscale_(
                optimizer.param_groups,
                per_device_scale.master,
                is_inverse,
                found_inf,
                allow_fp16,
                general,
                on_partial_failure=lambda partial: self._record_partly_unscaled(optimizer, partial),
            )
        if checked is None:
            checked = general(0)
        groups = _sharded.tp_groups(optimizer.param_groups)  # llmmem's tensor-parallel slices
        if groups:
            _sharded.agree_found_inf(checked.found_inf_per_device, groups)
        self._record_overflow(optimizer, checked)
        return checked.found_inf_per_device

    def _record_partly_unscaled(self, optimizer: torch.optim.Optimizer, checked: Checked) -> None:
        """The CPU fast path unscaled some gradients before an exception (see
        :mod:`llmmem.amp.cpu_unscale`): the optimizer is recorded as unscaled with an overflow, so
        no later call unscales them twice, :meth:`step` skips it and :meth:`update` takes it as an
        overflow (backs off, or counts towards ``hysteresis``)."""
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = checked.found_inf_per_device
        state["stage"] = OptState.UNSCALED
        self._record_overflow(optimizer, checked)

    def _unscale_general_(
        self,
        optimizer: torch.optim.Optimizer,
        per_device_scale: _MultiDeviceReplicator,
        is_inverse: bool,
        per_device_found_inf: _MultiDeviceReplicator,
        allow_fp16: bool,
        resume: int,
    ) -> Checked:
        """The walk in Python, for every case the C walk does not take, over the parameters from
        flat position ``resume`` on (torch's ``_unscale_grads_``, on llmmem's kernels)."""
        # The walk over parameters is the per-tensor cost that dominates lists of many small
        # gradients, so it reads one attribute per parameter and allocates no object per parameter
        # (thousands of small tuples per step would also wake the garbage collector); the checks
        # then run over whole lists.
        # `slots`: each checked gradient's position in the flattened param_groups, kept (not the
        # parameters) so the overflow record does not keep a deleted model's tensors alive.
        owners, grads, slots = [], [], []
        # every DTensor parameter, with or without a gradient here: the same list on every rank
        dtensor_params = _sharded.dtensor_params(optimizer.param_groups, resume)
        slot = -1
        for group in optimizer.param_groups:
            for param in group["params"]:
                slot += 1
                if slot < resume:
                    continue
                # `type(...) is Parameter` first: isinstance on torch.Tensor goes through a metaclass
                if type(param) is not _Parameter and not isinstance(param, torch.Tensor):
                    raise AssertionError(
                        f"llmmem.GradScaler: expected param to be torch.Tensor, got {type(param).__name__}"
                    )
                grad = param.grad
                if grad is not None:
                    grads.append(grad)
                    owners.append(param)
                    slots.append(slot)
        flags_per_device = {}
        with torch.no_grad():
            # DTensor gradients (FSDP2, tensor parallelism): the kernels check their local shards, each
            # with its own flag, and the flags are then agreed over their meshes (llmmem.amp.sharded).
            sharded = [(k, g) for k, g in enumerate(grads) if type(g) is not torch.Tensor and is_dtensor(g)]
            for k, g in sharded:
                grads[k] = local(g)
            dtypes = [g.dtype for g in grads]
            if not allow_fp16 and torch.float16 in dtypes:
                raise ValueError("llmmem.GradScaler: Attempting to unscale FP16 gradients.")
            strided = torch.strided
            layouts = [g.layout for g in grads]
            for k in [] if layouts.count(strided) == len(layouts) else range(len(grads)):
                g = grads[k]
                if layouts[k] is strided:
                    continue
                param = owners[k]
                if not g.is_sparse:
                    raise TypeError(
                        f"llmmem.GradScaler: the gradient of {_where(optimizer, param)} has "
                        f"layout {g.layout}; only strided and sparse COO gradients are supported"
                    )
                # Duplicate indices of an uncoalesced fp16 grad could overflow when summed, so check
                # the coalesced values (what torch does).
                if g.dtype is torch.float16:
                    param.grad = g = g.coalesce()
                grads[k] = g._values()
            codes_of = _k.DTYPE_CODES
            codes = [codes_of.get(dt, -1) for dt in dtypes]
            if -1 in codes:
                k = codes.index(-1)
                raise TypeError(
                    f"llmmem.GradScaler: the gradient of {_where(optimizer, owners[k])} has dtype "
                    f"{dtypes[k]}; supported: float32, float16, bfloat16, float64"
                )
            # get_device() is an int (-1 = CPU), cheaper than building torch.device objects; it cannot
            # tell cuda:0 from xpu:0, a mix no optimizer holds in practice.
            dev_ids = [g.get_device() for g in grads]
            groups = (
                {dev_ids[0]: list(range(len(grads)))}
                if grads and dev_ids.count(dev_ids[0]) == len(grads)
                else self._group_positions(dev_ids)
            )
            for pos in groups.values():
                device = grads[pos[0]].device
                sub = grads if len(pos) == len(grads) else [grads[k] for k in pos]
                sub_codes = codes if len(pos) == len(grads) else [codes[k] for k in pos]
                flags = torch.zeros(len(sub), dtype=torch.uint8, device=device)
                _k.unscale_check_(
                    sub,
                    per_device_found_inf.get(device),
                    flags,
                    per_device_scale.get(device),
                    scale_is_inverse=is_inverse,
                    codes=sub_codes,
                )
                flags_per_device[device] = (flags, pos)
            if dtensor_params:
                checked_at = {slots[k]: k for k, _ in sharded}
                members = [(checked_at.get(slot), slot, param) for slot, param in dtensor_params]
                _sharded.agree(members, flags_per_device, per_device_found_inf.get, slots)
        return Checked(slots, flags_per_device, per_device_found_inf._per_device_tensors)

    def _record_overflow(self, optimizer: torch.optim.Optimizer, checked: Checked) -> None:
        """Keeps this check's per-gradient flags for :meth:`overflowed_params` (see ``_overflow``)."""
        if self._overflow_stale:  # first check of a new iteration: forget the last one's culprits
            self._overflow.clear()
            self._overflow_stale = False
        self._overflow[id(optimizer)] = (_weak(optimizer), checked.slots, checked.flags_per_device)

    @staticmethod
    def _group_positions(dev_ids: list) -> dict:
        groups: dict = {}
        for k, d in enumerate(dev_ids):
            groups.setdefault(d, []).append(k)
        return groups

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides ("unscales") the optimizer's gradients by the scale, checking them for inf/NaN
        in the same pass.

        Optional: :meth:`step` unscales if you did not. Call it to work on true gradients before
        :meth:`step`, e.g. ``clip_grad_norm_``. At most once per optimizer per :meth:`update`.

        .. note:: :meth:`unscale_` does not synchronise with the GPU.

        .. note:: On the CPU, with 256 parameters or more and more than one torch thread, worker
           threads unscale the gradients already found while the rest are still being looked up.
           If a later gradient then raises (fp16, an unsupported dtype or layout), or an interrupt
           comes, the ones before it stay unscaled, which torch would not have done; the step is
           then recorded as overflowed (:meth:`step` skips it, :meth:`update` takes it as an
           overflow), so nothing is unscaled twice, and the exception carries a note saying so.

        Raises:
            RuntimeError: called twice for ``optimizer`` since the last :meth:`update`, or after :meth:`step`.
            ValueError: a gradient is fp16 (``"Attempting to unscale FP16 gradients."``, as torch).
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "llmmem.GradScaler: unscale_() has already been called on this optimizer since the last update()."
            )
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("llmmem.GradScaler: unscale_() is being called after step().")
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        if type(self)._unscale_grads_ is GradScaler._unscale_grads_:
            # The kernels take 1 / scale in fp64 themselves, exactly torch's
            # scale.double().reciprocal().float(), saving those three small ops.
            inv_scale: Union[torch.Tensor, _InverseOf] = _InverseOf(self._scale)
        else:
            # An override follows torch's contract: it gets the inverse scale as a tensor.
            inv_scale = self._scale.double().reciprocal().float()
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        optimizer_state["stage"] = OptState.UNSCALED

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Optional[float]:
        retval: Optional[float] = None
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            retval = optimizer.step(*args, **kwargs)
        return retval

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        """Unscales (unless :meth:`unscale_` was called) and runs ``optimizer.step(*args, **kwargs)``
        unless a gradient holds inf/NaN. Returns what ``optimizer.step`` returned, or ``None`` when skipped.

        Optimizers that do their own scaling (``_step_supports_amp_scaling``, e.g. torch's
        ``fused=True`` Adam/AdamW/SGD) get ``optimizer.grad_scale`` and ``optimizer.found_inf`` and are
        always stepped: the skip happens inside their kernel, with no host synchronisation. Other
        optimizers cost one host read of the inf flag (as torch).

        Raises:
            RuntimeError: a ``closure`` is passed, or :meth:`step` was already called since :meth:`update`.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("llmmem.GradScaler: Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("llmmem.GradScaler: step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            kwargs_ = kwargs
            has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "llmmem.GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs_.update({"grad_scaler": self})
            else:
                if optimizer_state["stage"] is OptState.READY:
                    self._check_inf_per_device(optimizer)
                scaler = self._get_scale_async()
                found_inf = sum(
                    [t.to(scaler.device, non_blocking=True) for t in optimizer_state["found_inf_per_device"].values()]
                )
                optimizer.grad_scale = (
                    getattr(optimizer, "grad_scale", None)
                    if optimizer_state["stage"] == OptState.UNSCALED
                    else scaler * getattr(optimizer, "grad_scale", 1)
                )
                optimizer.found_inf = found_inf
            retval = optimizer.step(*args, **kwargs_)
            optimizer_state["stage"] = OptState.STEPPED
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
            return retval

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("llmmem.GradScaler: No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """Updates the scale: times ``backoff_factor`` if any optimizer found inf/NaN this
        iteration (once the ``hysteresis`` budget is spent, see ``hysteresis_mode``; never below
        ``min_scale``), times ``growth_factor`` after ``growth_interval`` clean iterations in a row.
        ``new_scale`` (a float or a 1-element tensor) sets the scale instead.

        Call once per iteration, after :meth:`step` for every optimizer. No synchronisation
        (on CUDA the update is one tiny kernel on the current stream).
        """
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, float):
                self._scale.fill_(new_scale)
            else:
                reason = (
                    "llmmem.GradScaler: new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if not isinstance(new_scale, torch.Tensor):
                    raise TypeError(reason)
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale)
        else:
            found_infs = [
                found_inf.to(device=_scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if len(found_infs) == 0:
                raise AssertionError("llmmem.GradScaler: No inf checks were recorded prior to update.")
            self._ensure_extras(_scale.device)
            _k.update_scale_(
                _scale,
                _growth_tracker,
                self._hysteresis_tracker,
                self._stats,
                found_infs,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
                self._hysteresis,
                float(self._min_scale or 0.0),
                self._hysteresis_mode == "on_growth",
            )
            if _scale.device.type == "cpu":  # free to read on the host
                self._warn_if_min_scale_hit()
            elif self._min_scale is not None and not self._min_scale_warned:
                self._poll_min_scale_hits()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._overflow_stale = True

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (``init_scale`` before the first :meth:`scale`, 1.0
        when disabled).

        .. warning:: :meth:`get_scale` synchronises with the GPU.
        """
        if self._enabled:
            scale = self._get_scale_async()
            if scale is None:
                return self._init_scale
            self._warn_if_min_scale_hit()
            return float(scale.item())
        return 1.0

    def get_growth_factor(self) -> float:
        """The scale growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the scale growth factor (> 1, else ``ValueError``)."""
        _check_growth_factor(new_factor)
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The scale backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the scale backoff factor (in (0, 1), else ``ValueError``)."""
        _check_backoff_factor(new_factor)
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The number of clean iterations before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval (an int >= 1, else ``ValueError``)."""
        _check_growth_interval(new_interval)
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if self._enabled:
            return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())
        return 0

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: ``"scale"``, ``"growth_factor"``, ``"backoff_factor"``,
        ``"growth_interval"``, ``"_growth_tracker"`` (torch's keys, so torch's scaler loads it), plus
        ``"hysteresis"``, ``"_hysteresis_tracker"``, ``"min_scale"`` and ``"hysteresis_mode"`` when
        those options are used.
        ``{}`` when disabled. Call it after :meth:`update`.

        .. warning:: synchronises with the GPU.
        """
        if not self._enabled:
            return {}
        sd = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        mode = self._hysteresis_mode
        if self._hysteresis != 1 or self._min_scale is not None or mode != "consecutive":
            sd["hysteresis"] = self._hysteresis
            sd["_hysteresis_tracker"] = self._get_hysteresis_tracker()
            sd["min_scale"] = self._min_scale
            sd["hysteresis_mode"] = mode
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state from :meth:`state_dict`, of this class or of ``torch.amp.GradScaler`` (whose
        state has no hysteresis: this scaler keeps its own options, with a full hysteresis budget).
        No-op when disabled.

        The whole dict is checked before anything changes, as the constructor checks its
        arguments; on an error the scaler is as it was.

        Raises:
            RuntimeError: ``state_dict`` is empty (saved from a disabled scaler), as torch.
            KeyError: a key is missing (the error is also a ``ValueError``).
            TypeError: a value of the wrong type, or ``state_dict`` is not a dict.
            ValueError: a value out of range (e.g. ``min_scale`` above ``scale``), naming the key.
        """
        if not self._enabled:
            return
        sd = checked_state_dict(state_dict, self._hysteresis, self._min_scale, self._hysteresis_mode)
        self._init_scale = sd["scale"]
        if self._scale is not None:
            self._scale.fill_(sd["scale"])
        self._growth_factor = sd["growth_factor"]
        self._backoff_factor = sd["backoff_factor"]
        self._growth_interval = sd["growth_interval"]
        self._init_growth_tracker = sd["_growth_tracker"]
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(sd["_growth_tracker"])
        self._hysteresis = sd["hysteresis"]
        self._min_scale = sd["min_scale"]
        self._hysteresis_mode = sd["hysteresis_mode"]
        self._init_hysteresis_tracker = sd["_hysteresis_tracker"]
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "llmmem.GradScaler: A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_init_stats"] = self._read_stats()
            state["_scale"] = None
            state["_growth_tracker"] = None
            state["_hysteresis_tracker"] = None
            state["_stats"] = None
            state["_overflow"] = {}
            state.pop("_stats_poll", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._enabled:  # pickled before the hysteresis_mode option existed: the default rule
            self.__dict__.setdefault("_hysteresis_mode", "consecutive")

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=_scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=_scale.device)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = self._unscale_grads_(
            optimizer, dummy_inv_scale, found_inf, True
        )
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())


def feature_status() -> tuple[bool, str]:
    """(usable, detail) for ``python -m llmmem info``."""
    if not available():
        return False, f"C core not loaded: {load_error!r}"
    if not _k.cuda_kernels_built():
        return True, "CPU kernel (fp32/fp16/bf16/fp64); CUDA kernels not built: torch's ops on GPUs"
    try:
        gpu = torch.cuda.is_available()
    except Exception:
        gpu = False
    if not gpu:
        return True, "CPU kernel (fp32/fp16/bf16/fp64); CUDA kernels built, but no usable GPU here"
    return True, (
        "CPU kernel + CUDA kernels (fp32/fp16/bf16/fp64); each GPU's kernels are checked "
        "against torch's ops on first use, torch's ops serve it if they disagree"
    )
