"""Validation of llmmem.GradScaler's settings: ValueError/TypeError naming the argument, never
a bare assert (torch's scaler uses asserts, which vanish under ``python -O``)."""

from __future__ import annotations

import math
import numbers
from collections import abc
from typing import Any, Optional

from llmmem.errors import InvalidArgumentError


class ScalerArgumentError(InvalidArgumentError, AssertionError):
    """A bad GradScaler setting. A ``ValueError`` (via :class:`llmmem.InvalidArgumentError`) and,
    because torch's scaler raises ``AssertionError`` for some of the same settings, also one of those."""


class ScalerStateKeyError(ScalerArgumentError, KeyError):
    """``load_state_dict`` got a dict without a key it needs. A ``ValueError`` like the other bad
    settings, and a ``KeyError``, which is what torch's scaler raises there."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


class ScaleInputError(TypeError, ValueError):
    """``scale()`` got something that is not a tensor or an iterable of tensors. A ``TypeError``;
    also a ``ValueError``, which is what torch's scaler raises there."""


# The C core's types: the trackers are int32 (as torch's growth tracker), the growth interval an
# int64, the scale and min_scale float32.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(
            f"llmmem.GradScaler: {name} must be {'an int' if integer else 'a number'}, got {type(value).__name__}"
        )
    if not integer and not math.isfinite(value):
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be finite, got {value}")


def _check_int_range(name: str, value: Any, low: int, high: int) -> None:
    _check_number(name, value, integer=True)
    if not low <= value <= high:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be in [{low}, {high}], got {value}")


def _check_init_scale(value: Any, name: str = "init_scale") -> None:
    _check_number(name, value)
    if not value > 0:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be > 0, got {value}")
    if value > FLOAT32_MAX:  # the scale is a float32 tensor
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be <= {FLOAT32_MAX} (a float32), got {value}")


def _check_growth_factor(value: Any, name: str = "growth_factor") -> None:
    _check_number(name, value)
    if not value > 1.0:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be > 1.0, got {value}")


def _check_backoff_factor(value: Any, name: str = "backoff_factor") -> None:
    _check_number(name, value)
    if not 0.0 < value < 1.0:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be in (0, 1), got {value}")


def _check_growth_interval(value: Any, name: str = "growth_interval") -> None:
    _check_number(name, value, integer=True)
    if value < 1:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be >= 1, got {value}")
    if value > INT64_MAX:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be <= {INT64_MAX} (an int64), got {value}")


def _check_hysteresis(value: Any, name: str = "hysteresis") -> None:
    _check_number(name, value, integer=True)
    if value < 1:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be >= 1, got {value}")
    if value > INT32_MAX:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be <= {INT32_MAX} (an int32), got {value}")


def _check_min_scale(value: Any, scale: float, name: str = "min_scale", scale_name: str = "init_scale") -> None:
    """``value`` None (no floor) or in (0, ``scale``]."""
    if value is None:
        return
    _check_number(name, value)
    if not 0 < value <= scale:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be in (0, {scale_name}={scale}], got {value}")


HYSTERESIS_MODES = ("consecutive", "on_growth")


def _check_hysteresis_mode(value: Any, name: str = "hysteresis_mode") -> None:
    if not isinstance(value, str):
        raise TypeError(f"llmmem.GradScaler: {name} must be a str, got {type(value).__name__}")
    if value not in HYSTERESIS_MODES:
        raise ScalerArgumentError(f"llmmem.GradScaler: {name} must be one of {HYSTERESIS_MODES}, got {value!r}")


_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def checked_state_dict(
    state_dict: Any, hysteresis: int, min_scale: Optional[float], hysteresis_mode: str
) -> dict[str, Any]:
    """The settings a :meth:`GradScaler.load_state_dict` of ``state_dict`` leads to, checked as a
    whole as the constructor checks its arguments, so that a bad dict changes nothing. Keys are
    named in errors as ``state_dict['key']``. Without a ``"hysteresis"`` key (a state of torch's
    scaler) the scaler keeps its own ``hysteresis``, ``min_scale`` and ``hysteresis_mode``, given
    here; its hysteresis budget starts full. Unknown keys are ignored, as torch does."""
    if not isinstance(state_dict, abc.Mapping):
        raise TypeError(f"llmmem.GradScaler: state_dict must be a dict, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise RuntimeError(
            "llmmem.GradScaler: The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
        )
    for key in _STATE_KEYS:
        if key not in state_dict:
            raise ScalerStateKeyError(
                f"llmmem.GradScaler: state_dict has no {key!r} (a GradScaler state_dict has {', '.join(_STATE_KEYS)})"
            )

    def name(key: str) -> str:
        return f"state_dict[{key!r}]"

    sd = state_dict
    _check_init_scale(sd["scale"], name("scale"))
    _check_growth_factor(sd["growth_factor"], name("growth_factor"))
    _check_backoff_factor(sd["backoff_factor"], name("backoff_factor"))
    _check_growth_interval(sd["growth_interval"], name("growth_interval"))
    _check_int_range(name("_growth_tracker"), sd["_growth_tracker"], 0, INT32_MAX)
    out = {
        "scale": float(sd["scale"]),
        "growth_factor": float(sd["growth_factor"]),
        "backoff_factor": float(sd["backoff_factor"]),
        "growth_interval": int(sd["growth_interval"]),
        "_growth_tracker": int(sd["_growth_tracker"]),
    }
    if "hysteresis" in sd:
        _check_hysteresis(sd["hysteresis"], name("hysteresis"))
        hysteresis = int(sd["hysteresis"])
        min_scale = sd.get("min_scale")
        _check_min_scale(min_scale, out["scale"], name("min_scale"), name("scale"))
        hysteresis_mode = sd.get("hysteresis_mode", "consecutive")  # states saved before the option
        _check_hysteresis_mode(hysteresis_mode, name("hysteresis_mode"))
    elif min_scale is not None and not min_scale <= out["scale"]:
        raise ScalerArgumentError(
            f"llmmem.GradScaler: {name('scale')} must be >= this scaler's min_scale={min_scale}, got {out['scale']}"
        )
    tracker = sd.get("_hysteresis_tracker", hysteresis)
    _check_int_range(name("_hysteresis_tracker"), tracker, 0, hysteresis)
    out.update(
        hysteresis=hysteresis,
        min_scale=min_scale,
        hysteresis_mode=hysteresis_mode,
        _hysteresis_tracker=int(tracker),
    )
    return out
