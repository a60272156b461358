"""The results of ``python -m llmmem compare``: the table (text and Markdown), the targets of issue 17
(for the model-state preset, of issue 23; for the LM-head preset, of issue 24; for the compiled
preset, of issue 25) checked on the run's own ratios, the headline of the model-state and LM-head
presets, and the two charts."""

from __future__ import annotations

import math

from llmmem.units import format_bytes

# Fewer paired ratios than this have no spread worth printing (llmmem.compare.measure.median_spread):
# the interval of their median is the ratios themselves, and one pair would read "±0".
MIN_SPREAD_PAIRS = 4

__all__ = [
    "derive",
    "table",
    "markdown",
    "headline",
    "is_finetune",
    "preset_family",
    "logits_bytes",
    "check_targets",
    "check_finetune_targets",
    "check_vocab_targets",
    "check_compile_targets",
    "check_preset_targets",
    "plot_timelines",
    "plot_tradeoff",
]

MiB = 2**20


# Relative difference allowed between a compiled row's loss and the eager baseline's, at every step:
# the compiled graph computes the same fp32 arithmetic in another order (fused kernels, reductions
# split otherwise), which moves a loss by about 1e-7 relative in one step and a few Adam steps
# carry forward; 1e-4 is well above that and well below what a wrong gradient does to the next step.
COMPILE_LOSS_TOLERANCE = 1e-4


def _pct(new, old):
    if new is None or old in (None, 0):
        return None
    return 100.0 * (new - old) / old


def _step_time(row: dict, timer: str) -> float | None:
    if row.get("error"):
        return None
    # A rank's CPU time leaves out the time it waits for the others: parallel rows are always wall clock.
    if timer == "cpu" and row.get("world", 1) == 1:
        return row.get("cpu_step_time")
    return row.get("step_time")


def _relative(row: dict, timer: str) -> float | None:
    """The row's step time over the fp32 reference stepped alternately with it (median of the ratios)."""
    if row.get("world", 1) > 1:
        return None
    return row.get("relative_cpu_step_time" if timer == "cpu" else "relative_step_time")


def _spread_key(timer: str) -> str:
    return "relative_cpu_step_time_spread" if timer == "cpu" else "relative_step_time_spread"


def _spread_pct(row: dict, base: dict, timer: str, rel: float, base_rel: float) -> float | None:
    """Points of overhead that the spreads of the row's and the baseline's median ratios stand for
    (:func:`llmmem.compare.measure.median_spread`, combined in quadrature), or None where not recorded."""
    s_row, s_base = row.get(_spread_key(timer)), base.get(_spread_key(timer))
    if s_row is None or s_base is None:
        return None
    if row is base:
        return 100.0 * s_base / base_rel
    return 100.0 * ((s_row / base_rel) ** 2 + (rel * s_base / base_rel**2) ** 2) ** 0.5


