"""What would make a training step fit: changes ranked by what they save, for *this* model.

Used by :func:`llmmem.oom_report` (and ``python -m llmmem profile``). The numbers come from four
places, each named in the result: what the tracker measured (model state, tensors that outlived
the previous step), the estimator (``llmmem.estimate``: activations under checkpointing, autocast,
fused attention, another batch), the recompute planner (``llmmem.plan_checkpoints`` on the
model's own blocks, profiled at the failing input shape) and the optimizer itself (its moments,
master copies and parameters: what llmmem.optim's int8 moments, a step in backward and bf16
weights without an fp32 master would save, :mod:`llmmem.diagnostics.state_advice`). The fused
LM head (``llmmem.patch_lm_loss``) is offered where the estimator's plain head and loss (the
``[tokens x vocab]`` logits, their fp32 log-probabilities and gradients) are a large part of the
predicted peak, with what the estimator says it saves; never for a model that carries its mark.

The predicted peak of a configuration is the estimator's total with the measured parameters,
buffers and optimizer state in place of its own figures, plus tensors that outlived the previous
step; a change's peak is that less what the estimator (or the planner) says it saves. It is a
prediction: ``fits`` says the predicted peak is within the capacity, and a margin of
:data:`MARGIN` is kept when sizing a checkpointing budget or a batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from llmmem.diagnostics.state_advice import OptimizerInfo, inspect_optimizer
from llmmem.dtensors import is_dtensor, local_share
from llmmem.estimation import estimate
from llmmem.estimation.activations import fused_head_chunk_rows
from llmmem.estimation.recommend import FUSED_HEAD_MIN_SHARE, fused_head_offer
from llmmem.units import format_bytes

__all__ = ["Suggestion", "estimate_settings", "find_blocks", "suggest", "model_state_suggestions", "OptimizerInfo"]

# Kept free below the capacity when sizing a checkpointing budget or a batch: allocator rounding,
# the loss's temporaries and what the estimator does not count (fraction of the capacity).
MARGIN = 0.05

# Cost classes, ranked: changes that keep the training computation exactly (freeing leaked tensors,
# recomputing, the allocator), then ones that change its numerics (16-bit activations, a fused
# attention kernel), then ones that change the batch.
_COST_CLASS = {
    "free-outlived": 0,
    "fragmentation": 0,
    "auto_checkpoint": 0,
    "gradient_checkpointing": 0,
    "checkpointing": 0,
    "attention": 1,
    "autocast": 1,
    "fused-head": 1,  # the loss to rounding (an online log-sum-exp in fp32), about the same work
    # the model state: the same training step with rounded state, or the gradients gone before
    # clipping or accumulation could see them
    "optimizer-state": 1,
    "step_in_backward": 1,
    "bf16-weights": 1,
    "model-state": 1,
    "batch": 2,
}


@dataclass
class Suggestion:
    """One change: ``change`` (what), ``code`` (how), ``saves`` (bytes), ``predicted_peak`` (bytes,
    None when unknown), ``fits`` (within the capacity, None when unknown), ``slowdown`` (expected
    extra step time as a fraction, None when unknown), ``source`` ("measured", "estimator",
    "planner"), ``kind`` and ``params`` (for applying it: e.g. ``{"budget": bytes}``)."""

    kind: str
    change: str
    code: str
    saves: int
    predicted_peak: int | None
    fits: bool | None
    slowdown: float | None
    source: str
    params: dict = field(default_factory=dict)
    note: str = ""

    def describe(self) -> str:
        verdict = {True: "fits", False: "not enough alone", None: "fit unknown"}[self.fits]
        cost = "" if self.slowdown is None else f", about +{100 * self.slowdown:.1f}% step time"
        peak = "" if self.predicted_peak is None else f" -> peak {format_bytes(self.predicted_peak)}"
        text = f"[{verdict}] {self.change}: saves {format_bytes(self.saves)}{peak}{cost} ({self.source})\n      {self.code}"
        return text + (f"\n      {self.note}" if self.note else "")

    def to_dict(self) -> dict:
        return asdict(self)


def _rank(s: Suggestion):
    return (s.fits is not True, _COST_CLASS.get(s.kind, 3), s.slowdown or 0.0, -s.saves)


# =================================================================================================
# what is being trained
# =================================================================================================
def find_blocks(model) -> tuple[str, torch.nn.Module] | None:
    """``(path, module)`` of the model's chain of repeated blocks (the ``nn.ModuleList`` or
    ``nn.Sequential`` of at least two modules of one class holding the most parameters), or None."""
    best = None
    for name, sub in model.named_modules():
        if not isinstance(sub, (torch.nn.ModuleList, torch.nn.Sequential)) or len(sub) < 2:
            continue
        kinds = {type(m) for m in sub}
        if len(kinds) != 1:
            continue
        count = sum(p.numel() for p in sub.parameters())
        if count and (best is None or count > best[0]):
            best = (count, name, sub)
    return None if best is None else (best[1], best[2])


def _precision(model, autocast_dtype) -> str:
    parameters = getattr(model, "parameters", None)  # a config has none: built in the default fp32
    first = next(iter(parameters()), None) if callable(parameters) else None
    dtype = first.dtype if first is not None else torch.float32
    if dtype == torch.bfloat16:
        return "bf16"
    if autocast_dtype == torch.bfloat16:
        return "bf16-mixed"
    if autocast_dtype == torch.float16 or dtype == torch.float16:
        return "fp16-mixed"
    return "fp32"


def _optimizer_kind(optimizer) -> str:
    if optimizer is None:
        return "sgd"
    info = inspect_optimizer(optimizer)
    if info.family == "llmmem-adam":
        return f"{'adamw' if info.decoupled else 'adam'}-{info.state_dtype}"
    name = type(optimizer).__name__.lower()
    if name.startswith("adam"):
        return "adamw" if name == "adamw" else "adam"
    if name == "sgd":
        momentum = optimizer.param_groups[0].get("momentum", 0) if optimizer.param_groups else 0
        return "sgd-momentum" if momentum else "sgd"
    return "adam"  # two moments per parameter: the common case for LLM optimizers


def _attention(model) -> str | None:
    for cfg in (getattr(model, "cfg", None), model):  # llmmem's GPT, or its GPTConfig
        if getattr(cfg, "attention", None) in ("explicit", "sdpa"):
            return cfg.attention
    for config in (getattr(model, "config", None), model):  # a Hugging Face model, or its config
        hf = getattr(config, "_attn_implementation", None)
        if isinstance(hf, str):
            return "explicit" if hf == "eager" else "sdpa"
    return None


def estimate_settings(
    model, *, batch, seq, optimizer=None, autocast_dtype=None, device="cpu", target_seq=None
) -> dict:
    """The keyword arguments of ``llmmem.estimate`` describing how ``model`` is being trained.

    :param model: the ``nn.Module``, or the config it is built from (llmmem's ``GPTConfig``, a
        Hugging Face config: parameters in the default fp32), to size a run before building it.
    :param target_seq: an encoder-decoder's decoder length (None: ``seq``)."""
    kwargs = dict(
        batch=int(batch),
        seq=int(seq),
        precision=_precision(model, autocast_dtype),
        optimizer=_optimizer_kind(optimizer),
        device_type="cuda" if str(device).startswith("cuda") else "cpu",
    )
    if target_seq is not None:
        kwargs["target_seq"] = int(target_seq)
    attention = _attention(model)
    if attention is not None:
        kwargs["attention"] = attention
    if optimizer is not None:
        kwargs.update(_state_settings(optimizer, kwargs["precision"]))
    return kwargs


