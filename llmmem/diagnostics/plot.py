"""The picture of a :class:`~llmmem.diagnostics.tracker.MemoryTracker`: live bytes over the events,
stacked by category, with the phases under it and the peak annotated. matplotlib's Agg canvas is
used directly, so no display is needed and pyplot's global state is left alone."""

from __future__ import annotations

__all__ = ["plot_tracker", "CATEGORY_COLORS", "PHASE_COLORS"]

CATEGORY_COLORS = {
    "parameters": "#4c72b0",
    "buffers": "#8c9fd1",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "inputs": "#937860",
    "activations": "#c44e52",
    "temporaries": "#f2a7b0",
    "other": "#b0b0b0",
}
PHASE_COLORS = {"forward": "#3b75af", "backward": "#ef8636", "recompute": "#9467bd", "optimizer": "#519e3e"}


def _scale(peak: int) -> tuple[float, str]:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= 2 * size:
            return float(size), unit
    return 1.0, "B"


def _reduce(xs: list, ys: dict, max_points: int) -> list[int]:
    n = len(xs)
    if n <= max_points:
        return list(range(n))
    totals = [sum(series[i] for series in ys.values()) for i in range(n)]
    per = n / max_points
    keep = []
    for k in range(max_points):
        lo, hi = int(k * per), min(n, int((k + 1) * per))
        if hi > lo:
            # the highest and the lowest point of each stretch, in order, so the outline stays true
            hi_i = max(range(lo, hi), key=totals.__getitem__)
            lo_i = min(range(lo, hi), key=totals.__getitem__)
            keep.extend(sorted({hi_i, lo_i}))
    return keep


def plot_tracker(tracker, path, *, device: str, title: str | None = None, max_points: int = 4000) -> None:
    """Writes ``tracker``'s timeline on ``device`` to the PNG ``path`` (see ``MemoryTracker.plot``)."""
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
        raise ValueError(f"MemoryTracker.plot: max_points must be an int >= 2, got {max_points!r}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("MemoryTracker.plot needs matplotlib (pip install matplotlib)") from exc

    xs, ys = tracker.timeline(device)
    # Start where the step starts: what the tracker counted on entry (the model's parameters...) is
    # the baseline, not a ramp of allocations.
    first = tracker.first_event or 0
    skip = next((i for i, x in enumerate(xs) if x >= first), len(xs))
    xs, ys = xs[skip:], {c: v[skip:] for c, v in ys.items()}
    keep = _reduce(xs, ys, max_points)
    x = [xs[i] for i in keep]
    cats = [c for c in ys if any(ys[c])]  # the tracker's category order
    peak = tracker.peak(device)
    top = max([peak["bytes"], tracker.budget or 0] if device == tracker.device else [peak["bytes"]])
    cuda = [s for s in tracker.cuda_samples if device == tracker.device]
    if cuda:
        top = max(top, max(s["reserved"] for s in cuda))
    div, unit = _scale(max(top, 1))

    fig = Figure(figsize=(12, 6.2), dpi=110)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 1, height_ratios=[14, 1], hspace=0.05)
    ax = fig.add_subplot(grid[0])
    bar = fig.add_subplot(grid[1], sharex=ax)

    if x:
        ax.stackplot(
            x,
            [[ys[c][i] / div for i in keep] for c in cats],
            labels=[c.replace("_", " ") for c in cats],
            colors=[CATEGORY_COLORS.get(c, "#777777") for c in cats],
            step="post",
            linewidth=0,
        )
    end = max(tracker.events, 1)
    for span in tracker.phases():
        color = PHASE_COLORS.get(span["phase"])
        if color is None:
            continue
        ax.axvspan(span["start"], span["end"], color=color, alpha=0.06, linewidth=0)
        bar.axvspan(span["start"], span["end"], color=color, alpha=0.85, linewidth=0)
        if span["end"] - span["start"] > 0.06 * (end - first):
            bar.text(
                (span["start"] + span["end"]) / 2,
                0.5,
                span["phase"] + (f" {span['step']}" if tracker.steps > 1 else ""),
                ha="center",
                va="center",
                fontsize=8,
                color="white",
            )
    if cuda:
        ax.step(
            [s["event"] for s in cuda],
            [s["reserved"] / div for s in cuda],
            where="post",
            color="black",
            linestyle=":",
            linewidth=1.2,
            label="CUDA reserved (sampled)",
        )
    if tracker.budget is not None and device == tracker.device:
        ax.axhline(tracker.budget / div, color="black", linestyle="--", linewidth=1, label="budget")
    if peak["event"] >= 0:
        where = peak["phase"] + (f", {peak['module']}" if peak["module"] else "")
        ax.axhline(peak["bytes"] / div, color="#444444", linewidth=0.6, alpha=0.6)
        ax.plot([peak["event"]], [peak["bytes"] / div], marker="v", color="black", markersize=7)
        near_right = peak["event"] > first + 0.6 * (end - first)
        ax.annotate(
            f"peak {peak['bytes'] / div:.3g} {unit}\n{where}",
            xy=(peak["event"], peak["bytes"] / div),
            xytext=(-12 if near_right else 12, 14),
            textcoords="offset points",
            ha="right" if near_right else "left",
            va="bottom",
            fontsize=9,
            bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#444444", "alpha": 0.9},
        )
    ax.set_xlim(first, end)
    ax.set_ylim(0, top / div * 1.18)
    ax.set_ylabel(f"live tensor bytes ({unit})")
    ax.grid(axis="y", alpha=0.3)
    ax.tick_params(labelbottom=False)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles[::-1],
        labels[::-1],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=9,
        frameon=False,
    )
    bar.set_yticks([])
    bar.set_xlabel("event (each storage made, grown or freed, in order)")
    rank = tracker.rank
    rank_text = f", rank {rank['rank']}/{rank['world_size']}" if rank else ""
    default = f"memory on {device}{rank_text}: {tracker.steps} step(s), peak {peak['bytes'] / div:.3g} {unit}"
    ax.set_title(title or default, fontsize=11)
    fig.subplots_adjust(left=0.07, right=0.80, top=0.93, bottom=0.09)
    fig.savefig(path)
