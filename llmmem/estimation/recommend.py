"""The recommendation search: every combination of checkpointing, ZeRO stage, tensor and sequence
parallelism and fused attention on a number of devices, and the cheapest that fits; and, apart
from it, the changes of the model state (llmmem.optim's quantized moments, the step in backward,
bf16 weights without a master) and of the loss (the fused LM head, llmmem.patch_lm_loss), and what
each saves."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from llmmem.estimation.breakdown import compute
from llmmem.estimation.model_configs import ModelConfig, peft_base_model
from llmmem.estimation.model_state import DEFAULT_BLOCK, MIN_QUANTIZED_NUMEL
from llmmem.estimation.settings import PRECISIONS, Settings, tp_indivisible
from llmmem.units import format_bytes

__all__ = [
    "Recommendation",
    "ModelStateFix",
    "search",
    "model_state_fixes",
    "fused_head_fix",
    "fused_head_offer",
    "logits_are_large",
    "FUSED_HEAD_MIN_SHARE",
    "changes_between",
    "pct",
    "MAX_TENSOR_PARALLEL",
    "MAX_DEVICES",
]

MAX_TENSOR_PARALLEL = 8
# The recommendation first searches the user's device count (data_parallel x tensor_parallel); if
# nothing fits it doubles the device count up to this many.
MAX_DEVICES = 4096
# The fused LM head is offered when the plain head and loss (their logits, fp32 log-probabilities
# and gradients) take at least this fraction of the peak: below it, patching the model's loss buys
# little.
FUSED_HEAD_MIN_SHARE = 0.10


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
    optimizer, batch or sequence: those change the training itself). A step in backward is kept
    where it can be (one data-parallel rank) and dropped where it cannot."""
    attentions = [st.attention] + (["sdpa"] if st.attention == "explicit" else [])
    ckpts = checkpointing_options(max(cfg.layers, cfg.decoder_layers))
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
                            step_in_backward=st.step_in_backward and n_d == 1,
                        )


def changes_between(old: Settings, new: Settings) -> dict:
    return {k: v for k, v in new.public().items() if getattr(old, k) != v}


def best_fit(
    cfg: ModelConfig,
    counted: int | None,
    st: Settings,
    devices: int,
    budget: int,
    layer_scale: float = 1.0,
    shapes=None,
):
    """``((slowdown, number of changes, total), settings)`` of the cheapest fitting candidate, or None.

    Ties in slowdown go to fewer changes, then to less memory.
    """
    best = None
    for cand in candidates(cfg, st, devices):
        nums = compute(cfg, counted, cand, layer_scale, shapes)
        total = nums["bytes"]["total"]
        if total > budget:
            continue
        key = (round(nums["slowdown"], 9), len(changes_between(st, cand)), total)
        if best is None or key < best[0]:
            best = (key, cand)
    return best


def search(cfg: ModelConfig, counted: int | None, st: Settings, budget: int, layer_scale: float = 1.0, shapes=None):
    """``(devices, ((slowdown, changes, total), settings))``: the cheapest fitting settings on the
    user's device count, or on the fewest doublings of it that fit; None if none up to MAX_DEVICES."""
    devices = st.devices
    while devices <= MAX_DEVICES:
        best = best_fit(cfg, counted, st, devices, budget, layer_scale, shapes)
        if best is not None:
            return devices, best
        devices *= 2
    return None


