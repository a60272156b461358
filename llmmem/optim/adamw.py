"""``llmmem.optim.Adam`` and ``llmmem.optim.AdamW``: torch's Adam/AdamW with their moments in
fp32, bf16, 8 or 4 bits, bf16 weights updated without an fp32 master, and one fused kernel call
per parameter group.

With ``state_dtype="fp32"`` and fp32 parameters the update is torch's single-tensor AdamW
(``torch.optim.AdamW(foreach=False)``) operation for operation: a drop-in. The other formats
(:mod:`llmmem.optim.formats`) keep the same update and store the moments in less memory:

==============  ===============================  ==============================================
``state_dtype``  state a parameter (+ master)     what is lost
==============  ===============================  ==============================================
``"fp32"``       8 B                              nothing
``"bf16"``       4 B                              moments rounded (stochastically) to bf16
``"int8"``       2 B + 8 B / block (256)          moments to 8-bit codes with a scale a block
``"int4"``       1 B + 8 B / block (128)          moments to 4-bit codes
==============  ===============================  ==============================================

Parameters smaller than ``min_quantized_numel`` elements (biases, norms) keep fp32 moments in
the quantized formats, as bitsandbytes does: they cost little and are the sensitive ones.

bf16 parameters are updated in fp32 and rounded back with stochastic rounding (unbiased: an
update far below the bf16 step still moves the weight on average), so no fp32 master copy is
needed; ``stochastic_rounding=False`` rounds to nearest, and ``master_weights=True`` keeps an
fp32 master in the state instead (4 B a parameter more). fp16 parameters need the master.

A step is all-or-nothing: every parameter's gradient is checked and every missing state
allocated before any parameter changes, so an error (an out-of-memory error included) leaves
parameters and state as they were.

Memory and synchronisation: a CPU step runs in the calling thread and ``torch.get_num_threads()``
threads, with the GIL released; a CUDA step is queued on the current stream without a host
synchronisation (a tensor ``lr`` is read with ``float()``, which synchronises).
"""

from __future__ import annotations

import math
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch

from llmmem._native import native
from llmmem.optim import formats, kernels
from llmmem.optim.formats import Format
from llmmem.optim.kernels import Hyper, Item
from llmmem.optim.offload import Offload
from llmmem.optim.records import head_of, record

_FLOAT_PARAMS = (torch.float32, torch.bfloat16, torch.float16)
_LLMMEM_KEYS = ("state_dtype", "block_size", "stochastic_rounding", "min_quantized_numel", "master_weights")


_DTENSOR: list = []  # [DTensor or None], looked up once


def _dtensor_type():
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch without distributed support
            DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def _is_dtensor(t) -> bool:
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


