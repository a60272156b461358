"""Validation of llmmem.GradScaler's settings: ValueError/TypeError naming the argument, never
a bare assert (torch's scaler uses asserts, which vanish under ``python -O``)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from llmmem.errors import InvalidArgumentError


class ScalerArgumentError(InvalidArgumentError, AssertionError):
    """A bad GradScaler setting. A ``ValueError`` (via :class:`llmmem.InvalidArgumentError`) and,
    because torch's scaler raises ``AssertionError`` for some of the same settings, also one of those."""


class ScaleInputError(TypeError, ValueError):
    """``scale()`` got something that is not a tensor or an iterable of tensors. A ``TypeError``;
    also a ``ValueError``, which is what torch's scaler raises there."""


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(
            f"llmmem.GradScaler: {name} must be {'an int' if integer else 'a number'}, got {type(value).__name__}"
        )
    if not integer and not math.isfinite(value):
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be finite, got {value}")


def _check_growth_factor(value: Any) -> None:
    _check_number("growth_factor", value)
    if not value > 1.0:
        raise ScalerArgumentError(f"llmmem.GradScaler: growth_factor must be > 1.0, got {value}")


def _check_backoff_factor(value: Any) -> None:
    _check_number("backoff_factor", value)
    if not 0.0 < value < 1.0:
        raise ScalerArgumentError(f"llmmem.GradScaler: backoff_factor must be in (0, 1), got {value}")


def _check_growth_interval(value: Any) -> None:
    _check_number("growth_interval", value, integer=True)
    if value < 1:
        raise ScalerArgumentError(f"llmmem.GradScaler: growth_interval must be >= 1, got {value}")


HYSTERESIS_MODES = ("consecutive", "on_growth")


def _check_hysteresis_mode(value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"llmmem.GradScaler: hysteresis_mode must be a str, got {type(value).__name__}")
    if value not in HYSTERESIS_MODES:
        raise ScalerArgumentError(
            f"llmmem.GradScaler: hysteresis_mode must be one of {HYSTERESIS_MODES}, got {value!r}"
        )
