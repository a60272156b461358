"""The recommendation search: every combination of checkpointing, ZeRO stage, tensor and sequence
parallelism and fused attention on a number of devices, and the cheapest that fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmmem.estimation.breakdown import compute
from llmmem.estimation.model_configs import ModelConfig
from llmmem.estimation.settings import Settings, tp_indivisible
from llmmem.units import format_bytes

__all__ = ["Recommendation", "search", "changes_between", "pct", "MAX_TENSOR_PARALLEL", "MAX_DEVICES"]

MAX_TENSOR_PARALLEL = 8
# The recommendation first searches the user's device count (data_parallel x tensor_parallel); if
# nothing fits it doubles the device count up to this many.
MAX_DEVICES = 4096


@dataclass(frozen=True)
class Recommendation:
    """The cheapest settings that fit: what to change, on how many devices, at what expected cost.

    ``settings`` holds the full settings; ``changes`` only those that differ from the request;
    ``estimate`` is the :class:`Estimate` for them (its ``total`` fits ``device_memory``);
    ``slowdown`` is its expected extra step time as a fraction (see ``slowdown_terms``).
    """

    settings: dict
    changes: dict
    devices: int
    slowdown: float
    estimate: object  # the llmmem.estimation.estimator.Estimate of these settings

    def describe(self) -> str:
        changes = ", ".join(f"{k}={v}" for k, v in self.changes.items()) or "no change"
        return (
            f"{changes}  ->  {format_bytes(self.estimate.total)} per device on {self.devices} device(s), "
            f"expected slowdown {pct(self.slowdown)}"
        )

    def to_dict(self) -> dict:
        return {
            "settings": dict(self.settings),
            "changes": dict(self.changes),
            "devices": self.devices,
            "slowdown": self.slowdown,
            "total": self.estimate.total,
        }


def pct(x: float) -> str:
    return f"+{100 * x:.1f}%"


def checkpointing_options(layers: int) -> list[str]:
    """none, selective, full, and every-K for each K giving a distinct number of recomputed layers."""
    options, seen = ["none", "selective", "full"], {0, layers}
    for k in range(2, layers + 1):
        n = -(-layers // k)
        if n not in seen:
            seen.add(n)
            options.append(f"every-{k}")
    return options


def candidates(cfg: ModelConfig, st: Settings, devices: int):
    """All settings on ``devices`` devices that change only memory techniques (never precision,
    optimizer, batch or sequence: those change the training itself)."""
    attentions = [st.attention] + (["sdpa"] if st.attention == "explicit" else [])
    ckpts = checkpointing_options(cfg.layers)
    for t in (1, 2, 4, 8):
        if t > MAX_TENSOR_PARALLEL or devices % t or tp_indivisible(cfg, t) is not None:
            continue
        n_d = devices // t
        for sp in (False, True) if t > 1 else (False,):
            for zero in range(4) if n_d > 1 else (0,):
                for attention in attentions:
                    for ckpt in ckpts:
                        yield dataclasses.replace(
                            st,
                            tensor_parallel=t,
                            data_parallel=n_d,
                            sequence_parallel=sp,
                            zero_stage=zero,
                            attention=attention,
                            checkpointing=ckpt,
                        )


def changes_between(old: Settings, new: Settings) -> dict:
    return {k: v for k, v in new.public().items() if getattr(old, k) != v}


def best_fit(cfg: ModelConfig, counted: int | None, st: Settings, devices: int, budget: int, layer_scale: float = 1.0):
    """``((slowdown, number of changes, total), settings)`` of the cheapest fitting candidate, or None.

    Ties in slowdown go to fewer changes, then to less memory.
    """
    best = None
    for cand in candidates(cfg, st, devices):
        nums = compute(cfg, counted, cand, layer_scale)
        total = nums["bytes"]["total"]
        if total > budget:
            continue
        key = (round(nums["slowdown"], 9), len(changes_between(st, cand)), total)
        if best is None or key < best[0]:
            best = (key, cand)
    return best


def search(cfg: ModelConfig, counted: int | None, st: Settings, budget: int, layer_scale: float = 1.0):
    """``(devices, ((slowdown, changes, total), settings))``: the cheapest fitting settings on the
    user's device count, or on the fewest doublings of it that fit; None if none up to MAX_DEVICES."""
    devices = st.devices
    while devices <= MAX_DEVICES:
        best = best_fit(cfg, counted, st, devices, budget, layer_scale)
        if best is not None:
            return devices, best
        devices *= 2
    return None