def _shard_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out as the DTensor parameter ``p`` (a moment or master of the
    parameter's shape), so that distributed checkpointing (DCP) saves and reshards it as torch's
    own optimizers' state; ``local`` itself for a plain parameter."""
    if not _is_dtensor(p):
        return local
    dt = _dtensor_type()
    return dt.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _wrap_state(p: torch.Tensor, state: dict, fmt: Format) -> dict:
    """The parameter-shaped tensors of a state (unquantized moments, master) laid out as ``p``."""
    if _is_dtensor(p):
        keys = ("master",) if fmt.quantized else ("exp_avg", "exp_avg_sq", "master")
        for key in keys:
            if key in state:
                state[key] = _shard_like(p, state[key])
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a kernel works on: a DTensor's local shard, else ``t`` itself."""
    return t.to_local() if _is_dtensor(t) else t


def _local_grad(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient's local tensor laid out as ``p``'s: a DTensor gradient placed otherwise than its
    parameter (e.g. a partial sum) is redistributed to the parameter's placements first."""
    dt = _dtensor_type()
    if dt is not None and isinstance(p, dt):
        if not isinstance(g, dt):
            raise TypeError("llmmem.optim: a DTensor parameter has a plain-tensor gradient; expected a DTensor")
        if g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        return g.to_local()
    return g


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a per-parameter seed from the optimizer's seed and an index."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _number(value, name: str, *, low: float = 0.0, allow_tensor: bool = False) -> float:
    if allow_tensor and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a number or a one-element tensor, got a tensor of {value.numel()} elements"
            )
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (value >= low) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number >= {low:g}, got {value}")
    return float(value)


def _check_group_settings(group: dict) -> None:
    """Raises ValueError/TypeError naming the first setting of ``group`` out of range."""
    lr = _number(group["lr"], "lr", allow_tensor=True)
    if not (lr >= 0) or not math.isfinite(lr):
        raise ValueError(f"lr must be a finite number >= 0, got {lr}")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of numbers, got {betas!r}")
    for i, b in enumerate(betas):
        b = _number(b, f"betas[{i}]", allow_tensor=True)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    _number(group["eps"], "eps")
    _number(group["weight_decay"], "weight_decay")
    dtype = formats.check_state_dtype(group["state_dtype"])
    if group["block_size"] is not None:
        formats.check_block_size(group["block_size"])
    elif dtype in formats.QUANTIZED:
        pass  # the format's default, chosen per parameter
    sr = group["stochastic_rounding"]
    if sr is not None and not isinstance(sr, bool):
        raise TypeError(f"stochastic_rounding must be None, True or False, got {sr!r}")
    mq = group["min_quantized_numel"]
    if isinstance(mq, bool) or not isinstance(mq, int) or mq < 0:
        raise ValueError(f"min_quantized_numel must be an int >= 0, got {mq!r}")
    if not isinstance(group["master_weights"], bool):
        raise TypeError(f"master_weights must be True or False, got {group['master_weights']!r}")
    if group.get("amsgrad"):
        raise ValueError("amsgrad=True is not supported by llmmem.optim (use torch.optim.AdamW for AMSGrad)")
    if group.get("capturable"):
        raise ValueError("capturable=True is not supported by llmmem.optim: its step keeps its counters on the host")
    if group.get("differentiable"):
        raise ValueError("differentiable=True is not supported by llmmem.optim")


def _check_param(p: torch.Tensor, group: dict, where: str) -> None:
    if p.is_complex():
        raise TypeError(f"{where} is complex ({p.dtype}); llmmem.optim supports float32, bfloat16 and float16")
    if p.dtype not in _FLOAT_PARAMS:
        raise TypeError(f"{where} is {p.dtype}; llmmem.optim supports float32, bfloat16 and float16 parameters")
    if p.dtype == torch.float16 and not group["master_weights"]:
        raise ValueError(
            f"{where} is float16: its updates would be lost to fp16's rounding and range without an fp32 master; "
            "pass master_weights=True (4 bytes a parameter more), or train in bf16"
        )


# The state entries whose addresses a record head holds (llmmem.optim.records.head_of), in the
# order csrc/python/optim.c (optim_adamw_walk) checks them, with their fields in the head.
_HEAD_KEYS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "step")
_HEAD_FIELDS = (1, 2, 3, 4, 5, 6)


class _Cached:
    """A parameter's record without its gradient (:func:`llmmem.optim.records.head_of`), and what
    it was made from: the state dict and every state tensor whose address the record holds (one
    replaced by hand, or moved to other storage with ``.data =``, makes it stale; holding them
    keeps a replaced one's memory alive until the record is dropped), the parameter's version
    when it has a master (the master follows outside writes)."""

    __slots__ = ("key", "fmt", "device", "param", "head", "state", "tensors", "version", "grad_dtype")

    def __init__(self, key: tuple, fmt: Format, device: torch.device, item: Item, p: torch.Tensor) -> None:
        self.key, self.fmt, self.device, self.param = key, fmt, device, p
        self.grad_dtype = item.grad.dtype
        self.head = head_of(item.param, item.master, item.state, item.seed)
        self.state = item.state
        self.tensors = tuple(item.state.get(k) for k in _HEAD_KEYS)
        self.version = p._version if item.master is not None else None

    def state_unchanged(self) -> bool:
        """Whether the state still holds, on the same storage, every tensor the head points at."""
        get, head = self.state.get, self.head
        for key, field, t in zip(_HEAD_KEYS, _HEAD_FIELDS, self.tensors):
            if get(key) is not t or (t is not None and t.data_ptr() != head[field]):
                return False
        return True