def derive(rows: list[dict], timer: str = "wall") -> list[dict]:
    """Each row's comparisons with the baseline (the row with key ``baseline``), added in place.

    The overhead of a single-process row is its step time over the fp32 reference stepped
    alternately with it in its own process, divided by the same ratio of the baseline row (which
    removes whatever the alternation itself costs); a parallel row's is its median step time (wall
    clock) over the baseline's median."""
    base = next(r for r in rows if r["key"] == "baseline")
    base_time = _step_time(base, timer)
    base_rel = _relative(base, timer)
    for r in rows:
        d = {}
        if not r.get("error"):
            d["peak_change_pct"] = _pct(r["peak_bytes"], base["peak_bytes"])
            d["activation_change_pct"] = _pct(r["activation_bytes"], base["activation_bytes"])
            d["step_time"] = _step_time(r, timer)
            rel = _relative(r, timer)
            if rel is not None and base_rel:
                d["overhead_pct"] = 100.0 * (rel / base_rel - 1.0)
                d["overhead_basis"] = "paired"
                d["overhead_spread_pct"] = _spread_pct(r, base, timer, rel, base_rel)
                # the row's own share of that spread: what two rows' overheads, over the same
                # baseline, differ by uncertainly (the baseline's term is common to both)
                own = r.get(_spread_key(timer))
                d["own_spread_pct"] = None if own is None else 100.0 * own / base_rel
            else:
                d["overhead_pct"] = _pct(d["step_time"], base_time if r.get("world", 1) == 1 else base["step_time"])
                d["overhead_basis"] = "medians"
            d["loss_rel_diff"] = (r["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
            d["loss_ratio"] = r["final_loss"] / base["final_loss"] if base["final_loss"] else None
            s = r.get("search") or {}
            if s.get("kind") == "model" and s.get("largest_params"):
                d["largest_model_params"] = s["largest_params"]
                d["largest_model_ratio"] = s["largest_params"] / base["params"]
            if s.get("kind") == "batch" and s.get("largest") is not None:
                d["max_batch"] = s["largest"]
                d["max_batch_ratio"] = s["largest"] / base["search"]["largest"] if base.get("search") else None
            if s.get("kind") == "layers" and s.get("largest_params"):
                d["largest_model_params"] = s["largest_params"]
                d["largest_model_ratio"] = s["largest_params"] / base["params"]
        d["timer"] = "wall" if r.get("world", 1) > 1 else timer
        r["derived"] = d
    return rows


def _fmt_pct(v, plus=True) -> str:
    if v is None:
        return "—"
    return f"{v:+.0f}%" if plus else f"{v:.0f}%"


def _overhead_cell(d: dict) -> str:
    """The overhead, with the spread of its paired steps where there is one: ``+17% ±3``."""
    text = _fmt_pct(d.get("overhead_pct"))
    spread = d.get("overhead_spread_pct")
    return f"{text} ±{spread:.0f}" if spread is not None and d.get("overhead_pct") is not None else text


def _fmt_count(n) -> str:
    if n is None:
        return "—"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.0f}K"
    return str(n)


def _loss(r: dict, base: dict) -> str:
    rel = r["derived"]["loss_rel_diff"]
    tag = "exact" if rel == 0 else f"{rel:+.1e}"
    return f"{r['final_loss']:.4f} ({tag})"


def _cells(r: dict, base: dict) -> list[str]:
    d = r["derived"]
    label = r["label"] + (" [per rank]" if r.get("world", 1) > 1 else "")
    if r.get("error"):
        return [label, "infeasible" if r.get("infeasible") else "failed"] + [""] * 8
    search = r.get("search") or {}
    if search.get("kind") == "batch" and d.get("max_batch") is not None:
        approx = "" if search.get("exact") else ">="
        fit = f"{approx}{d['max_batch']} ({d['max_batch_ratio']:.1f}x)"
    else:
        fit = "—"
    if d.get("largest_model_params"):
        approx = "" if search.get("exact") else ">="
        model = f"{approx}{_fmt_count(d['largest_model_params'])} ({d['largest_model_ratio']:.1f}x)"
    else:
        model = "—"
    time_mark = "†" if d["timer"] != base["derived"]["timer"] else ""
    return [
        label,
        f"{r['peak_bytes'] / MiB:.1f}",
        _fmt_pct(d["peak_change_pct"]) if r is not base else "—",
        f"{r['activation_bytes'] / MiB:.1f}",
        _fmt_pct(d["activation_change_pct"]) if r is not base else "—",
        f"{1e3 * d['step_time']:.0f}{time_mark}" if d["step_time"] is not None else "—",
        _overhead_cell(d) if r is not base else "—",
        _loss(r, base),
        fit,
        f"{_fmt_count(r['params_per_rank'])} / {model}" if r.get("world", 1) > 1 else "—",
    ]


HEADERS = [
    "strategy",
    "peak MiB",
    "vs base",
    "act MiB",
    "vs base",
    "step ms",
    "overhead",
    "final loss (rel. diff)",
    "largest batch in base peak",
    "params/rank / largest model/rank",
]


# The model-state preset's table: what each row keeps a parameter, and the largest model, not batch.
FINETUNE_HEADERS = [
    "strategy",
    "peak MiB",
    "vs base",
    "state B/param",
    "act MiB",
    "step ms",
    "overhead",
    "final loss",
    "loss ratio",
    "largest model in base peak",
]


# The LM-head preset's table: the loss beside the baseline's as a ratio too (the fused head's must be 1).
VOCAB_HEADERS = [
    "strategy",
    "peak MiB",
    "vs base",
    "act MiB",
    "vs base",
    "step ms",
    "overhead",
    "final loss (rel. diff)",
    "loss ratio",
    "largest batch in base peak",
]


def is_finetune(rows: list[dict]) -> bool:
    """Whether ``rows`` are the model-state preset's (their largest-fit search is of the model)."""
    base = next((r for r in rows if r["key"] == "baseline"), {})
    return (base.get("search") or {}).get("kind") == "model"


def preset_family(rows: list[dict]) -> str:
    """``"finetune"``, ``"vocab"``, ``"compile"`` or ``"default"``: which preset's rows ``rows`` are."""
    if is_finetune(rows):
        return "finetune"
    base = next((r for r in rows if r["key"] == "baseline"), {})
    preset = str(base.get("preset") or "")
    for family in ("vocab", "compile"):
        if preset.startswith(family):
            return family
    return "default"


def logits_bytes(row: dict) -> int:
    """Bytes of the plain head's fp32 logits in ``row``'s step: tokens x vocabulary x 4."""
    return 4 * row["batch"] * row["model"]["seq_len"] * row["model"]["vocab_size"]


def _least_budget(r: dict) -> str | None:
    """An infeasible plan row's least budget, and its share of the activation peak without
    checkpointing, as the planner measured them; None when not recorded."""
    plan = r.get("plan") or {}
    least, whole = plan.get("least_budget_bytes"), plan.get("no_checkpoint_peak_bytes")
    if not least:
        return None
    return format_bytes(least) + (f", {100 * least / whole:.0f}% of {format_bytes(whole)}" if whole else "")


def _vocab_cells(r: dict, base: dict) -> list[str]:
    if r.get("error"):  # why: on a line of its own under the table, not widening a column
        return [r["label"], "infeasible" if r.get("infeasible") else "failed"] + [""] * 8
    cells = _cells(r, base)
    ratio = r["derived"].get("loss_ratio")
    return cells[:8] + [f"{ratio:.6f}" if ratio is not None else "—", cells[8]]


# The compiled preset's table: each row's checkpointing budget, and how far its loss strays from the
# eager baseline's at any step (compiled code reorders fp32 arithmetic).
COMPILE_HEADERS = [
    "strategy",
    "peak MiB",
    "vs base",
    "act MiB",
    "vs base",
    "budget",
    "step ms",
    "overhead",
    "final loss (rel. diff)",
    "worst step rel. diff",
]


def worst_loss_diff(r: dict, base: dict) -> float | None:
    """The largest relative difference between ``r``'s loss and ``base``'s over their steps; None
    when their step counts differ or a row has no losses."""
    a, b = r.get("losses") or [], base.get("losses") or []
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _budget_cell(r: dict) -> str:
    s, plan = r["strategy"], r.get("plan") or {}
    if s["checkpoint"] == "torch-budget":
        return f"{s['budget_fraction']:.2f} (torch)"
    if s["checkpoint"] in ("plan", "auto") and plan.get("budget_bytes"):
        return f"{s['budget_fraction']:.2f} = {plan['budget_bytes'] / MiB:.2f} MiB"
    return "—"


def _compile_cells(r: dict, base: dict) -> list[str]:
    if r.get("error"):
        return [r["label"], "infeasible" if r.get("infeasible") else "failed"] + [""] * 8
    cells = _cells(r, base)
    worst = worst_loss_diff(r, base)
    return cells[:5] + [_budget_cell(r)] + cells[5:8] + ["—" if worst is None else f"{worst:.1e}"]


def _finetune_cells(r: dict, base: dict) -> list[str]:
    d = r["derived"]
    if r.get("error"):
        return [r["label"], "infeasible" if r.get("infeasible") else "failed"] + [""] * 8
    s = r.get("search") or {}
    if d.get("largest_model_params"):
        approx = "" if s.get("exact") else ">="
        model = (
            f"{approx}{_fmt_count(d['largest_model_params'])} ({d['largest_model_ratio']:.2f}x, {s['largest']} layers)"
        )
    else:
        model = "—"
    ratio = d.get("loss_ratio")
    return [
        r["label"],
        f"{r['peak_bytes'] / MiB:.1f}",
        _fmt_pct(d["peak_change_pct"]) if r is not base else "—",
        f"{r['state_bytes_per_param']:.2f}" if r.get("state_bytes_per_param") is not None else "—",
        f"{r['activation_bytes'] / MiB:.1f}",
        f"{1e3 * d['step_time']:.0f}" if d["step_time"] is not None else "—",
        _overhead_cell(d) if r is not base else "—",
        f"{r['final_loss']:.4f}",
        f"{ratio:.4f}" if ratio is not None else "—",
        model,
    ]


def _rows(rows):
    base = next(r for r in rows if r["key"] == "baseline")
    family = preset_family(rows)
    if family == "finetune":
        return FINETUNE_HEADERS, [_finetune_cells(r, base) for r in rows]
    if family == "vocab":
        return VOCAB_HEADERS, [_vocab_cells(r, base) for r in rows]
    if family == "compile":
        return COMPILE_HEADERS, [_compile_cells(r, base) for r in rows]
    return HEADERS, [_cells(r, base) for r in rows]


def table(rows: list[dict]) -> str:
    """The results as aligned text."""
    headers, cells = _rows(rows)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    right = {1, 2, 3, 4, 5, 6} | (
        {7, 8}
        if headers is FINETUNE_HEADERS
        else {8}
        if headers is VOCAB_HEADERS
        else {7, 9}
        if headers is COMPILE_HEADERS
        else set()
    )

    def line(values):
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths)))

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    out += [f"{r['label']}: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    """The results as a Markdown table (for the README), and under it the least budget of each
    infeasible plan row."""
    headers, cells = _rows(rows)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    least = [(r["label"], _least_budget(r)) for r in rows if r.get("error") and r.get("infeasible")]
    notes = [f"{label}: infeasible, least budget {budget}." for label, budget in least if budget]
    return "\n".join(out + ([""] + notes if notes else []))


def headline(rows: list[dict]) -> str | None:
    """The model-state preset's answer: the largest model that fits in the baseline's peak, with how
    it was found (the fitted line) and how it was verified (its run); the LM-head preset's: what the
    fused head saves against the logits' bytes, and what the planner does with and without it; None
    for other rows."""
    if preset_family(rows) == "vocab":
        return _vocab_headline(rows)
    if not is_finetune(rows):
        return None
    base = next(r for r in rows if r["key"] == "baseline")
    found = [r for r in rows if not r.get("error") and (r.get("derived") or {}).get("largest_model_params")]
    if not found:
        return "largest model in the baseline's peak: no row found one"
    best = max(found, key=lambda r: r["derived"]["largest_model_params"])
    s, d = best["search"], best["derived"]
    fit = s["fit"]
    points = " and ".join(str(n) for n, _ in sorted(fit["points"]))
    over = next((n for n, p in s["trials"] if n == s["largest"] + 1), None)
    fixed = ("-" if fit["fixed_bytes"] < 0 else "") + format_bytes(abs(fit["fixed_bytes"]))
    beyond = f"; {over} layers measured over it" if over is not None else " (the next size was not run: a lower bound)"
    return (
        f"largest model in the baseline's peak ({format_bytes(s['cap_bytes'])}): {best['label']}, "
        f"{_fmt_count(d['largest_model_params'])} parameters in {s['largest']} layers, "
        f"{d['largest_model_ratio']:.2f}x the baseline's {_fmt_count(base['params'])}. Predicted by "
        f"peak = a*params + b through its peaks at {points} layers (a = {fit['bytes_per_param']:.2f} B a "
        f"parameter, activations included; b = {fixed}): "
        f"{_fmt_count(s['predicted_params'])} parameters ({s['predicted_layers']} layers); verified by running "
        f"it: peak {format_bytes(s['largest_peak_bytes'])}{beyond}."
    )


def _vocab_headline(rows: list[dict]) -> str:
    by = {r["key"]: r for r in rows}
    base = by["baseline"]
    logits = logits_bytes(base)
    tokens = base["batch"] * base["model"]["seq_len"]
    parts = [
        f"the LM head: {tokens} tokens x {base['model']['vocab_size']} = {format_bytes(logits)} of fp32 logits; "
        f"the plain head's step peaks at {format_bytes(base['peak_bytes'])}"
    ]
    fused = by.get("fused")
    if fused and not fused.get("error"):
        saved = base["peak_bytes"] - fused["peak_bytes"]
        parts.append(
            f"the fused head's at {format_bytes(fused['peak_bytes'])}, {format_bytes(saved)} lower "
            f"({saved / logits:.2f}x the logits)"
        )
    plan = by.get("plan-50")
    if plan and plan.get("infeasible"):
        least = _least_budget(plan)
        parts.append(
            f"the planner alone finds no plan at 50%{f' (its least budget: {least})' if least else ''}: it "
            "recomputes blocks, and the head is not one"
        )
    elif plan and not plan.get("error"):
        parts.append(f"the planner alone at 50%: peak {format_bytes(plan['peak_bytes'])}")
    both = by.get("fused+plan-50")
    if both and not both.get("error"):
        d = both["derived"]
        approx = "" if (both.get("search") or {}).get("exact") else ">="  # as the table: a lower bound
        batch = (
            f", batch {approx}{d['max_batch']} in the baseline's peak ({d['max_batch_ratio']:.1f}x)"
            if d.get("max_batch")
            else ""
        )
        parts.append(
            f"patched first, then planned at 50%: peak {format_bytes(both['peak_bytes'])} "
            f"({_fmt_pct(d['peak_change_pct'])}){batch}"
        )
    return "; ".join(parts) + "."


# ------------------------------------------------------------------------------------------------
# Targets (issue 17), each checked on ratios of this run


def _spread_text(row: dict) -> str:
    spread = row["derived"].get("overhead_spread_pct")
    return f" ±{spread:.1f}" if spread is not None else ""


def check_targets(rows: list[dict], *, wall_seconds: float | None = None, quick: bool = False) -> list[dict]:
    """``[{"target", "holds" (True/False/None when a row is missing), "detail"}]``."""
    by = {r["key"]: r for r in rows if not r.get("error")}
    out = []

    def add(target, holds, detail):
        out.append({"target": target, "holds": holds, "detail": detail})

    base, torch_every = by.get("baseline"), by.get("torch-every")
    te_over = torch_every["derived"]["overhead_pct"] if torch_every else None
    cb = by.get("every+bf16")
    if cb and torch_every:
        act = -cb["derived"]["activation_change_pct"]
        over = cb["derived"]["overhead_pct"]
        add(
            "every-layer checkpoint + bf16: activation memory -82% or more, overhead below torch every-layer's",
            act >= 82.0 and over < te_over,
            f"activation -{act:.1f}%, overhead {over:+.1f}%{_spread_text(cb)} vs torch every-layer "
            f"{te_over:+.1f}%{_spread_text(torch_every)}",
        )
    else:
        add("every-layer checkpoint + bf16 vs torch every-layer", None, "rows every+bf16 / torch-every not run")
    p50 = by.get("plan-50")
    p50_row = next((r for r in rows if r["key"] == "plan-50"), None)
    if p50_row is not None and p50_row.get("infeasible"):
        add("llmmem plan at 50%", False, p50_row["error"])
    elif p50 and torch_every:
        over = p50["derived"]["overhead_pct"]
        budget = p50["plan"]["budget_bytes"]
        within = p50["activation_bytes"] <= budget
        add(
            "llmmem plan at 50%: overhead at most half of torch every-layer's; measured peak within budget + model state",
            over <= te_over / 2 and within,
            f"overhead {over:+.1f}%{_spread_text(p50)} vs half of {te_over:+.1f}%{_spread_text(torch_every)} = "
            f"{te_over / 2:+.1f}%; activation peak "
            f"{format_bytes(p50['activation_bytes'])} vs budget {format_bytes(budget)} "
            f"(peak {format_bytes(p50['peak_bytes'])} vs budget + state {format_bytes(budget + p50['start_bytes'])})",
        )
    else:
        add("llmmem plan at 50%", None, "rows plan-50 / torch-every not run")
    add(*_plans_against_uniform(by))
    singles = [r for r in by.values() if _single(r) and r["derived"].get("max_batch")]
    llmmem_rows = [
        r
        for r in singles
        if r["strategy"]["checkpoint"] in ("every", "selective", "plan", "offload") or r["strategy"]["amp"] == "fp16"
    ]
    if base and llmmem_rows:
        best = max(llmmem_rows, key=lambda r: r["derived"]["max_batch"])
        ratio = best["derived"]["max_batch_ratio"]
        add(
            "best single-process llmmem strategy trains a batch >= 4x the baseline's in the baseline's peak",
            ratio >= 4.0,
            f"{best['label']}: batch {best['derived']['max_batch']} vs {base['search']['largest']} ({ratio:.1f}x)",
        )
    else:
        add("largest batch >= 4x", None, "no llmmem single-process row with a batch search")
    tz = by.get("tp2xdp2+zero1")
    if tz and tz["derived"].get("largest_model_ratio"):
        ratio = tz["derived"]["largest_model_ratio"]
        add(
            "TP 2 x ZeRO-1 over 2 DP ranks fits >= 3.2x the parameters per rank",
            ratio >= 3.2,
            f"largest model per rank {_fmt_count(tz['derived']['largest_model_params'])} parameters vs the "
            f"baseline's {_fmt_count(base['params'])} ({ratio:.2f}x)",
        )
    else:
        add("TP 2 x ZeRO-1 fits >= 3.2x parameters", None, "row tp2xdp2+zero1 not run")
    for key in ("zero3", "tp2xzero3"):
        add(*_sharded_state_target(by.get(key), base, key))
    if wall_seconds is not None:
        limit = 90 if quick else 300
        add(
            f"{'compare --quick' if quick else 'compare'} finishes in under {limit} s",
            wall_seconds < limit,
            f"{wall_seconds:.0f} s on this machine",
        )
    return out


# A uniform plan "at equal memory" may hold this much more activation memory than the plan it is
# compared with: two plans that keep the same tensors measure a few KiB apart (allocation order).
SAME_MEMORY = 1.01


def _single(r: dict) -> bool:
    return r["strategy"]["tp"] * r["strategy"]["dp"] == 1


def _difference_spread(a: dict, b: dict) -> float | None:
    """Points by which the overheads of rows ``a`` and ``b`` may differ by chance: their own spreads
    combined in quadrature; None when either has too few pairs for one (``--quick``)."""
    sa, sb = a["derived"].get("own_spread_pct"), b["derived"].get("own_spread_pct")
    return None if sa is None or sb is None else math.hypot(sa, sb)


def _plans_against_uniform(by: dict) -> tuple:
    """The planner never runs a plan that a uniform one (every layer checkpointed by llmmem or torch,
    selective on every layer) beats at equal or lower activation memory, in this run's measurements:
    each plan row's overhead is at most that of each single-process uniform row with the same
    precision that needed no more memory, within the two rows' own spreads combined in quadrature."""
    plans = [r for r in by.values() if r["strategy"]["checkpoint"] == "plan" and _single(r)]
    uniform = [r for r in by.values() if r["strategy"]["checkpoint"] in ("torch", "every", "selective") and _single(r)]
    target = "no uniform plan beats the planner's at equal or lower activation memory (measured, within the spread)"
    pairs, beaten, undecided = [], [], []
    for p in plans:
        for u in uniform:
            if (
                u["strategy"]["amp"] != p["strategy"]["amp"]
                or u["activation_bytes"] > SAME_MEMORY * p["activation_bytes"]
            ):
                continue
            po, uo = p["derived"].get("overhead_pct"), u["derived"].get("overhead_pct")
            if po is None or uo is None:
                continue
            spread = _difference_spread(p, u)
            text = (
                f"{p['key']} {po:+.1f}% at {format_bytes(p['activation_bytes'])} vs {u['key']} {uo:+.1f}% at "
                f"{format_bytes(u['activation_bytes'])}"
            )
            if spread is None:
                undecided.append(text + " (too few pairs to tell)")
                continue
            text += f" (spread {spread:.1f})"
            pairs.append(text)
            if po > uo + spread:
                beaten.append(text)
    if not plans:
        return target, None, "no single-process plan row run"
    if beaten:
        return target, False, "; ".join(beaten)
    if undecided and not pairs:
        return target, None, "; ".join(undecided)
    if not pairs:
        return target, True, "no uniform row needed as little activation memory as a plan row"
    return target, True, "; ".join(pairs + undecided)


def _sharded_state_target(r: dict | None, base: dict | None, key: str) -> tuple:
    """A ZeRO-3 row: the baseline's loss to 1e-5, and each rank's parameters, gradients and optimizer
    state at most 1/world of the baseline's + 5%."""
    if not r or not base or not r.get("state_bytes") or not base.get("state_bytes"):
        return f"{key}: loss and model state per rank", None, f"row {key} or its baseline not run"
    world = r["world"]
    limit = 1.0 / world + 0.05
    ranks = [p["state_bytes"] for p in r.get("per_rank") or [r] if p.get("state_bytes")]
    if not ranks:
        return f"{key}: loss and model state per rank", None, f"row {key} has no model-state figures"
    whole = sum(base["state_bytes"].values())
    worst = max(sum(b.values()) for b in ranks) / whole if whole else float("inf")
    rel = abs(r["derived"]["loss_rel_diff"])
    return (
        f"{r['label']}: final loss within 1e-5 of the baseline's, model state per rank <= 1/{world} + 5% of it",
        rel <= 1e-5 and worst <= limit,
        f"loss {r['final_loss']:.6f} vs {base['final_loss']:.6f} ({rel:.1e}); the fullest rank holds "
        f"{worst:.3f} of the baseline's {format_bytes(whole)} of parameters, gradients and optimizer state "
        f"(limit {limit:.3f})",
    )


def check_finetune_targets(rows: list[dict], *, wall_seconds: float | None = None) -> list[dict]:
    """The model-state preset's targets (issue 23), on this run's rows: ``[{"target", "holds",
    "detail"}]`` as :func:`check_targets`."""
    by = {r["key"]: r for r in rows if not r.get("error")}
    base = by.get("baseline")
    out = []

    def add(target, holds, detail):
        out.append({"target": target, "holds": holds, "detail": detail})

    for key, limit, what in (("int8-state", 0.02, "int8 state"), ("bf16-weights", 0.10, "bf16 weights + SR")):
        r = by.get(key)
        target = f"{what}: final loss within {limit:.0%} of the fp32 baseline's"
        if r and base:
            ratio = r["derived"]["loss_ratio"]
            add(target, abs(ratio - 1.0) <= limit, f"{r['final_loss']:.4f} vs {base['final_loss']:.4f} ({ratio:.4f}x)")
        else:
            add(target, None, f"row {key} not run")
    sib = by.get("step-in-backward")
    target = "step in backward: peak lower by >= 0.9 x the gradients' bytes"
    if sib and base:
        grads = 4 * base["params"]  # fp32 gradients, one a parameter
        saved = base["peak_bytes"] - sib["peak_bytes"]
        add(target, saved >= 0.9 * grads, f"{format_bytes(saved)} lower, gradients {format_bytes(grads)}")
    else:
        add(target, None, "row step-in-backward not run")
    target = "the largest model in the baseline's peak is verified by running it"
    found = [r for r in by.values() if r["derived"].get("largest_model_params")]
    if found:
        best = max(found, key=lambda r: r["derived"]["largest_model_params"])
        s = best["search"]
        ok = s.get("largest_peak_bytes") is not None and s["largest_peak_bytes"] <= s["cap_bytes"]
        add(
            target,
            ok and s.get("exact", False),
            f"{best['key']}: {s['largest']} layers peak at {format_bytes(s['largest_peak_bytes'])}, cap "
            f"{format_bytes(s['cap_bytes'])}" + ("" if s.get("exact") else "; the next size was not measured"),
        )
    else:
        add(target, None, "no row found a largest model")
    if wall_seconds is not None:
        slow = max((r.get("wall_seconds") or 0.0 for r in rows), default=0.0)
        add("every row of the preset finishes in under 60 s", slow < 60.0, f"the slowest took {slow:.0f} s")
    return out


def check_vocab_targets(rows: list[dict], *, wall_seconds: float | None = None, quick: bool = False) -> list[dict]:
    """The LM-head preset's targets (issue 24), on this run's rows: ``[{"target", "holds",
    "detail"}]`` as :func:`check_targets`."""
    by = {r["key"]: r for r in rows if not r.get("error")}
    base, fused = by.get("baseline"), by.get("fused")
    out = []

    def add(target, holds, detail):
        out.append({"target": target, "holds": holds, "detail": detail})

    target = "fused head: the step's peak lower by >= 1.5x the logits' bytes"
    if base and fused:
        logits = logits_bytes(base)
        saved = base["peak_bytes"] - fused["peak_bytes"]
        add(
            target,
            saved >= 1.5 * logits,
            f"{format_bytes(base['peak_bytes'])} -> {format_bytes(fused['peak_bytes'])}: {format_bytes(saved)} lower, "
            f"{saved / logits:.2f}x the logits' {format_bytes(logits)}",
        )
    else:
        add(target, None, "row fused not run")
    target = "fused head: the loss equal to the plain head's (fp32: relative difference <= 1e-5 at every step)"
    if base and fused:
        diffs = [abs(a - b) / abs(b) for a, b in zip(fused["losses"], base["losses"])]
        worst = max(diffs)
        add(
            target,
            worst <= 1e-5 and len(diffs) == len(base["losses"]),
            f"final {fused['final_loss']:.6f} vs {base['final_loss']:.6f}; largest relative difference over the "
            f"{len(diffs)} steps {worst:.1e}",
        )
    else:
        add(target, None, "row fused not run")
    target = "fused head + plan 50%: the activation peak within the plan's budget"
    both = by.get("fused+plan-50")
    both_row = next((r for r in rows if r["key"] == "fused+plan-50"), None)
    if both_row is not None and both_row.get("infeasible"):
        add(target, False, both_row["error"])
    elif both:
        budget = both["plan"]["budget_bytes"]
        add(
            target,
            both["activation_bytes"] <= budget,
            f"activation peak {format_bytes(both['activation_bytes'])} vs budget {format_bytes(budget)} "
            f"(half of {format_bytes(2 * budget)})",
        )
    else:
        add(target, None, "row fused+plan-50 not run")
    if wall_seconds is not None:
        limit = 30 if quick else 60
        add(
            f"compare --preset vocab{' --quick' if quick else ''} finishes in under {limit} s",
            wall_seconds < limit,
            f"{wall_seconds:.0f} s on this machine",
        )
    return out


def _row_state(rows: list[dict], key: str) -> tuple[dict | None, str | None]:
    """``(row, None)`` for a measured row; ``(None, why)`` for one that failed, was infeasible or
    was not run."""
    row = next((r for r in rows if r["key"] == key), None)
    if row is None:
        return None, f"row {key} not run"
    if row.get("error"):
        return None, f"row {key} {'infeasible' if row.get('infeasible') else 'failed'}: {row['error']}"
    return row, None


def _step_cost(r: dict) -> tuple[float | None, str]:
    """A row's step time as the targets compare it: its overhead over the eager baseline (paired
    with the reference where it was, so that the load of a shared machine cancels; else from the
    medians), in points."""
    over = r["derived"].get("overhead_pct")
    return over, "—" if over is None else f"overhead {over:+.1f}%{_spread_text(r)}"


def check_compile_targets(rows: list[dict], *, wall_seconds: float | None = None, quick: bool = False) -> list[dict]:
    """The compiled preset's targets (issue 25), on this run's rows: ``[{"target", "holds",
    "detail"}]`` as :func:`check_targets`. At each fraction, llmmem's plan under compile against its
    own budget and against torch's compile-time planner (``activation_memory_budget``) at the same
    fraction, in peak and in step time; and every compiled row's loss against the eager baseline's.
    ``wall_seconds`` and ``quick`` are accepted as by the other presets' checks: no target of this
    preset is about the run's time."""
    out = []

    def add(target, holds, detail):
        out.append({"target": target, "holds": holds, "detail": detail})

    base, why = _row_state(rows, "baseline")
    compiled = [r for r in rows if r.get("strategy", {}).get("compile")]
    target = (
        f"compiled rows: the loss at every step within {COMPILE_LOSS_TOLERANCE:.0e} (relative) of the eager baseline's"
    )
    if base is None or not compiled:
        add(target, None, why or "no compiled row run")
    else:
        parts, holds = [], True
        for r in compiled:
            if r.get("error"):
                parts.append(f"{r['key']} {'infeasible' if r.get('infeasible') else 'failed'}")
                holds = holds if r.get("infeasible") else False
                continue
            worst = worst_loss_diff(r, base)
            parts.append(f"{r['key']} {'—' if worst is None else f'{worst:.1e}'}")
            holds = holds and worst is not None and worst <= COMPILE_LOSS_TOLERANCE
        add(target, holds, "worst per row: " + ", ".join(parts))
    for pct in (50, 25):
        plan_key, amb_key = f"compile+plan-{pct}", f"compile+amb-{pct}"
        plan_row = next((r for r in rows if r["key"] == plan_key), None)
        plan, plan_why = _row_state(rows, plan_key)
        amb, amb_why = _row_state(rows, amb_key)
        name = f"compile + llmmem plan {pct}%"
        target = f"{name}: measured activation peak within the plan's budget"
        if plan_row is not None and plan_row.get("infeasible"):
            add(target, False, plan_row["error"])
        elif plan is None:
            add(target, None, plan_why)
        else:
            budget = plan["plan"]["budget_bytes"]
            add(
                target,
                plan["activation_bytes"] <= budget,
                f"activation peak {format_bytes(plan['activation_bytes'])} vs budget {format_bytes(budget)} "
                f"({pct}% of the eager activation peak the planner profiled)"
                + (
                    f"; under compile, {plan['plan']['compile_changes']}"
                    if plan["plan"].get("compile_changes")
                    else ""
                ),
            )
        target = f"{name}: peak <= compile + activation_memory_budget {pct / 100:.2f}'s"
        if plan is None or amb is None:
            add(target, False if plan_row is not None and plan_row.get("infeasible") else None, plan_why or amb_why)
        else:
            add(
                target,
                plan["peak_bytes"] <= amb["peak_bytes"],
                f"{format_bytes(plan['peak_bytes'])} vs {format_bytes(amb['peak_bytes'])} "
                f"(activations {format_bytes(plan['activation_bytes'])} vs {format_bytes(amb['activation_bytes'])})",
            )
        target = f"{name}: step time <= compile + activation_memory_budget {pct / 100:.2f}'s"
        if plan is None or amb is None:
            add(target, False if plan_row is not None and plan_row.get("infeasible") else None, plan_why or amb_why)
        else:
            (pc, pt), (ac, at) = _step_cost(plan), _step_cost(amb)
            paired = all(r["derived"].get("overhead_basis") == "paired" for r in (plan, amb))
            spread = _difference_spread(plan, amb)
            if paired and spread is None:  # --quick: a verdict on two pairs would be noise
                add(target, None, f"{pt} vs {at} (too few pairs to tell)")
                continue
            spread = spread or 0.0
            holds = None if pc is None or ac is None else pc <= ac + spread
            add(
                target,
                holds,
                f"{pt} vs {at}" + (f" (the two rows' spreads allow {spread:.1f} points)" if spread else ""),
            )
    return out


def check_preset_targets(rows: list[dict], *, wall_seconds: float | None = None, quick: bool = False) -> list[dict]:
    """The targets of the preset whose rows ``rows`` are (:func:`preset_family`)."""
    family = preset_family(rows)
    if family == "compile":
        return check_compile_targets(rows, wall_seconds=wall_seconds, quick=quick)
    if family == "finetune":
        return check_finetune_targets(rows, wall_seconds=wall_seconds)
    if family == "vocab":
        return check_vocab_targets(rows, wall_seconds=wall_seconds, quick=quick)
    return check_targets(rows, wall_seconds=wall_seconds, quick=quick)


def format_targets(targets: list[dict]) -> str:
    mark = {True: "holds", False: "FAILS", None: "n/a"}
    return "\n".join(f"  [{mark[t['holds']]:>5}] {t['target']}: {t['detail']}" for t in targets)


# ------------------------------------------------------------------------------------------------
# Charts


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde6cf", "optimizer": "#dff2dc"}


def plot_timelines(rows: list[dict], path: str, *, title: str = "") -> None:
    """Small multiples: live bytes over the measured training step of each strategy (the baseline in
    grey behind each), the phases shaded."""
    plt = _pyplot()
    rows = [r for r in rows if not r.get("error") and r.get("timeline")]
    base = next((r for r in rows if r["key"] == "baseline"), None)
    n = len(rows)
    cols = 4 if n > 6 else max(1, min(n, 3))
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.9 * nrows), sharey=True, squeeze=False)
    ymax = max(max(b for _, b in r["timeline"]) for r in rows) / MiB * 1.12

    def fraction(row):
        # time as a fraction of the step: the shapes line up whatever each step's speed under the tracker
        total = row["phases"].get("optimizer") or max(p[0] for p in row["timeline"]) or 1.0
        return [p[0] / total for p in row["timeline"]], total

    for ax, r in zip(axes.flat, rows):
        t, total = fraction(r)
        b = [p[1] / MiB for p in r["timeline"]]
        start = 0.0
        for phase in ("forward", "backward", "optimizer"):
            end = r["phases"].get(phase, 0.0) / total
            ax.axvspan(start, end, color=PHASE_COLORS[phase], lw=0)
            start = end
        if base is not None and r is not base:
            ax.plot(
                fraction(base)[0], [p[1] / MiB for p in base["timeline"]], color="0.6", lw=1, label="fp32 baseline"
            )
        ax.plot(t, b, color="#c0392b" if r is not base else "0.2", lw=1.4, label=r["key"])
        peak = max(b)
        ax.axhline(peak, color="#c0392b" if r is not base else "0.2", lw=0.6, ls=":")
        per_rank = " (rank 0)" if r.get("world", 1) > 1 else ""
        ax.set_title(f"{r['label']}{per_rank}\npeak {peak:.1f} MiB", fontsize=9)
        ax.set_ylim(0, ymax)
        ax.set_xlim(0, 1.0)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3, lw=0.5)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("live tensor MiB", fontsize=8)
    for i, ax in enumerate(axes.flat[:n]):
        if i + cols >= n:  # the lowest panel of its column
            ax.set_xlabel("fraction of the step's time", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    handles += [plt.Line2D([], [], color="0.6"), plt.Line2D([], [], color="#c0392b")]
    fig.legend(
        handles,
        ["forward", "backward", "optimizer step", "fp32 baseline", "strategy"],
        loc="lower center",
        ncol=5,
        fontsize=9,
        frameon=False,
    )
    fig.suptitle(title or "Memory over one training step", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_tradeoff(rows: list[dict], path: str, *, title: str = "") -> None:
    """Activation memory saved (%) against step-time overhead (%), one point per strategy (for the
    model-state preset, the peak saved: activations are not what its rows change)."""
    what = "peak_change_pct" if is_finetune(rows) else "activation_change_pct"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 6))
    marks = []
    for r in rows:
        d = r.get("derived") or {}
        if r.get("error") or r["key"] == "baseline" or d.get("overhead_pct") is None:
            continue
        parallel = r.get("world", 1) > 1
        st = r["strategy"]
        llm = (
            st["checkpoint"] in ("every", "selective", "plan", "offload", "auto")
            or st["amp"] == "fp16"
            or st.get("optim", "torch") != "torch"
            or st.get("step_in_backward")
            or st.get("fused_head")
        )
        color = "#2471a3" if parallel else ("#c0392b" if llm else "#7f8c8d")
        marks.append((d["overhead_pct"], -d[what], r["key"], parallel, color))
    # One far outlier (fp16 emulated on a CPU) would squeeze every other point into a corner: the
    # axis stops past the others and the outlier sits on its edge, its value in its label.
    xs = sorted(m[0] for m in marks)
    edge = None
    if len(xs) >= 3 and xs[-2] > 0 and xs[-1] > 2.5 * xs[-2]:
        edge = xs[-2] * 1.35 + 15
    points = []
    for x, y, key, parallel, color in marks:
        label = key + (" (per rank)" if parallel else "")
        if edge is not None and x > edge:
            label += f" ({x:+.0f}%) →"
            x = edge
        ax.scatter(x, y, s=55, color=color, marker="s" if parallel else "o", zorder=3)
        points.append((x, y, label))
    if edge is not None:
        ax.set_xlim(right=edge * 1.04)
    ax.set_ylim(min(-5, ax.get_ylim()[0]), 100)
    fig.canvas.draw()
    # Each label goes to the first of a few spots around its point where it overlaps no other label
    # or point (boxes estimated in pixels), with a leader line when it had to move away.
    char_w, line_h = 6.2, 12.0
    boxes = [(px - 5, py - 5, px + 5, py + 5) for px, py in (ax.transData.transform((x, y)) for x, y, _ in points)]
    spots = [(6, 3), (6, -13), (-6, 3), (-6, -13), (6, 15), (6, -25), (-6, 15), (-6, -25), (6, 27), (6, -37)]
    for x, y, text in sorted(points, key=lambda p: (-p[1], p[0])):
        px, py = ax.transData.transform((x, y))
        w = char_w * len(text)
        for dx, dy in spots:
            x0 = px + dx if dx > 0 else px + dx - w
            box = (x0, py + dy, x0 + w, py + dy + line_h)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
                break
        boxes.append(box)
        far = abs(dy) > 15
        ax.annotate(
            text,
            (x, y),
            textcoords="offset points",
            xytext=(dx * 72 / fig.dpi, dy * 72 / fig.dpi),
            ha="left" if dx > 0 else "right",
            fontsize=8,
            arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6) if far else None,
        )
    ax.axhline(0, color="0.5", lw=0.8)
    ax.axvline(0, color="0.5", lw=0.8)
    ax.set_xlabel("step-time overhead vs fp32 baseline (%)")
    ax.set_ylabel(("peak" if what == "peak_change_pct" else "activation") + " memory saved vs fp32 baseline (%)")
    ax.grid(alpha=0.3)
    handles = [
        plt.Line2D([], [], marker="o", ls="", color="#c0392b"),
        plt.Line2D([], [], marker="o", ls="", color="#7f8c8d"),
        plt.Line2D([], [], marker="s", ls="", color="#2471a3"),
    ]
    ax.legend(handles, ["llmmem", "torch only", "parallel (per rank)"], loc="lower right", fontsize=9)
    ax.set_title(title or "Memory saved against time overhead (up and left is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """``python -m llmmem.compare.report RESULTS.json [OUT_DIR]``: the table, the targets and the
    charts again from a run's results.json (nothing is re-run)."""
    import json
    import os
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print("usage: python -m llmmem.compare.report RESULTS.json [OUT_DIR]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        results = json.load(f)
    out = argv[1] if len(argv) == 2 else os.path.dirname(os.path.abspath(argv[0]))
    rows = derive(results["rows"], results.get("timer", "wall"))
    print(table(rows))
    line = headline(rows)
    if line:
        print(line)
    quick = str(results.get("preset", "")).endswith("quick")
    print(format_targets(check_preset_targets(rows, wall_seconds=results.get("wall_seconds"), quick=quick)))
    cfg = results.get("config", {})
    vocab = f", vocabulary {cfg.get('vocab_size')}" if preset_family(rows) == "vocab" else ""
    title = f"{results.get('machine', '')}: GPT {cfg.get('layers')}x{cfg.get('hidden')}{vocab}, seq {cfg.get('seq_len')}, batch {cfg.get('batch')}"
    if any(r.get("timeline") for r in rows):  # the compiled preset measures no timeline
        plot_timelines(rows, os.path.join(out, "memory_timeline.png"), title=title)
    plot_tradeoff(rows, os.path.join(out, "saved_vs_overhead.png"), title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
