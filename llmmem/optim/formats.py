"""The state formats of :class:`llmmem.optim.AdamW`: what each keeps per parameter, how much
memory that is, and conversion of a moment between formats (what ``load_state_dict`` does when a
saved run changes ``state_dtype``, or loads torch's own AdamW state).

A parameter of ``n`` elements keeps, besides its ``step``:

==========  ====================================================  =========================
format      ``exp_avg`` / ``exp_avg_sq``                          bytes per parameter
==========  ====================================================  =========================
``fp32``    float32, the shape of the parameter (torch's layout)  8
``bf16``    bfloat16, the shape of the parameter                  4
``int8``    int8 codes of m / uint8 codes of sqrt(v), the shape    2 + 8 / block_size
            of the parameter, and ``exp_avg_scale`` /
            ``exp_avg_sq_scale``: one float32 per block
``int4``    uint8, two 4-bit codes a byte: ``ceil(n / 2)`` each,   1 + 8 / block_size
            and the two scales
==========  ====================================================  =========================

The codes are described in ``csrc/optim/codes.h``. The second moment of the quantized formats
is stored as sqrt(v): its range is the square root of v's, so small elements of a block keep
their precision, and sqrt(v) is what the update divides by.

In a saved state (``state_dict()``) the codes of the quantized formats are under keys of their own,
``exp_avg_codes`` / ``exp_avg_sq_codes`` (:func:`to_saved_layout`), never under torch's moment keys:
``torch.optim.AdamW.load_state_dict`` casts whatever it finds under ``exp_avg``/``exp_avg_sq`` to
float and would train on the codes read as numbers. Without those keys its first step fails
(``KeyError: 'exp_avg'``) instead. fp32 and bf16 moments keep torch's keys: they are numbers and
load into torch's AdamW as they are. The earlier layout (codes under ``exp_avg``, recognised by the
``state_dtype`` record beside them) still loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from llmmem._native import native

STATE_DTYPES = ("fp32", "bf16", "int8", "int4")
# the C core's codes (csrc/include/llmmem/optim.h)
STATE_CODES = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
CODE_M8, CODE_R8, CODE_M4, CODE_R4 = 0, 1, 2, 3
QUANTIZED = ("int8", "int4")
# the block sizes bitsandbytes (2048 in its paper, 256 in practice) and torchao (256 / 128) use
DEFAULT_BLOCK = {"int8": 256, "int4": 128}
MIN_BLOCK, MAX_BLOCK = 32, 4096


def check_state_dtype(value, where: str = "state_dtype") -> str:
    if not isinstance(value, str) or value not in STATE_DTYPES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, STATE_DTYPES))}, got {value!r}")
    return value


def check_block_size(value, where: str = "block_size") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where} must be an int (a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]), got {value!r}")
    if value < MIN_BLOCK or value > MAX_BLOCK or value & (value - 1):
        raise ValueError(f"{where} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {value}")
    return value


@dataclass(frozen=True)
class Format:
    """The format one parameter's state is kept in: ``dtype`` one of :data:`STATE_DTYPES`,
    ``block`` the elements per scale (quantized formats; 0 otherwise)."""

    dtype: str
    block: int = 0

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED

    @property
    def code(self) -> int:
        return STATE_CODES[self.dtype]

    def codes(self) -> tuple[int, int]:
        """The C codes of m and of sqrt(v) (quantized formats only)."""
        return (CODE_M8, CODE_R8) if self.dtype == "int8" else (CODE_M4, CODE_R4)

    def moment_bytes(self, numel: int) -> int:
        """Bytes of one moment of a ``numel``-element parameter, its scales included."""
        return state_layout(self, numel)[0] + 4 * state_layout(self, numel)[1]

    def describe(self) -> str:
        return f"{self.dtype}/{self.block}" if self.quantized else self.dtype


def state_layout(fmt: Format, numel: int) -> tuple[int, int]:
    """(bytes of one moment's values, scales per moment) for ``numel`` elements in ``fmt``."""
    if fmt.dtype == "fp32":
        return 4 * numel, 0
    if fmt.dtype == "bf16":
        return 2 * numel, 0
    scales = -(-numel // fmt.block)
    return (numel if fmt.dtype == "int8" else (numel + 1) // 2), scales


def new_moments(fmt: Format, param: torch.Tensor, device=None) -> dict:
    """Zeroed state tensors of ``fmt`` for the (local, plain) tensor ``param``, on ``device``
    (default: the parameter's): zeros are the initial state of every format (a zero code with a
    zero scale reads 0)."""
    like = dict(device=param.device if device is None else device)
    if fmt.dtype in ("fp32", "bf16"):
        dt = torch.float32 if fmt.dtype == "fp32" else torch.bfloat16
        return {
            "exp_avg": torch.zeros(param.shape, dtype=dt, **like),
            "exp_avg_sq": torch.zeros(param.shape, dtype=dt, **like),
        }
    n = param.numel()
    scales = -(-n // fmt.block)
    if fmt.dtype == "int8":
        m = torch.zeros(param.shape, dtype=torch.int8, **like)
        v = torch.zeros(param.shape, dtype=torch.uint8, **like)
    else:
        m = torch.zeros((n + 1) // 2, dtype=torch.uint8, **like)
        v = torch.zeros((n + 1) // 2, dtype=torch.uint8, **like)
    return {
        "exp_avg": m,
        "exp_avg_sq": v,
        "exp_avg_scale": torch.zeros(scales, dtype=torch.float32, **like),
        "exp_avg_sq_scale": torch.zeros(scales, dtype=torch.float32, **like),
    }


# where a saved quantized state keeps its codes (live state keeps the kernels' keys, the left ones)
SAVED_CODE_KEYS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}


def to_saved_layout(state: dict) -> dict:
    """``state`` as ``state_dict()`` saves it: a quantized state (one whose ``state_dtype`` record
    says int8/int4) a new dict with its codes under :data:`SAVED_CODE_KEYS`; any other the same
    dict. The tensors are not copied."""
    if state.get("state_dtype") not in QUANTIZED or not any(k in state for k in SAVED_CODE_KEYS):
        return state
    return {SAVED_CODE_KEYS.get(k, k): v for k, v in state.items()}


def from_saved_layout(state: dict) -> dict:
    """A saved state with the kernels' keys: codes saved under :data:`SAVED_CODE_KEYS` back under
    ``exp_avg``/``exp_avg_sq`` (a new dict); a state without them (the earlier layout, torch's
    state, fp32/bf16) the same dict. Codes without a quantized ``state_dtype`` record are refused:
    nothing says how to read them."""
    if not any(k in state for k in SAVED_CODE_KEYS.values()):
        return state
    if state.get("state_dtype") not in QUANTIZED:
        raise ValueError(
            f"it holds {'/'.join(SAVED_CODE_KEYS.values())} but its state_dtype is {state.get('state_dtype')!r}, "
            f"not one of {', '.join(map(repr, QUANTIZED))}"
        )
    back = {v: k for k, v in SAVED_CODE_KEYS.items()}
    return {back.get(k, k): v for k, v in state.items() if k not in SAVED_CODE_KEYS}


def code_values(code: int) -> torch.Tensor:
    """Every value of a C code at scale 1 (256 or 16 float32; the M codes' NaN code reads NaN, the R codes' all-ones code +inf)."""
    return torch.tensor(native.optim_code_values(code), dtype=torch.float32)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def quantize(x: torch.Tensor, code: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the float values ``x`` (any device; computed on the host, as the step
    stores them): uint8/int8 codes of ``x.numel()`` elements (8-bit) or ``ceil(n / 2)`` bytes
    (4-bit), and one float32 scale per block. For the R codes ``x`` is sqrt(v) >= 0."""
    flat = _host(x).reshape(-1).to(torch.float32)
    n = flat.numel()
    eight = code in (CODE_M8, CODE_R8)
    codes = torch.empty(n if eight else (n + 1) // 2, dtype=torch.uint8)
    scales = torch.empty(-(-n // block), dtype=torch.float32)
    native.optim_quantize(flat.data_ptr(), n, code, block, codes.data_ptr(), scales.data_ptr())
    if code == CODE_M8:
        codes = codes.view(torch.int8)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, code: int, block: int) -> torch.Tensor:
    """The float32 values (flat, on the host) of a quantized moment."""
    c = _host(codes).reshape(-1)
    if c.dtype == torch.int8:
        c = c.view(torch.uint8)
    s = _host(scales).to(torch.float32)
    out = torch.empty(numel, dtype=torch.float32)
    native.optim_dequantize(c.data_ptr(), s.data_ptr(), numel, code, block, out.data_ptr())
    return out


def moments_as_float(fmt: Format, state: dict, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) of a parameter's state in ``fmt`` as flat float32 tensors on the host."""
    if not fmt.quantized:
        return (_host(state["exp_avg"]).reshape(-1).float(), _host(state["exp_avg_sq"]).reshape(-1).float())
    cm, cr = fmt.codes()
    m = dequantize(state["exp_avg"], state["exp_avg_scale"], numel, cm, fmt.block)
    r = dequantize(state["exp_avg_sq"], state["exp_avg_sq_scale"], numel, cr, fmt.block)
    return m, r * r


def moments_from_float(fmt: Format, m: torch.Tensor, v: torch.Tensor, param: torch.Tensor, device=None) -> dict:
    """State tensors of ``fmt`` on ``device`` (default: ``param``'s) holding the float moments."""
    out = new_moments(fmt, param, device)
    if not fmt.quantized:
        out["exp_avg"].copy_(m.reshape(param.shape))
        out["exp_avg_sq"].copy_(v.reshape(param.shape))
        return out
    cm, cr = fmt.codes()
    mc, ms = quantize(m, cm, fmt.block)
    # v of a loaded state may hold tiny negative values written by another tool: sqrt of 0
    rc, rs = quantize(v.clamp(min=0).sqrt(), cr, fmt.block)
    out["exp_avg"].copy_(mc.reshape(out["exp_avg"].shape))
    out["exp_avg_sq"].copy_(rc.reshape(out["exp_avg_sq"].shape))
    out["exp_avg_scale"].copy_(ms)
    out["exp_avg_sq_scale"].copy_(rs)
    return out


def infer_format(state: dict, numel: int, block_hint: Optional[int] = None) -> Format:
    """The format a saved parameter state is in, from its own record (``state_dtype`` and
    ``block_size``, which llmmem writes) or, for torch's AdamW state, its tensors' dtypes.
    Raises ValueError naming what does not fit."""
    if "state_dtype" in state:
        dtype = check_state_dtype(state["state_dtype"], "the saved state_dtype")
        block = (
            check_block_size(state.get("block_size", block_hint), "the saved block_size") if dtype in QUANTIZED else 0
        )
        return Format(dtype, block)
    m = state.get("exp_avg")
    if not isinstance(m, torch.Tensor):
        raise ValueError("it has no exp_avg tensor")
    if m.dtype == torch.bfloat16:
        return Format("bf16")
    if m.is_floating_point():
        return Format("fp32")  # torch's AdamW (fp32 or fp16 moments: read as floats)
    raise ValueError(f"its exp_avg is {m.dtype} without a state_dtype record: not a state llmmem can read")


def check_saved(state: dict, fmt: Format, numel: int) -> None:
    """Raises ValueError when a saved state's (local) tensors do not fit ``fmt`` for ``numel``
    elements: a missing moment, another dtype or size, or damaged scales."""
    _, n_scales = state_layout(fmt, numel)
    for key, want in (("exp_avg", _CODE_DTYPES[fmt.dtype][0]), ("exp_avg_sq", _CODE_DTYPES[fmt.dtype][1])):
        t = state.get(key)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{key} is missing")
        if fmt.dtype == "fp32":
            if not t.is_floating_point():  # torch's AdamW keeps its moments in the parameter's dtype
                raise ValueError(f"{key} is {t.dtype}; expected a floating-point tensor")
        elif t.dtype != want:
            raise ValueError(f"{key} is {t.dtype}; the {fmt.dtype} format keeps {want}")
        elems = (numel + 1) // 2 if fmt.dtype == "int4" else numel
        if t.numel() != elems:
            raise ValueError(f"{key} has {t.numel()} elements; a {fmt.describe()} state of this parameter has {elems}")
        if key == "exp_avg_sq" and t.is_floating_point() and bool((t < 0).any()):
            raise ValueError(f"{key} holds negative values: the state is damaged")
    if fmt.quantized:
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            t = state.get(key)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{key} is missing")
            if t.dtype != torch.float32 or t.numel() != n_scales:
                raise ValueError(
                    f"{key} must be {n_scales} float32 scales (one per {fmt.block} elements), "
                    f"got {t.numel()} of {t.dtype}"
                )
            if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
                raise ValueError(f"{key} holds negative, inf or NaN scales: the quantized state is damaged")
    master = state.get("master")
    if master is not None and (not isinstance(master, torch.Tensor) or master.numel() != numel):
        raise ValueError("master does not have the parameter's size")


def check_live(state: dict, fmt: Format, numel: int, device: torch.device) -> None:
    """Raises ValueError naming the entry when a live state's (local) tensors are not what the
    kernels read for a ``numel``-element parameter in ``fmt`` with its state on ``device``: each
    moment, scale and master of its exact dtype and size, contiguous, on ``device``, and ``step``
    one float32 in host memory. The kernels take their addresses and trust them; a state entry put
    in by hand (``optimizer.state[p][key] = ...``) could otherwise be read or written out of
    bounds."""
    want_m, want_v = _CODE_DTYPES[fmt.dtype]
    elems = (numel + 1) // 2 if fmt.dtype == "int4" else numel
    wanted = [("exp_avg", want_m, elems), ("exp_avg_sq", want_v, elems)]
    if fmt.quantized:
        scales = state_layout(fmt, numel)[1]
        wanted += [("exp_avg_scale", torch.float32, scales), ("exp_avg_sq_scale", torch.float32, scales)]
    if state.get("master") is not None:
        wanted.append(("master", torch.float32, numel))
    for key, dtype, n in wanted:
        t = state.get(key)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{key} is {type(t).__name__}; a {fmt.describe()} state keeps a tensor there")
        if t.dtype != dtype:
            raise ValueError(f"{key} is {t.dtype}; a {fmt.describe()} state keeps {dtype}")
        if t.numel() != n:
            raise ValueError(f"{key} has {t.numel()} elements; a {fmt.describe()} state of this parameter has {n}")
        if t.device != device:
            raise ValueError(f"{key} is on {t.device}; this parameter's state lives on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{key} is not contiguous; the kernels read state tensors as flat arrays")
    step = state.get("step")
    if (
        not isinstance(step, torch.Tensor)
        or step.dtype != torch.float32
        or step.numel() != 1
        or step.device.type != "cpu"
    ):
        what = (
            f"a {step.dtype} tensor of {step.numel()} elements on {step.device}"
            if isinstance(step, torch.Tensor)
            else type(step).__name__
        )
        raise ValueError(f"step is {what}; expected one float32 in host memory (as the optimizer makes it)")


# the dtypes of (exp_avg, exp_avg_sq) of each format
_CODE_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "int8": (torch.int8, torch.uint8),
    "int4": (torch.uint8, torch.uint8),
}