class _StateDict(defaultdict):
    """The optimizer's ``state``: a defaultdict that counts its changes (``generation``), so that
    the C walk of a group (:class:`_GroupCache`) is not taken after an entry was replaced."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.generation = 0

    def _changed(self) -> None:
        self.generation += 1

    def __setitem__(self, key, value) -> None:
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._changed()
        super().__delitem__(key)

    def clear(self) -> None:
        self._changed()
        super().clear()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def update(self, *args, **kwargs) -> None:
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)

    def __ior__(self, other):
        self._changed()
        return super().__ior__(other)

    def __reduce__(self):
        return (_StateDict, (self.default_factory, dict(self)))


_KINDS: list = []


def _kinds() -> tuple:
    """What the C walk compares against: (Tensor, Parameter, float32, float16, bfloat16)."""
    if not _KINDS:
        _KINDS.append((torch.Tensor, torch.nn.Parameter, torch.float32, torch.float16, torch.bfloat16))
    return _KINDS[0]


class _GroupCache:
    """The lists the C walk of a CPU parameter group reads (csrc/python/optim.c: optim_adamw_walk):
    the group's parameters as they were, and for each its cached record head, state dict, first
    state tensors (:data:`_HEAD_KEYS`), version (with a master; else -1) and format; None for a
    parameter not cached (one that has no state yet, or is stepped elsewhere): it sends the walk to
    the general path once it has a gradient. Valid while the state dict is the one it was made with
    and unchanged."""

    __slots__ = ("lists", "state_dict", "generation")

    @classmethod
    def of(cls, group: dict, cached: dict, state: _StateDict) -> Optional[_GroupCache]:
        params = list(group["params"])
        heads, states, tensors, versions, fmts = [], [], [], [], []
        for p in params:
            c = cached.get(id(p))
            if c is not None and c.param is p and c.device.type != "cpu":
                return None  # stepped by the device's kernels: the Python hot path takes it
            ok = c is not None and c.param is p and state.get(p) is c.state
            heads.append(c.head if ok else None)
            states.append(c.state if ok else None)
            tensors.append(c.tensors if ok else None)
            versions.append(c.version if ok and c.version is not None else -1)
            fmts.append(c.fmt.code << 16 | (c.fmt.block or 256) if ok else 0)
        gc = cls()
        gc.lists = (params, heads, states, tensors, versions, fmts)
        gc.state_dict, gc.generation = state, state.generation
        return gc


class Adam(torch.optim.Optimizer):
    """Adam, or AdamW with ``decoupled_weight_decay=True``, with compact state (see the module).

    :param params: parameters or parameter groups, as for any torch optimizer; each group may set
        every argument below, ``state_dtype`` included.
    :param lr: learning rate (a number or a one-element tensor).
    :param betas: coefficients of the running averages of the gradient and its square.
    :param eps: added to the denominator.
    :param weight_decay: L2 penalty (Adam) or decoupled decay (AdamW).
    :param decoupled_weight_decay: AdamW's decay, applied to the weights (torch's argument).
    :param state_dtype: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"``.
    :param block_size: elements per scale of the quantized formats, a power of two in
        [32, 4096]; None: 256 for int8, 128 for int4.
    :param stochastic_rounding: for bf16 parameters without a master: None or True rounds the
        updated weights stochastically, False to nearest.
    :param min_quantized_numel: parameters with fewer elements keep fp32 moments in the
        quantized formats.
    :param master_weights: keep an fp32 master of bf16/fp16 parameters in the state (needed for
        fp16 parameters).
    :param maximize: ascend the objective.
    :param seed: the seed of stochastic rounding (None: drawn from torch's default generator,
        so ``torch.manual_seed`` makes a run reproducible).
    :param offload: ``"cpu"`` keeps the state (moments, masters) in host memory and steps it
        there with the C kernel; gradients go to the host and weights come back each step
        (:mod:`llmmem.optim.offload`). Not for DTensor parameters.
    :param amsgrad, foreach, fused, capturable, differentiable: torch's arguments, accepted for
        a drop-in: ``foreach`` and ``fused`` change nothing (the step is always one fused call);
        ``amsgrad``, ``capturable`` and ``differentiable`` must be False.
    """

    _always_decoupled = False  # AdamW: a loaded state's groups keep decoupled_weight_decay=True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        state_dtype: str = "fp32",
        block_size: Optional[int] = None,
        stochastic_rounding: Optional[bool] = None,
        min_quantized_numel: int = 4096,
        master_weights: bool = False,
        maximize: bool = False,
        seed: Optional[int] = None,
        offload: Optional[str] = None,
        amsgrad: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=bool(decoupled_weight_decay),
            state_dtype=state_dtype,
            block_size=block_size,
            stochastic_rounding=stochastic_rounding,
            min_quantized_numel=min_quantized_numel,
            master_weights=master_weights,
            maximize=bool(maximize),
            amsgrad=amsgrad,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
        )
        _check_group_settings(defaults)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self._seed = seed & 0xFFFFFFFFFFFFFFFF
        if offload not in (None, "cpu"):
            raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
        self._offload = Offload() if offload == "cpu" else None
        self._versions: dict = {}  # parameter -> its version counter when a step last saw it (masters)
        self._cached: dict = {}  # id(parameter) -> _Cached (the hot path of _step_params)
        self._group_caches: dict = {}  # id(group) -> _GroupCache (the C walk of a CPU group)
        self._index_cache = None  # (the groups' lists and lengths, {id(p): (position, p)})
        super().__init__(params, defaults)
        self.state = _StateDict(dict, self.state)

    # ---- pickling (copy.deepcopy, multiprocessing) ----------------------------------------

    def __getstate__(self) -> dict:
        # torch keeps defaults, state and groups; the seed and the offload choice travel too.
        # The caches do not: their records are addresses of this process's tensors.
        out = super().__getstate__()
        out.pop("_index_cache", None)
        out["_seed"] = self._seed
        out["_offload_kind"] = "cpu" if self._offload is not None else None
        return out

    def __setstate__(self, state: dict) -> None:
        kind = state.pop("_offload_kind", None)
        super().__setstate__(state)
        self._offload = Offload() if kind == "cpu" else None
        self._versions, self._cached, self._group_caches = {}, {}, {}
        self._index_cache = None
        if not isinstance(self.state, _StateDict):
            self.state = _StateDict(dict, self.state)

    # ---- groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, and each group's settings and parameters are checked (ValueError/TypeError
        naming what is wrong) before the group is added."""
        n_before = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group_settings(group)
            first: dict = {}
            for i, p in enumerate(group["params"]):
                _check_param(p, group, f"parameter {i} of group {n_before}")
                j = first.setdefault(id(p), i)
                if j != i:  # torch only warns; stepping it twice in one call is not well defined
                    raise ValueError(f"parameter {i} of group {n_before} is parameter {j} again; list each once")
        except BaseException:
            self.param_groups.pop()
            raise

    def _format(self, group: dict, numel: int) -> Format:
        dtype = group["state_dtype"]
        if dtype in formats.QUANTIZED:
            if numel < group["min_quantized_numel"]:
                return Format("fp32")
            return Format(dtype, group["block_size"] or formats.DEFAULT_BLOCK[dtype])
        return Format(dtype)

    def _wants_master(self, group: dict, p: torch.Tensor) -> bool:
        return group["master_weights"] and p.dtype != torch.float32

    def _param_index(self, p: torch.Tensor) -> int:
        """The position of ``p`` among all groups' parameters (its stochastic-rounding seed's
        input). The positions are kept while the groups keep their lists and lengths: looked up
        for every new state, a walk over all groups each time made a first step quadratic."""
        shape = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        cache = self._index_cache
        if cache is None or cache[0] != shape or id(p) not in cache[1]:
            index: dict = {}
            for i, q in enumerate(chain.from_iterable(g["params"] for g in self.param_groups)):
                index.setdefault(id(q), (i, q))
            cache = self._index_cache = (shape, index)
        found = cache[1].get(id(p))
        if found is None or found[1] is not p:
            raise ValueError("the parameter is not in this optimizer's param_groups")
        return found[0]

    def _home(self, local: torch.Tensor) -> torch.device:
        """Where a parameter's state lives: host memory when offloaded, else beside it."""
        return torch.device("cpu") if self._offload is not None else local.device

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        """A new parameter's state (not yet stored in self.state)."""
        local = _local(p)
        home = self._home(local)
        fmt = self._format(group, local.numel())
        state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        state.update(formats.new_moments(fmt, local, home))
        state["state_dtype"] = fmt.dtype
        if fmt.quantized:
            state["block_size"] = fmt.block
        if self._wants_master(group, p):
            state["master"] = local.detach().to(device=home, dtype=torch.float32, copy=True)
        state["seed"] = _mix64(self._seed ^ _mix64(self._param_index(p)))
        return _wrap_state(p, state, fmt)

    # ---- the step -------------------------------------------------------------------------

    def _hyper(self, group: dict) -> Hyper:
        """The group's hyper-parameters as the kernels take them, checked: a scheduler or a hand
        edit can change a group after add_param_group checked it, and the step must refuse a
        bad value before it changes anything (ValueError naming the setting and the group)."""
        sr = group["stochastic_rounding"]
        hp = Hyper(
            lr=float(group["lr"]),
            beta1=float(group["betas"][0]),
            beta2=float(group["betas"][1]),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group["decoupled_weight_decay"]),
            maximize=bool(group["maximize"]),
            stochastic_rounding=True if sr is None else bool(sr),
        )
        for name, value, ok in (
            ("lr", hp.lr, "a finite number >= 0"),
            ("eps", hp.eps, "a finite number >= 0"),
            ("weight_decay", hp.weight_decay, "a finite number >= 0"),
            ("betas[0]", hp.beta1, "in [0, 1)"),
            ("betas[1]", hp.beta2, "in [0, 1)"),
        ):
            good = 0.0 <= value < 1.0 if name.startswith("betas") else value >= 0.0 and math.isfinite(value)
            if not good:
                gi = next((i for i, g in enumerate(self.param_groups) if g is group), "?")
                raise ValueError(f"llmmem.optim: {name} of group {gi} must be {ok}, got {value}")
        return hp

    def _prepare(self, p: torch.Tensor, group: dict, where: str, new_states: dict) -> Optional[Item]:
        """Checks ``p``'s gradient and returns its work item (its state made if it has none,
        kept in new_states until every parameter is ready); None without a gradient."""
        grad = p.grad
        if grad is None:
            return None
        if grad.is_sparse or grad.layout != torch.strided:
            raise TypeError(f"llmmem.optim: {where} has a sparse gradient ({grad.layout}); use torch.optim.SparseAdam")
        if grad.is_complex():
            raise TypeError(f"llmmem.optim: {where} has a complex gradient ({grad.dtype})")
        if grad.dtype not in _FLOAT_PARAMS:
            raise TypeError(
                f"llmmem.optim: {where} has a {grad.dtype} gradient; expected float32, bfloat16 or float16"
            )
        if grad.shape != p.shape:
            raise ValueError(
                f"llmmem.optim: {where} has a gradient of shape {tuple(grad.shape)}, not {tuple(p.shape)}"
            )
        if grad.device != p.device:
            raise ValueError(f"llmmem.optim: {where} is on {p.device} and its gradient on {grad.device}")
        if self._offload is not None and _is_dtensor(p):
            raise NotImplementedError(
                f"llmmem.optim: offload='cpu' does not support DTensor parameters ({where}); FSDP2 offloads with "
                "its own CPUOffloadPolicy"
            )
        lp = _local(p)
        lg = _local_grad(p, grad)
        state = self.state.get(p)
        if not state:
            state = new_states[p] = self._init_state(p, group)
        elif formats.SAVED_CODE_KEYS["exp_avg"] in state:
            # a saved state put in as it was saved (ZeroRedundancyOptimizer.load_state_dict does so):
            # the same tensors, under the keys the kernels read
            try:
                state = self.state[p] = formats.from_saved_layout(state)
            except ValueError as e:
                raise ValueError(f"llmmem.optim: the state of {where} cannot be stepped: {e}") from None
        fmt = self._state_format(state, lp.numel(), where)
        kernel_state = _local_tensors(state) if _is_dtensor(p) else state
        try:
            formats.check_live(kernel_state, fmt, lp.numel(), self._home(lp))
        except ValueError as e:
            raise ValueError(f"llmmem.optim: the state of {where} cannot be stepped: {e}") from None
        master = kernel_state.get("master")
        if master is not None and self._offload is None:
            self._refresh_master(p, lp, master)
        return Item(param=lp, grad=lg, master=master, state=kernel_state, seed=state["seed"]), fmt

    def _refresh_master(self, p: torch.Tensor, local: torch.Tensor, master: torch.Tensor) -> None:
        """A weight changed outside the step (a model load_state_dict, an in-place edit; seen by
        its version counter, which the kernel's own writes do not move) is taken into its
        master, whose extra precision is kept wherever it still rounds to the weight."""
        version = p._version
        if self._versions.get(p, version) != version:
            same = master.to(local.dtype) == local
            master.copy_(torch.where(same, master, local.to(torch.float32)))
        self._versions[p] = version

    def _state_format(self, state: dict, numel: int, where: str) -> Format:
        try:
            return formats.infer_format(state, numel)
        except ValueError as e:
            raise ValueError(f"llmmem.optim: the state of {where} cannot be read: {e}") from None

    @torch.compiler.disable(reason="llmmem.optim's step is one call of a native fused kernel per group")
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One step of every parameter with a gradient (see the module for what it costs).

        :param closure: re-evaluates the model and returns the loss (run with grad enabled).

        Under ``torch.compile`` the step runs eagerly (a graph break here, by design): it already
        is one fused kernel per parameter group, there is nothing for the compiler to fuse, and
        its bookkeeping is host-side Python. ``fullgraph=True`` therefore refuses a compiled
        function that calls it; compile the model and call the step outside it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, walked = [], []
        for group in self.param_groups:
            gc = self._group_caches.get(id(group))
            if gc is not None and gc.state_dict is self.state and gc.generation == self.state.generation:
                w = native.optim_adamw_walk(group["params"], *gc.lists, _kinds())
                if w is not None:
                    walked.append((group, w))
                    continue
            work.append((group, group["params"]))
        self._step_params(work, walked)
        for group, _ in work:
            self._group_caches[id(group)] = _GroupCache.of(group, self._cached, self.state)
        return loss

    def _step_params(self, work: list, walked: tuple = ()) -> None:
        """Steps the parameters of ``work`` [(group, params)], all-or-nothing: first every check
        and every new state (which can run out of memory), then the kernels.

        The hot path: a parameter stepped natively before keeps its record's gradient-free part
        (:class:`_Cached`), reused while its storage, state and (with a master) version are the
        ones it was made from, so a step costs a few attribute reads a parameter in Python."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "llmmem.optim: a step cannot be captured in a CUDA graph: its step counters and bias corrections "
                "are host values computed at each call, so every replay would repeat the captured step's "
                "(torch's AdamW with capturable=False refuses it too). Capture the model only"
            )
        new_states: dict = {}
        batches: dict = {}  # (group, format, device) -> [group, format, device, Batch or Items, params]
        routes: dict = {}  # device -> None (native) or why not
        cached = self._cached
        for gi, (group, params) in enumerate(work):
            for pi, p in enumerate(params):
                grad = p.grad
                if grad is None:
                    continue
                c = cached.get(id(p))
                if (
                    c is not None
                    and c.param is p
                    and type(grad) is torch.Tensor
                    and grad.layout is torch.strided
                    and grad.dtype is c.grad_dtype
                    and grad.is_contiguous()
                    and p.is_contiguous()
                    and grad.numel() == c.head[7]
                    and p.data_ptr() == c.head[0]
                    and self.state.get(p) is c.state
                    and c.state_unchanged()
                    and (c.version is None or p._version == c.version)
                ):
                    batch = batches.get(c.key)
                    if batch is None:
                        batch = batches[c.key] = [group, c.fmt, c.device, kernels.Batch(), []]
                    batch[3].records.append(record(c.head, grad))
                    batch[3].keep.append(grad)
                    continue
                prepared = self._prepare(p, group, f"parameter {pi} of group {gi}", new_states)
                if prepared is None:
                    continue
                item, fmt = prepared
                device = item.param.device
                if device not in routes:
                    routes[device] = kernels.native_route(device) if self._offload is None else "offload"
                key = (id(group), fmt.dtype, fmt.block, device)  # plain values: hashed in C
                batch = batches.get(key)
                if batch is None:
                    is_native = routes[device] is None
                    batch = batches[key] = [group, fmt, device, kernels.Batch() if is_native else [], []]
                if isinstance(batch[3], kernels.Batch):
                    batch[3].add(item)
                    if item.param is p and p.is_contiguous():
                        cached[id(p)] = _Cached(key, fmt, device, item, p)
                else:
                    batch[3].append(item)
                    batch[4].append(p)
        # every group's hyper-parameters are checked before anything changes
        hypers = {id(group): self._hyper(group) for group, _ in walked}
        for group, *_ in batches.values():
            if id(group) not in hypers:
                hypers[id(group)] = self._hyper(group)
        for p, state in new_states.items():
            self.state[p] = state
        for group, w in walked:  # CPU groups the C walk read and checked (see step)
            hp = hypers[id(group)]
            native.optim_adamw_run(
                w,
                hp.lr,
                hp.beta1,
                hp.beta2,
                hp.eps,
                hp.weight_decay,
                hp.decoupled,
                hp.maximize,
                hp.stochastic_rounding,
                torch.get_num_threads(),
            )
        for group, fmt, device, work_items, params in batches.values():
            hp = hypers[id(group)]
            if isinstance(work_items, kernels.Batch):
                kernels.run(work_items, fmt, hp, device)
            elif self._offload is not None:
                self._offload.step(params, work_items, fmt, hp)
            else:
                kernels.step(work_items, fmt, hp, device)

    # ---- state dicts ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's ``Optimizer.state_dict()``, with each quantized (int8/int4) state's codes under
        ``exp_avg_codes``/``exp_avg_sq_codes`` instead of torch's moment keys, so that
        ``torch.optim.AdamW.load_state_dict`` cannot take them for moments (its first step then
        fails on the missing ``exp_avg``); give torch's optimizer :meth:`full_precision_state_dict`.
        fp32 and bf16 moments keep torch's keys and load into torch's AdamW. The tensors are the
        optimizer's own, not copies (as torch's)."""
        sd = super().state_dict()
        sd["state"] = {k: formats.to_saved_layout(st) if isinstance(st, dict) else st for k, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of this class (either key layout of its quantized codes: see
        :meth:`state_dict`) or of ``torch.optim.Adam``/``AdamW``.

        Hyper-parameters (lr, betas, eps, weight_decay, ...) come from the saved groups, as with
        torch; the state format settings (``state_dtype``, ``block_size``, ``min_quantized_numel``,
        ``master_weights``, ``stochastic_rounding``) stay this optimizer's own, and each saved
        moment is converted into them (an fp32 state quantized on load, an int8 one widened...),
        so a saved run can switch formats. Everything is checked and converted before anything
        changes: a state dict with other groups, other sizes, or a damaged quantized state
        raises ValueError and leaves the optimizer as it was.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(
                "llmmem.optim: a state dict needs 'state' and 'param_groups' (from Optimizer.state_dict())"
            )
        saved_groups = state_dict["param_groups"]
        groups = self.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(
                f"llmmem.optim: the state dict has {len(saved_groups)} parameter groups, this optimizer {len(groups)}"
            )
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"llmmem.optim: group {i} of the state dict has {len(sg['params'])} parameters, "
                    f"this optimizer's {len(g['params'])}"
                )
        id_map, group_of = {}, {}
        for g, sg in zip(groups, saved_groups):
            for saved_id, p in zip(sg["params"], g["params"]):
                id_map[saved_id] = p
                group_of[saved_id] = g
        new_state: dict = {}
        for k, saved in state_dict["state"].items():
            if k not in id_map:
                raise ValueError(
                    f"llmmem.optim: the state dict holds state for parameter id {k!r}, which no group lists"
                )
            new_state[id_map[k]] = self._converted_state(id_map[k], group_of[k], saved, f"parameter id {k}")
        new_groups = []
        for g, sg in zip(groups, saved_groups):
            ng = {k: deepcopy(v) for k, v in sg.items() if k != "params"}
            for key in _LLMMEM_KEYS:  # the format settings stay this optimizer's own
                ng[key] = g[key]
            if self._always_decoupled:  # as torch's AdamW forces it on every load
                ng["decoupled_weight_decay"] = True
            for key, value in self.defaults.items():
                ng.setdefault(key, value)
            ng["params"] = g["params"]
            _check_group_settings(ng)
            new_groups.append(ng)
        self.state = _StateDict(dict, new_state)
        self.param_groups = new_groups
        self._versions.clear()
        self._cached.clear()
        self._group_caches.clear()
        if self._offload is not None:
            self._offload.forget()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _converted_state(self, p: torch.Tensor, group: dict, saved: dict, where: str) -> dict:
        """A parameter's saved state, checked, in this optimizer's format for it, on its device."""
        if not isinstance(saved, dict):
            raise ValueError(f"llmmem.optim: the state of {where} is {type(saved).__name__}, not a dict")
        local = _local(p)
        home = self._home(local)
        n = local.numel()
        saved = _local_tensors(saved)
        try:
            saved = formats.from_saved_layout(saved)
            src = formats.infer_format(saved, n, group["block_size"])
            formats.check_saved(saved, src, n)
        except (ValueError, TypeError) as e:
            raise ValueError(f"llmmem.optim: the state of {where} is not usable: {e}") from None
        dst = self._format(group, n)
        step = saved.get("step", 0.0)
        step = float(step) if isinstance(step, (int, float, torch.Tensor)) else float("nan")
        if not math.isfinite(step) or step < 0:
            raise ValueError(f"llmmem.optim: the state of {where} has step {step}; expected a count >= 0")
        out: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.float32)}
        if dst == src:
            keys = ("exp_avg", "exp_avg_sq") + (("exp_avg_scale", "exp_avg_sq_scale") if src.quantized else ())
            fresh = formats.new_moments(dst, local, home)
            for key in keys:
                fresh[key].copy_(saved[key].reshape(fresh[key].shape))
            out.update(fresh)
        else:
            m, v = formats.moments_as_float(src, saved, n)
            out.update(formats.moments_from_float(dst, m, v, local, home))
        out["state_dtype"] = dst.dtype
        if dst.quantized:
            out["block_size"] = dst.block
        if self._wants_master(group, p):
            master = saved.get("master")
            if isinstance(master, torch.Tensor):
                out["master"] = master.detach().to(device=home, dtype=torch.float32).reshape(local.shape).clone()
            else:
                out["master"] = local.detach().to(device=home, dtype=torch.float32, copy=True)
        seed = saved.get("seed")
        out["seed"] = (
            seed
            if isinstance(seed, int) and not isinstance(seed, bool)
            else _mix64(self._seed ^ _mix64(self._param_index(p)))
        )
        return _wrap_state(p, out, dst)

    def full_precision_state_dict(self) -> dict:
        """``state_dict()`` with every moment as float32 in torch's layout and no llmmem-only
        keys: what ``torch.optim.AdamW.load_state_dict`` reads correctly, whatever the format.
        (A quantized :meth:`state_dict` keeps its codes under keys of its own, which torch's
        optimizer does not read: its first step fails.) Memory: two float32 moments of every
        parameter at once, on the parameter's device."""
        sd = self.state_dict()
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        state = {}
        for k in sd["state"]:
            p = params[k]
            live, local = formats.from_saved_layout(_local_tensors(self.state[p])), _local(p)
            m, v = formats.moments_as_float(formats.infer_format(live, local.numel()), live, local.numel())
            state[k] = {
                "step": live["step"].clone(),
                "exp_avg": m.reshape(local.shape).to(local.device),
                "exp_avg_sq": v.reshape(local.shape).to(local.device),
            }
        sd["state"] = state
        for g in sd["param_groups"]:
            for key in _LLMMEM_KEYS:
                g.pop(key, None)
        return sd


def _local_tensors(state: dict) -> dict:
    return {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class AdamW(Adam):
    """AdamW: :class:`Adam` with ``decoupled_weight_decay=True`` and torch's AdamW defaults
    (``weight_decay=1e-2``). See :class:`Adam` for the arguments. A loaded state dict keeps
    the decay decoupled, whatever its groups say (as ``torch.optim.AdamW`` does)."""

    _always_decoupled = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs,
    ) -> None:
        if "decoupled_weight_decay" in kwargs and not kwargs["decoupled_weight_decay"]:
            raise ValueError("AdamW always decouples its weight decay; use llmmem.optim.Adam for L2")
        kwargs["decoupled_weight_decay"] = True
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
