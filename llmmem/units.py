"""Byte quantities as users write them: ``"4GB"``, ``"512MiB"``, ``"1.5 TB"``, ``8 * 2**30``.

Decimal units (kB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers of
1024, as in the SI/IEC standards; nvidia-smi and PyTorch print binary units, so
:func:`format_bytes` does too.
"""

from __future__ import annotations

import decimal
import math
import numbers
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

MAX_BYTES = 2**63  # far beyond any machine, and within the C core's 64-bit sizes
_MAX_BYTES = MAX_BYTES

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, name: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts a non-negative integer, a float with an integral value, or a string such as
    ``"4GB"``, ``"512MiB"``, ``"1.5 TiB"``, ``"1000000"``. Raises :class:`ValueError` naming
    ``name`` otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a byte count or a string like '4GB', got {value!r}")
    if isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{name}: a byte count must be a whole number, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        if re.match(r"^\s*-\s*[0-9.]", value):
            raise ValueError(f"{name}: must be >= 0 bytes, got {value!r}")
        m = _PATTERN.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{name}: cannot parse {value!r} as a size; use an integer number of bytes or a number "
                "with a unit: B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
            )
        # Decimal, not float: "1e30GB" must not turn into float-rounded digits, nor "1e400" into inf.
        # The default context bounds exponents (|e| < 10**6 after the multiplication, < 10**18 in the
        # text): "1e1000000" overflows it, "1e-999999999999999999" is an invalid operation.
        try:
            exact = decimal.Decimal(m.group(1)) * _UNITS[unit]
        except decimal.DecimalException:
            if re.search(r"[eE]-", m.group(1)):
                raise ValueError(
                    f"{name}: the exponent of {value!r} is out of range; expected a byte count such as '4GB'"
                ) from None
            exact = None
        if exact is None or not exact.is_finite() or exact > _MAX_BYTES:
            raise ValueError(f"{name}: {value!r} is larger than any memory ({_MAX_BYTES} bytes at most)")
        if unit in ("", "b") and exact != exact.to_integral_value():
            raise ValueError(f"{name}: a byte count must be a whole number, got {value!r}")
        n = int(exact.to_integral_value(rounding=decimal.ROUND_HALF_EVEN))  # "0.3GiB": to the nearest byte
    else:
        raise ValueError(f"{name}: expected a byte count or a string like '4GB', got {type(value).__name__}")
    if n < 0:
        raise ValueError(f"{name}: must be >= 0 bytes, got {value!r}")
    if n > _MAX_BYTES:  # the C core holds sizes in 64 bits: larger values would wrap around silently
        raise ValueError(f"{name}: {value!r} is larger than any memory ({_MAX_BYTES} bytes at most)")
    return n


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units up to EiB (2**60), two decimals."""
    if n < 0:
        return "-" + format_bytes(-n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
