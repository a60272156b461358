"""The AdamW step of every state format in plain PyTorch ops, equal to the C core bit for bit.

Two uses: the step on devices llmmem's kernels do not cover (CUDA in a CPU-only build, MPS, XPU,
...), and an oracle independent of the C code that the tests compare the kernels with. Every
operation is the one ``csrc/optim/adamw_math.h`` and ``csrc/optim/codes.h`` perform, rounded to
float32 the same way (torch's elementwise kernels round each operation on its own); the codes and
the random bits of stochastic rounding are computed on the integer bits, as the C code does.

It is slow (a dozen passes over memory per tensor, where the kernels make one): a fallback, not a
fast path.
"""

from __future__ import annotations

import math

import torch

from llmmem.optim.formats import CODE_M4, CODE_M8, CODE_R4, CODE_R8, Format

# (magnitude bits, mantissa bits, bias, signed) of each code: csrc/optim/codes.h
_CODES = {CODE_M8: (7, 3, 15, True), CODE_R8: (8, 4, 15, False), CODE_M4: (3, 1, 1, True), CODE_R4: (4, 2, 3, False)}
_M32 = 0xFFFFFFFF


def _f32(x: float) -> float:
    """x rounded to the nearest float32 (how a Python scalar reaches a float32 kernel)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bits of x as non-negative int64 (uint32 values)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _M32


def _float(bits: torch.Tensor) -> torch.Tensor:
    b = bits & _M32
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _pow2(k: int) -> float:
    return math.ldexp(1.0, k)


def _encode_mag(y: torch.Tensor, m_bits: int, bias: int, max_mag: int) -> torch.Tensor:
    sub = _bits(y * _pow2(bias - 1 + m_bits) + 12582912.0) - 0x4B400000
    t = _bits(y) - ((127 - bias) << 23)
    norm = (t + ((1 << (22 - m_bits)) - 1) + ((t >> (23 - m_bits)) & 1)) >> (23 - m_bits)
    c = torch.where(y < _pow2(1 - bias), sub, norm)
    return c.clamp(max=max_mag)


def _encode_mag_sr(y: torch.Tensor, m_bits: int, bias: int, max_mag: int, rnd: torch.Tensor) -> torch.Tensor:
    frac = (rnd >> 8).to(torch.float32) * _pow2(-24)
    sub = (y * _pow2(bias - 1 + m_bits) + frac).to(torch.int64)  # truncation: the values are >= 0
    t = _bits(y) - ((127 - bias) << 23)
    norm = (t + (rnd >> (9 + m_bits))) >> (23 - m_bits)
    c = torch.where(y < _pow2(1 - bias), sub, norm)
    return c.clamp(max=max_mag)


def _decode_mag(c: torch.Tensor, m_bits: int, bias: int) -> torch.Tensor:
    e, f = c >> m_bits, c & ((1 << m_bits) - 1)
    sub = f.to(torch.float32) * _pow2(1 - bias - m_bits)
    norm = _float(((e + 127 - bias) << 23) | (f << (23 - m_bits)))
    return torch.where(e == 0, sub, norm)


def max_value(code: int) -> float:
    mag, m_bits, bias, signed = _CODES[code]
    top = (1 << mag) - 1 if signed else (1 << mag) - 2
    return float(_decode_mag(torch.tensor([top]), m_bits, bias)[0])


def encode(x: torch.Tensor, inv: torch.Tensor, code: int, rnd=None) -> torch.Tensor:
    """int64 codes of float32 x with the per-element multiplier inv (a block's); R codes with
    ``rnd`` (random bits, int64) rounded stochastically, else to nearest."""
    mag, m_bits, bias, signed = _CODES[code]
    u = _bits(x)
    bad = (u & 0x7F800000) == 0x7F800000
    if signed:
        nan_code = 1 << mag
        y = _float(u & 0x7FFFFFFF) * inv
        m = _encode_mag(torch.where(bad, torch.zeros_like(y), y), m_bits, bias, nan_code - 1)
        code_v = torch.where(m == 0, torch.zeros_like(m), ((u >> 31) << mag) | m)
    else:
        nan_code = (1 << mag) - 1
        y = torch.where(bad, torch.zeros_like(x), x * inv)
        if rnd is None:
            m = _encode_mag(y, m_bits, bias, nan_code - 1)
        else:
            m = _encode_mag_sr(y, m_bits, bias, nan_code - 1, rnd)
        positive = (u - 1 >= 0) & (u - 1 < 0x7F7FFFFF)
        code_v = torch.maximum(m, positive.to(torch.int64))
    return torch.where(bad, torch.full_like(code_v, nan_code), code_v)


def decode(c: torch.Tensor, scale: torch.Tensor, code: int) -> torch.Tensor:
    mag, m_bits, bias, signed = _CODES[code]
    c = c.to(torch.int64)
    if signed:
        nan_code = 1 << mag
        v = _decode_mag(c & (nan_code - 1), m_bits, bias) * scale
        out = _float(_bits(v) | (((c >> mag) & 1) << 31))
    else:
        inf_code = (1 << mag) - 1  # a second moment that was not finite reads back as +inf (codes.h)
        out = _decode_mag(c, m_bits, bias) * scale
        return torch.where(c == inf_code, torch.full_like(out, float("inf")), out)
    return torch.where(c == nan_code, torch.full_like(out, float("nan")), out)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.numel()
    pad = -n % block
    return torch.nn.functional.pad(x.reshape(1, -1), (0, pad)).reshape(-1, block)


def quantize_blocks(x: torch.Tensor, code: int, block: int, rnd=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 codes [n], float32 scales [blocks]) of flat float32 x: csrc/optim/quantize.c; with
    ``rnd`` (the random bits of each element) an R code is rounded stochastically."""
    n = x.numel()
    xb = _blocks(x, block)
    a = _bits(xb) & 0x7FFFFFFF
    absmax = _float(torch.where(a < 0x7F800000, a, torch.zeros_like(a)).amax(dim=1))
    ok = absmax >= _pow2(-120)
    top = _divisor(max_value(code), absmax)
    scale = torch.where(ok, absmax / top, torch.zeros_like(absmax))
    inv = torch.where(ok, top / absmax, torch.zeros_like(absmax))
    rb = None if rnd is None else _blocks(rnd, block)
    codes = encode(xb, inv[:, None].expand_as(xb), code, rb).reshape(-1)[:n]
    return codes, scale


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, numel: int, code: int, block: int) -> torch.Tensor:
    idx = torch.arange(numel, device=codes.device) // block
    return decode(codes[:numel], scales[idx], code)


def unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    p = packed.reshape(-1).to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=1).reshape(-1)[:numel]


def pack4(codes: torch.Tensor) -> torch.Tensor:
    c = codes
    if c.numel() % 2:
        c = torch.cat((c, c.new_zeros(1)))
    c = c.reshape(-1, 2)
    return (c[:, 0] | (c[:, 1] << 4)).to(torch.uint8)


# ---- stochastic rounding ------------------------------------------------------------------


def _mul32(x, c: int):
    """low 32 bits of x * c, for x < 2^32 in int64 (tensor or int) without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix(x):
    """csrc/optim/adamw_math.h: llmmem_sr_mix on uint32 values held in int64 (tensor or int)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_key(seed: int, step: float, stream: int, hi: int) -> int:
    step_bits = int(torch.tensor(step, dtype=torch.float32).view(torch.int32)) & _M32
    k = mix((seed & _M32) ^ 0x9E3779B9)
    k = mix(k ^ ((seed >> 32) & _M32))
    k = mix(k ^ step_bits)
    k = mix(k ^ ((stream * 0x85EBCA6B) & _M32))
    return mix(k ^ hi)


def random_bits(seed: int, step: float, stream: int, numel: int, device) -> torch.Tensor:
    """The 32 random bits of every element of one stream of a tensor's step."""
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    out = torch.empty_like(idx)
    n_hi = ((numel - 1) >> 32) + 1 if numel else 0  # index ranges that share their upper 32 bits
    for hi in range(n_hi):
        lo_i, hi_i = hi << 32, min(numel, (hi + 1) << 32)
        out[lo_i:hi_i] = mix((idx[lo_i:hi_i] & _M32) ^ sr_key(seed, step, stream, hi))
    return out