def _state_settings(optimizer, precision: str) -> dict:
    """The estimator's model-state settings of ``optimizer``: llmmem.optim's block size, threshold
    and master copy (of 16-bit weights: fp32 weights under autocast are modelled by the precision),
    and whether it is stepped in backward."""
    out = {}
    info = inspect_optimizer(optimizer)
    if info.family == "llmmem-adam":
        group = optimizer.param_groups[0]
        if info.state_dtype in ("int8", "int4"):
            out["block_size"] = group.get("block_size") or None
            out["min_quantized_numel"] = group.get("min_quantized_numel")
        if precision == "bf16":
            out["master_weights"] = bool(group.get("master_weights"))
    if info.in_backward:
        out["step_in_backward"] = True
    return out


def _act(est) -> int:
    return est.activations + est.temporary


# =================================================================================================
# suggestions
# =================================================================================================
def suggest(
    model,
    *,
    capacity: int,
    settings: dict | None,
    measured: dict,
    outlived: int = 0,
    block_input=None,
    fragmentation: dict | None = None,
    plan: bool = True,
    optimizer=None,
) -> tuple[list[Suggestion], dict]:
    """Changes that would make the step fit ``capacity`` bytes, best first, and the basis
    (``predicted_peak``, notes).

    :param settings: :func:`estimate_settings` (None: no estimator-based suggestions).
    :param measured: bytes by category measured on the device (parameters, buffers, optimizer_state).
    :param outlived: bytes of tensors kept alive from the previous step.
    :param block_input: ``(shape, dtype, device)`` of the first block's input, for the planner.
    :param fragmentation: ``{"reserved_free", "requested"}`` on CUDA.
    :param plan: run the recompute planner (profiles one block at the failing shape: its
        activations in memory, a few forward/backward runs; gradients and RNG state are restored).
    :param optimizer: the step's optimizer: its state and parameters size the model-state changes
        (:func:`model_state_suggestions`).
    """
    out: list[Suggestion] = []
    basis: dict = {"capacity": capacity, "notes": []}
    notes = basis["notes"]
    if outlived > 0:
        leak = Suggestion(
            kind="free-outlived",
            change=f"free the tensors kept from the previous step ({format_bytes(outlived)})",
            code="drop references to last step's tensors (e.g. keep loss.item(), not loss; del outputs)",
            saves=outlived,
            predicted_peak=None,
            fits=None,
            slowdown=0.0,
            source="measured",
        )
        out.append(leak)
    if fragmentation and fragmentation.get("reserved_free"):
        free, req = fragmentation["reserved_free"], fragmentation.get("requested")
        out.append(
            Suggestion(
                kind="fragmentation",
                change=f"use the {format_bytes(free)} reserved but free (fragmented) memory",
                code="PYTORCH_ALLOC_CONF=expandable_segments:True (environment), or llmmem.use_pool(llmmem.MemoryPool(...))",
                saves=free,
                predicted_peak=None,
                fits=(req is not None and free >= req) or None,
                slowdown=0.0,
                source="measured",
            )
        )
    est0 = None
    if settings is not None:
        try:
            est0 = estimate(model, **settings)
        except (ValueError, TypeError) as exc:
            notes.append(f"estimator unavailable for this model: {exc}")
    if est0 is None:
        if optimizer is not None:  # what they save is known; the peak it comes off is not
            out.extend(model_state_suggestions(optimizer, settings or {}, capacity, None))
        out.sort(key=_rank)
        return out, basis

    measured_state = measured.get("parameters", 0) + measured.get("buffers", 0)
    opt_state = measured.get("optimizer_state", 0) or (est0.optimizer_state + est0.master_weights)
    # The estimator sizes the whole model's gradients; a rank of a sharded model (FSDP2, tensor
    # parallelism: DTensor parameters) holds its parameters' share of them.
    parameters = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    gradients = round(est0.gradients * local_share(parameters))
    fixed = measured_state + gradients + opt_state + outlived
    peak0 = fixed + _act(est0)
    if outlived > 0:
        leak.predicted_peak = peak0 - outlived
        leak.fits = leak.predicted_peak <= capacity
    basis.update(
        predicted_peak=peak0,
        estimate=settings,
        fixed=fixed,
        activations=est0.activations,
        temporary=est0.temporary,
    )

    def with_(**change):
        return estimate(model, **{**settings, **change})

    def add(kind, change, code, est, source="estimator", slowdown=None, note="", **params):
        saves = _act(est0) - _act(est)
        if saves <= 0:
            return
        peak = peak0 - saves
        out.append(
            Suggestion(
                kind=kind,
                change=change,
                code=code,
                saves=saves,
                predicted_peak=peak,
                fits=peak <= capacity,
                slowdown=est.slowdown if slowdown is None else slowdown,
                source=source,
                params=params,
                note=note,
            )
        )

    # checkpointing: the planner on the model's own blocks, or the model's switch, or the estimator
    blocks = find_blocks(model)
    hf = hasattr(model, "gradient_checkpointing_enable") and getattr(model, "supports_gradient_checkpointing", False)
    full = with_(checkpointing="full")
    if plan and not hf and blocks is not None and any(is_dtensor(p) for p in parameters):
        # Profiling a block of a sharded model runs its collectives (FSDP2's all-gathers, tensor
        # parallelism's reductions) on this rank alone, which may be the only one that failed:
        # it would wait for the others for ever. The estimator's figure stands in.
        plan = False
        notes.append("recompute planner not run: the model's parameters are DTensors (FSDP2 / tensor parallelism)")
    if hf:
        # transformers 5 renamed the switch (the old name warns that it will go in v6)
        switch = (
            "activation_checkpointing_enable"
            if hasattr(model, "activation_checkpointing_enable")
            else "gradient_checkpointing_enable"
        )
        add("gradient_checkpointing", "activation checkpointing of every layer", f"model.{switch}()", full)
    elif plan and blocks is not None and block_input is not None:
        out.extend(_planned(model, blocks, block_input, capacity, peak0, est0, full, notes))
    else:
        where = f"model.{blocks[0]}" if blocks is not None else "the model's blocks"
        add(
            "checkpointing",
            "activation checkpointing of every block",
            f"llmmem.checkpoint(block, x, use_reentrant=False) for each block in {where}",
            full,
        )
    if settings.get("attention") == "explicit":
        code = (
            "GPTConfig(attention='sdpa')"
            if hasattr(model, "cfg")
            else "from_pretrained(..., attn_implementation='sdpa') / torch.nn.functional.scaled_dot_product_attention"
        )
        add("attention", "a fused attention kernel (no s x s tensors kept)", code, with_(attention="sdpa"))
    if settings["precision"] == "fp32":
        dev = settings["device_type"]
        add(
            "autocast",
            "bf16 autocast (16-bit activations; parameters and optimizer stay fp32)",
            f"with torch.autocast('{dev}', dtype=torch.bfloat16): loss = ...",
            with_(precision="bf16-mixed"),
            slowdown=0.0,
        )
    suggestion = _fused_head(model, est0, peak0, with_)
    if suggestion is not None:
        add(*suggestion)
    b = settings["batch"]
    if b > 1:
        best = None
        lo, hi = 1, b - 1
        while lo <= hi:  # the peak grows with the batch: bisect the largest that fits
            mid = (lo + hi) // 2
            if peak0 - (_act(est0) - _act(with_(batch=mid))) <= capacity * (1 - MARGIN):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best is not None:
            k = math.ceil(b / best)
            add(
                "batch",
                f"batch <= {best} (from {b})",
                f"batch size {best}, accumulating gradients over {k} micro-batches to keep {b}",
                with_(batch=best),
                slowdown=0.0,
                batch=best,
            )
    if optimizer is not None:
        out.extend(model_state_suggestions(optimizer, settings, capacity, peak0))
    out.sort(key=_rank)
    return out, basis