# =================================================================================================
# changes of the model state
# =================================================================================================
@dataclass(frozen=True)
class ModelStateFix:
    """A change of the model state: ``change`` (what), ``code`` (how), ``changes`` (the estimate's
    settings that differ), ``saves`` (bytes less per device), ``total`` (the peak after it) and
    ``fits`` (within the device memory)."""

    change: str
    code: str
    changes: dict
    saves: int
    total: int
    fits: bool

    def describe(self) -> str:
        verdict = "fits" if self.fits else "not enough alone"
        shown = {k: v for k, v in self.changes.items() if k not in ("block_size", "min_quantized_numel")}
        changes = ", ".join(f"{k}={v}" for k, v in shown.items())
        return (
            f"[{verdict}] {self.change}: saves {format_bytes(self.saves)} -> {format_bytes(self.total)} "
            f"({changes}; {self.code})"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _adam_kind(st: Settings) -> str | None:
    """``"adamw"`` or ``"adam"`` for an Adam-family optimizer (torch's or llmmem's), else None."""
    for kind in ("adamw", "adam"):
        if st.optimizer == kind or st.optimizer.startswith(kind + "-"):
            return kind
    return None


def _state_change(kind: str, dtype: str) -> dict:
    quantized = dtype in DEFAULT_BLOCK
    return {
        "optimizer": f"{kind}-{dtype}",
        "block_size": DEFAULT_BLOCK[dtype] if quantized else None,
        "min_quantized_numel": MIN_QUANTIZED_NUMEL if quantized else None,
    }


def model_state_fix_settings(st: Settings) -> list[tuple[str, str, dict]]:
    """``(change, code, settings to replace)`` of each model-state change that applies to ``st``:
    llmmem.optim's int8 (and int4) moments for an Adam-family optimizer whose state is wider;
    the step in backward (any optimizer; one data-parallel rank, no fp16 loss scaler); bf16 weights without an
    fp32 master for an Adam-family optimizer training fp32 weights or keeping a master; and all
    of those together."""
    out = []
    kind = _adam_kind(st)
    cls = "AdamW" if kind == "adamw" else "Adam"
    if kind is not None:
        wide = st.state_dtype in (None, "fp32", "bf16")
        for dtype in ("int8", "int4"):
            if wide or (dtype == "int4" and st.state_dtype == "int8"):
                out.append(
                    (
                        f"switch to llmmem.optim.{cls}(state_dtype='{dtype}')",
                        f"opt = llmmem.optim.{cls}(model.parameters(), ..., state_dtype='{dtype}')",
                        _state_change(kind, dtype),
                    )
                )
    if not st.step_in_backward and st.data_parallel == 1 and st.precision != "fp16-mixed":
        out.append(
            (
                "step_in_backward (the gradients freed as each parameter is stepped)",
                "llmmem.optim.step_in_backward(model, opt)  (not with gradient clipping or accumulation)",
                {"step_in_backward": True},
            )
        )
    if kind is not None and (st.precision == "fp32" or st.master_weights):
        new = {"precision": "bf16", "master_weights": False}
        if st.state_dtype is None:  # torch's moments were fp32 (beside the master): llmmem's fp32 state
            moment = PRECISIONS[st.precision]["moment"]
            new.update(_state_change(kind, "fp32" if moment == 4 else "bf16"))
        out.append(
            (
                "bf16 weights with stochastic rounding (no fp32 master)",
                f"model.to(torch.bfloat16); opt = llmmem.optim.{cls}(model.parameters(), ...)",
                new,
            )
        )
    return out


def model_state_fixes(
    cfg: ModelConfig,
    counted: int | None,
    st: Settings,
    budget: int,
    layer_scale: float = 1.0,
    shapes=None,
) -> list[ModelStateFix]:
    """Each applicable model-state change (:func:`model_state_fix_settings`) with what it saves on
    the requested settings, largest saving first; then, when changes of more than one kind apply,
    all of them together (with int8 moments if that fits, else int4)."""
    base = compute(cfg, counted, st, layer_scale, shapes)["bytes"]["total"]

    def fix(change, code, new):
        cand = dataclasses.replace(st, **new)
        total = compute(cfg, counted, cand, layer_scale, shapes)["bytes"]["total"]
        return ModelStateFix(change, code, changes_between(st, cand), base - total, total, total <= budget)

    found = [(fix(*f), f[2]) for f in model_state_fix_settings(st)]
    found = [(f, new) for f, new in found if f.saves > 0]
    singles = sorted((f for f, _ in found), key=lambda f: -f.saves)
    states = [(f, new) for f, new in found if "precision" not in new and "optimizer" in new]
    others = [(f, new) for f, new in found if (f, new) not in states]
    if len(others) + bool(states) < 2:
        return singles
    combos = []
    for state in states or [None]:
        merged, names = {}, []
        for f, new in others + ([state] if state else []):  # the state format last: it names the optimizer
            merged.update(new)
            names.append(f.change)
        combos.append(fix("all of: " + "; ".join(names), "each as above", merged))
    combined = next((c for c in combos if c.fits), combos[-1])
    return singles + [combined]


# =================================================================================================
# the fused LM head
# =================================================================================================
def logits_are_large(head_loss: dict) -> bool:
    """Whether the plain head and loss (an estimate's ``head_loss``) take at least
    :data:`FUSED_HEAD_MIN_SHARE` of the peak with the plain head."""
    plain = head_loss["plain"]
    return plain["kept"] + plain["temporary"] >= FUSED_HEAD_MIN_SHARE * plain["total"]


FUSED_HEAD_CHANGE = "llmmem.patch_lm_loss(model)"
FUSED_HEAD_CODE = (
    "handle = llmmem.patch_lm_loss(model)  (a model of your own: loss = llmmem.linear_cross_entropy(hidden, "
    "lm_head.weight, labels))"
)
BY_HAND_CODE = (
    "loss = llmmem.linear_cross_entropy(hidden, lm_head.weight, labels)  (hidden: the last hidden states, after "
    "the final norm; labels shifted as the model's loss shifts them)"
)


def fused_head_offer(model) -> tuple[str, str] | None:
    """``(change, code)`` of the fused head for ``model``: ``llmmem.patch_lm_loss`` where it would
    take the model (or, for a PEFT wrapper, the model inside it), else ``llmmem.linear_cross_entropy``
    in the model's loss, saying why; None where the head is not a plain linear layer (an adapter or
    a quantized head: its weight alone is not the head); for a name or a config, which cannot be
    asked, both. Imports ``llmmem.head`` only for an ``nn.Module`` (torch is loaded then)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):
        return FUSED_HEAD_CHANGE, FUSED_HEAD_CODE
    from llmmem.head.patchable import patch_refusal

    refusal = patch_refusal(model)
    if refusal is None:
        return FUSED_HEAD_CHANGE, "handle = llmmem.patch_lm_loss(model)"
    refused, base = model, peft_base_model(model)
    if base is not None:
        refused, refusal = base, patch_refusal(base)
        if refusal is None:
            return (
                "llmmem.patch_lm_loss(model.get_base_model())",
                "handle = llmmem.patch_lm_loss(model.get_base_model())  (the model inside the PEFT wrapper)",
            )
    if refusal.kind in ("head", "patched"):
        return None
    reason = refusal.message.removeprefix("patch_lm_loss: ").split(";")[0].replace(f"{type(refused).__module__}.", "")
    return f"llmmem.linear_cross_entropy in the model's loss (llmmem.patch_lm_loss refuses it: {reason})", BY_HAND_CODE


def fused_head_fix(
    cfg: ModelConfig,
    counted: int | None,
    st: Settings,
    budget: int,
    layer_scale: float = 1.0,
    shapes=None,
    model=None,
) -> ModelStateFix | None:
    """The fused LM head as a change of the requested settings, with what it saves (the estimate's
    total with the plain head less the one with the fused head): None when the head is fused
    already, saves nothing, the logits are not large (:func:`logits_are_large`), or ``model`` (what
    the estimate was asked of) has no head to fuse (:func:`fused_head_offer`)."""
    if st.fused_head or not cfg.vocab_head:  # a classifier's head has no logits to speak of
        return None
    head_loss = compute(cfg, counted, st, layer_scale, shapes)["head_loss"]
    plain, fused = head_loss["plain"]["total"], head_loss["fused"]["total"]
    if plain <= fused or not logits_are_large(head_loss):
        return None
    offer = fused_head_offer(model)
    if offer is None:
        return None
    cand = dataclasses.replace(st, fused_head=True)
    return ModelStateFix(*offer, changes_between(st, cand), plain - fused, fused, fused <= budget)