def code_random_bits(seed: int, step: float, numel: int, device) -> torch.Tensor:
    """The random bits that round sqrt(v) of every element into a code (stream 1):
    csrc/optim/adamw_math.h's llmmem_sr_code_bits, one hash for two elements (16 bits each, in
    the top half)."""
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    out = torch.empty_like(idx)
    n_hi = ((numel - 1) >> 32) + 1 if numel else 0
    for hi in range(n_hi):
        lo_i, hi_i = hi << 32, min(numel, (hi + 1) << 32)
        low = idx[lo_i:hi_i] & _M32
        h = mix((((low >> 5) << 4) | (low & 15)) ^ sr_key(seed, step, 1, hi))
        out[lo_i:hi_i] = torch.where((low & 16) != 0, h & 0xFFFF0000, (h << 16) & _M32)
    return out


def bf16_stochastic(x: torch.Tensor, rnd: torch.Tensor) -> torch.Tensor:
    u = _bits(x)
    r = (u + (rnd & 0xFFFF)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = torch.where(nan, torch.full_like(r, 0x7FC0), r)
    return _bf16_from_bits(r)


def bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    u = _bits(x)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return _bf16_from_bits(torch.where(nan, torch.full_like(r, 0x7FC0), r))


def _bf16_from_bits(r: torch.Tensor) -> torch.Tensor:
    r = r & 0xFFFF
    return torch.where(r >= 2**15, r - 2**16, r).to(torch.int16).view(torch.bfloat16)


# ---- the step -----------------------------------------------------------------------------


def _scalars(cfg: dict, t: float) -> dict:
    lr, wd, b1, b2 = cfg["lr"], cfg["weight_decay"], cfg["beta1"], cfg["beta2"]
    bc1 = 1.0 - b1**t
    bc2 = 1.0 - b2**t
    w1 = _f32(1.0 - b1)
    return {
        "decay": _f32(1.0 - lr * wd) if cfg["decoupled"] and wd != 0 else 1.0,
        "l2": 0.0 if cfg["decoupled"] else _f32(wd),
        "w1": w1,
        "one_m_w1": _f32(1.0 - w1),
        "lerp_high": abs(w1) >= 0.5,
        "beta2": _f32(b2),
        "c2": _f32(1.0 - b2),
        "bc2_sqrt": _f32(bc2**0.5),
        "eps": _f32(cfg["eps"]),
        "neg_step": _f32(-(lr / bc1)),
    }


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """IEEE sqrt of float32 values, rounded once as C's sqrtf rounds it. torch's own float32 sqrt
    is not correctly rounded on the CPU (its vector code is within 0.5001 ulp: about 17% of
    results differ in the last bit); taken in float64 and rounded to float32 it is exact (the
    float64 error is far below the distance of a float32 square root from a rounding boundary).
    Devices without float64 (MPS) use torch's float32 sqrt."""
    if v.device.type == "mps":
        return v.sqrt()
    return v.double().sqrt().float()


def _divisor(x: float, like: torch.Tensor) -> torch.Tensor:
    """The float32 ``x`` as a 0-dim tensor on ``like``'s device, to divide by. Not a Python
    number nor a CPU tensor: torch's CUDA (and XPU) division by a CPU scalar multiplies by its
    reciprocal instead, which can differ from the C code's division in the last bit."""
    return torch.full((), x, dtype=torch.float32, device=like.device)


def _update(s: dict, g, p, m, v, maximize: bool):
    """csrc/optim/adamw_math.h: llmmem_adamw_elem, elementwise over float32 tensors."""
    g = -g if maximize else g
    p = p * s["decay"]
    if s["l2"] != 0.0:
        g = g + p * s["l2"]
    d1 = g - m
    m = g - d1 * s["one_m_w1"] if s["lerp_high"] else m + d1 * s["w1"]
    v = v * s["beta2"] + (g * s["c2"]) * g
    r = _sqrt(v)
    den = r / _divisor(s["bc2_sqrt"], r) + s["eps"]
    p = p + (m * s["neg_step"]) / den
    return p, m, v, r


def adamw_step(tensor: dict, fmt: Format, cfg: dict) -> None:
    """One step of one parameter in place. ``tensor`` holds ``param``, ``grad``, ``master`` (or
    None), the state tensors of ``fmt`` (``exp_avg``, ``exp_avg_sq``, and for the quantized
    formats ``exp_avg_scale``, ``exp_avg_sq_scale``), ``step`` (a float32 tensor) and ``seed``;
    ``cfg`` the group's lr, beta1, beta2, eps, weight_decay, decoupled, maximize and
    stochastic_rounding."""
    param, master = tensor["param"], tensor["master"]
    n = param.numel()
    step = _f32(float(tensor["step"]) + 1.0)
    tensor["step"].fill_(step)
    s = _scalars(cfg, step)
    w = (master if master is not None else param).reshape(-1).to(torch.float32)
    g = tensor["grad"].reshape(-1).to(torch.float32)
    mt, vt = tensor["exp_avg"], tensor["exp_avg_sq"]
    if fmt.quantized:
        cm, cr = fmt.codes()
        mc = mt.reshape(-1).view(torch.uint8) if mt.dtype == torch.int8 else mt.reshape(-1)
        vc = vt.reshape(-1)
        if fmt.dtype == "int4":
            mc, vc = unpack4(mc, n), unpack4(vc, n)
        m = dequantize_blocks(mc.to(torch.int64), tensor["exp_avg_scale"], n, cm, fmt.block)
        r = dequantize_blocks(vc.to(torch.int64), tensor["exp_avg_sq_scale"], n, cr, fmt.block)
        v = r * r
    else:
        m, v = mt.reshape(-1).to(torch.float32), vt.reshape(-1).to(torch.float32)
    w, m, v, r = _update(s, g, w, m, v, cfg["maximize"])

    seed = tensor["seed"]
    if master is not None:
        master.copy_(w.reshape(master.shape))
        if param.dtype == torch.bfloat16:
            param.copy_(bf16_nearest(w).reshape(param.shape))
        else:
            param.copy_(w.to(torch.float16).reshape(param.shape))  # torch rounds to nearest even, as half.h
    elif param.dtype == torch.float32:
        param.copy_(w.reshape(param.shape))
    elif cfg["stochastic_rounding"]:
        param.copy_(bf16_stochastic(w, random_bits(seed, step, 0, n, w.device)).reshape(param.shape))
    else:
        param.copy_(bf16_nearest(w).reshape(param.shape))

    if fmt.dtype == "fp32":
        mt.copy_(m.reshape(mt.shape))
        vt.copy_(v.reshape(vt.shape))
    elif fmt.dtype == "bf16":
        rnd = random_bits(seed, step, 1, n, w.device)
        mt.copy_(bf16_stochastic(m, rnd).reshape(mt.shape))
        vt.copy_(bf16_stochastic(v, rnd >> 16).reshape(vt.shape))
    else:
        cm, cr = fmt.codes()
        mcodes, ms = quantize_blocks(m, cm, fmt.block)
        # sqrt(v) rounded stochastically, with the moments' stream (csrc/optim/codes.h says why)
        rcodes, rs = quantize_blocks(r, cr, fmt.block, code_random_bits(seed, step, n, w.device))
        tensor["exp_avg_scale"].copy_(ms)
        tensor["exp_avg_sq_scale"].copy_(rs)
        if fmt.dtype == "int4":
            mt.copy_(pack4(mcodes))
            vt.copy_(pack4(rcodes))
        else:
            mt.copy_(torch.where(mcodes >= 128, mcodes - 256, mcodes).to(torch.int8).reshape(mt.shape))
            vt.copy_(rcodes.to(torch.uint8).reshape(vt.shape))