def _fused_head(model, est0, peak0: int, with_):
    """The arguments of ``add`` for the fused head (llmmem.patch_lm_loss where it takes ``model``,
    else llmmem.linear_cross_entropy by hand: :func:`~llmmem.estimation.recommend.fused_head_offer`),
    or None: not for a model whose loss is fused already (it carries the mark, which the estimate
    read), nor one whose head is not a plain linear layer, nor where the plain head and loss are
    less than :data:`FUSED_HEAD_MIN_SHARE` of the predicted peak."""
    if est0.settings.fused_head:
        return None
    plain = est0.head_loss["plain"]
    logits = plain["kept"] + plain["temporary"]
    if logits < FUSED_HEAD_MIN_SHARE * peak0:
        return None
    offer = fused_head_offer(model)
    if offer is None:
        return None
    fused = with_(fused_head=True)
    rows = fused_head_chunk_rows(fused.model, fused.settings)
    note = (
        f"the LM head and loss one chunk of {rows} rows of logits at a time (llmmem.linear_cross_entropy): the "
        f"[tokens x vocab] logits, their fp32 log-probabilities and gradients ({format_bytes(logits)} at the peak "
        "now) never exist whole"
    )
    return ("fused-head", *offer, fused, "estimator", 0.0, note)


def model_state_suggestions(optimizer, settings: dict, capacity: int, peak: int | None) -> list[Suggestion]:
    """The model-state changes that apply to ``optimizer``, each with what it saves of the
    predicted ``peak`` (None: unknown): llmmem.optim's int8 moments (for torch's Adam/AdamW, or llmmem's with fp32
    or bf16 moments; not AMSGrad), the step in backward (the gradients but the largest; not
    with an fp16 loss scaler, nor when it is on already), bf16 weights updated with stochastic
    rounding (fp32 weights to bf16, or the fp32 master llmmem.optim keeps; Adam-family only); and
    all that apply together."""
    out: list[Suggestion] = []
    info = inspect_optimizer(optimizer)
    adam = info.family in ("torch-adam", "llmmem-adam") and not info.amsgrad
    cls = "AdamW" if info.decoupled else "Adam"
    sizes = list(zip(info.numels, info.element_sizes))
    # the model state now, and what each change leaves of it (bytes)
    now = dict(moments=info.moments, gradients=info.gradients, master=info.master, parameters=info.parameters)
    # (short name, change, code, what it leaves, note) by kind
    changes: dict = {}
    if adam and info.state_dtype in ("fp32", "bf16") and info.int8_moments < info.moments:
        changes["optimizer-state"] = (
            "int8 moments",
            f"switch to llmmem.optim.{cls}(state_dtype='int8') (moments {format_bytes(info.moments)} now)",
            f"opt = llmmem.optim.{cls}(model.parameters(), ..., state_dtype='int8')",
            dict(moments=info.int8_moments),
            "int4 moments (state_dtype='int4') take about half of int8's",
        )
    # llmmem.optim.step_in_backward refuses DTensor parameters (FSDP2 writes their gradients itself)
    in_backward_ok = not info.in_backward and not info.sharded and settings.get("precision") != "fp16-mixed"
    if in_backward_ok and len(sizes) > 1 and info.gradients > info.largest_gradient:
        changes["step_in_backward"] = (
            "step in backward",
            "step_in_backward: each gradient freed as soon as its parameter is stepped",
            "handle = llmmem.optim.step_in_backward(model, opt)",
            dict(gradients=info.largest_gradient),
            "the peak falls by this where it comes once every gradient exists (end of backward, the step), less "
            "what autograd still holds there; not with gradient clipping by global norm, accumulation over "
            "several backwards or an fp16 GradScaler",
        )
    if adam and (info.fp32_numel or info.master):
        halved = 2 * info.fp32_numel  # fp32 weights (and their gradients) to bf16
        what = "fp32 weights to bf16" if info.fp32_numel else "its fp32 master copy dropped"
        keep = f", state_dtype='{info.state_dtype}'" if info.family == "llmmem-adam" else ""
        changes["bf16-weights"] = (
            "bf16 weights",
            f"bf16 weights updated with stochastic rounding, no fp32 master ({what})",
            f"model.to(torch.bfloat16); opt = llmmem.optim.{cls}(model.parameters(), ...{keep}, master_weights=False)",
            dict(parameters=info.parameters - halved, gradients=info.gradients - halved, master=0),
            "with fp32 weights and no autocast the activations halve too (not counted here)" if halved else "",
        )

    def saved(left: dict) -> int:
        return sum(now.values()) - sum({**now, **left}.values())

    changes = {kind: c for kind, c in changes.items() if saved(c[3]) > 0}
    for kind, (_, change, code, left, note) in changes.items():
        out.append(_state_suggestion(kind, change, code, saved(left), peak, capacity, note))
    if len(changes) > 1:
        left = {}
        for _, _, _, leaves, _ in changes.values():
            left.update(leaves)
        if "bf16-weights" in changes and "step_in_backward" in changes:  # the largest gradient, in bf16
            left["gradients"] = max(n * (2 if e == 4 else e) for n, e in sizes)
        names = ", ".join(c[0] for c in changes.values())
        out.append(
            _state_suggestion("model-state", f"all of: {names}", "each as above", saved(left), peak, capacity, "")
        )
    return out


def _state_suggestion(kind, change, code, saves, peak, capacity, note) -> Suggestion:
    return Suggestion(
        kind=kind,
        change=change,
        code=code,
        saves=saves,
        predicted_peak=None if peak is None else peak - saves,
        fits=None if peak is None else peak - saves <= capacity,
        slowdown=0.0,
        source="optimizer",
        note=note,
    )


def _planned(model, blocks, block_input, capacity, peak0, est0, full, notes) -> list[Suggestion]:
    """auto_checkpoint for the blocks, planned for what the capacity leaves them."""
    from llmmem.checkpointing import plan_checkpoints
    from llmmem.errors import InfeasibleError

    path, chain = blocks
    shape, dtype, device = block_input
    chain_budget = int(capacity * (1 - MARGIN) - (peak0 - est0.activations_layers))
    if chain_budget <= 0:
        notes.append(
            f"checkpointing cannot fit alone: the rest of the step needs {format_bytes(peak0 - est0.activations_layers)}"
        )
        return []
    params = list(chain.parameters())
    grads = [p.grad for p in params]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        for p in params:
            p.grad = None
        sample = torch.randn(shape, dtype=dtype, device=device)
        try:
            plan = plan_checkpoints(chain, sample, chain_budget, repeats=1, warmup=1)
            fits = True
        except InfeasibleError as exc:
            least = getattr(exc, "min_budget_bytes", None)
            if least is None:
                notes.append(f"planner: {exc}")
                return []
            plan = plan_checkpoints(chain, sample, least, repeats=1, warmup=1)
            fits = False
        del sample
    except (RuntimeError, ValueError) as exc:  # the planner's own out-of-memory, a block it cannot run
        notes.append(f"planner not run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return []
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    base = plan.predicted_time - plan.predicted_overhead_time
    chain_share = min(1.0, 3 * full.slowdown)  # the blocks' forward+backward as a fraction of the step
    slowdown = plan.predicted_overhead_time / base * chain_share if base > 0 else None
    saves = max(0, plan.no_checkpoint_peak_bytes - plan.predicted_peak_bytes)
    peak = peak0 - est0.activations_layers + plan.predicted_peak_bytes
    dims = ", ".join(str(d) for d in shape)
    code = (
        f"model.{path} = llmmem.auto_checkpoint(model.{path}, torch.randn({dims}, dtype={dtype}, device='{device}'), "
        f"budget={plan.budget_bytes})"
    )
    return [
        Suggestion(
            kind="auto_checkpoint",
            change=f"planned activation checkpointing of model.{path} ({len(plan.regions)} region(s))",
            code=code,
            saves=saves,
            predicted_peak=peak,
            fits=fits and peak <= capacity,
            slowdown=slowdown,
            source="planner",
            params={"path": path, "budget": plan.budget_bytes, "input_shape": list(shape), "dtype": str(dtype)},
            note="" if fits else f"the least the blocks can take is {format_bytes(plan.budget_bytes)}",
        )
    ]
