"""Memory-budgeted activation checkpointing: measure a chain of blocks, plan it in C, run the plan.

* :func:`profile_blocks` (and, for a whole model, :func:`llmmem.checkpointing.profile.profile_model`)
  measures per block and per mode the bytes autograd keeps for backward and the transient peaks of
  the forward and the backward, exactly, and the work, counted (see :mod:`llmmem.checkpointing.profile`).
* :func:`plan_checkpoints` hands those costs to the C planner (Rotor's dynamic program,
  csrc/checkpointing/) and returns a :class:`CheckpointPlan`: which blocks run normally, which selectively,
  which inside (nested) checkpointed regions; with its predicted peak, held bytes and time.
* :func:`llmmem.auto_checkpoint` does both and runs the plan.

Modes of a block: ``"store-all"`` (autograd keeps its tape), ``"selective"`` (keeps matmul and
attention outputs, recomputes the rest: :mod:`llmmem.checkpointing.selective`), ``"recompute-cheap"`` (keeps the
tape but rebuilds in backward the tensors one elementwise operator or a LayerNorm makes from kept
ones, such as GELU outputs and dropped-out attention probabilities: :mod:`llmmem.checkpointing.remat`), and,
from regions of one block, ``"store-input-only"``.

Budgets bound the **peak** of activation memory during a training step (what the step allocates
beyond the parameters, their gradients and the batch: kept tensors and every temporary of the
forward and the backward): bytes (``int``), a string (``"6GB"``, ``"512MiB"``), or a fraction
(``float`` in (0, 1], or a percent string such as ``"50%"`` or ``"12.5%"``) of that peak without
checkpointing (measured on a whole model; the planner's model of it for a chain of blocks).

With ``offload=True`` the planner may also keep the input of a top-level region in host memory
(``llmmem.checkpoint(offload=True)``): zero device bytes for that input between the region's forward
and its backward, at a transfer cost of ``bytes / host_bandwidth`` for the copy back (on the critical
path: these regions are not prefetched, so the memory model stays exact) plus whatever part of the
copy out is not hidden behind the region's own forward. That is what fits budgets below the
every-layer checkpointing minimum. The model is in csrc/include/llmmem/checkpointing.h.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field

import torch

from llmmem._native import native
from llmmem.checkpointing.blocks import as_block_list
from llmmem.checkpointing.modes import INPUT_ONLY
from llmmem.checkpointing.profile import ChainProfile, profile_blocks
from llmmem.checkpointing.timing import median_time
from llmmem.errors import InfeasibleError, user_stacklevel
from llmmem.units import format_bytes, parse_bytes

__all__ = [
    "plan_checkpoints",
    "parse_budget",
    "CheckpointPlan",
    "measure_host_bandwidth",
    "DEFAULT_HOST_BANDWIDTH",
    "DEFAULT_SLOTS",
]

DEFAULT_SLOTS = None  # 2000 for identical blocks or short chains (cheap), else 500
# Bytes per second of a host<->device copy when none is measured: a PCIe 4.0 x16 link moves about
# 25 GB/s of pinned memory in practice (the theoretical 32 GB/s less protocol overhead). On the CPU
# there is no link at all (the "device" is host memory), so offload costs there are this model only.
DEFAULT_HOST_BANDWIDTH = 25e9


def _default_slots(profile) -> int:
    # the C planner's fast path: every block but the last alike (a recompute never holds the last)
    rows = range(profile.n_blocks - 1)
    identical = all(
        getattr(profile, k)[i] == getattr(profile, k)[0] for k in ("fwd_time", "bwd_time", "saved_bytes") for i in rows
    )
    return 2000 if identical or profile.n_blocks <= 32 else 500


# --------------------------------------------------------------------------------------------
# Planning


@dataclass
class CheckpointPlan:
    """The planner's answer for one chain and budget (all byte figures are predictions).

    ``modes[i]`` is the mode block ``i`` keeps its tape in (inside a region: during the recompute);
    ``regions`` are the checkpointed ranges ``[start, end)`` in pre-order (outer before inner);
    ``offloaded`` the (top-level) ones among them whose input is kept in host memory. With
    offloading, ``predicted_time`` includes ``predicted_transfer_time`` (modelled from
    ``host_bandwidth``, bytes/s), and ``predicted_held_bytes`` counts device bytes only
    (``predicted_host_bytes`` are on the host).

    ``predicted_peak_bytes`` is the activation peak of a step (see the module docstring); on a
    whole model it includes what the rest of the step holds (``static_bytes``, the head and loss)
    and the peaks outside the chain (``outside_peak_bytes``). ``predicted_held_bytes`` is what is
    held when the backward starts. Times are seconds; ``predicted_work`` is what the plan was chosen
    on (the profile's time units: counted work for :func:`profile_blocks`).
    ``predicted_overhead_time`` is what the plan adds to a step (recompute, transfer stalls): the
    work a region or the recompute-cheap mode adds, counted, at the blocks' timed forward seconds
    per work unit (``profile.time_unit``), plus their Python timed apart on the CPU (a checkpoint's
    bookkeeping, recompute-cheap's hooks); the selective mode's extra cost as timed;
    ``predicted_time`` is the chain's timed store-all steps plus it. All NaN for a profile counted
    but not timed (``repeats=0``).
    """

    modes: list
    regions: list
    budget_bytes: int
    min_budget_bytes: int
    predicted_peak_bytes: int
    predicted_held_bytes: int
    predicted_time: float
    predicted_overhead_time: float
    no_checkpoint_peak_bytes: int
    profile: ChainProfile = field(repr=False)
    offloaded: list = field(default_factory=list)
    predicted_transfer_time: float = 0.0
    predicted_host_bytes: int = 0
    host_bandwidth: float | None = None
    host_bandwidth_measured: bool = False
    static_bytes: int = 0
    outside_peak_bytes: int = 0
    reference_measured: bool = False
    predicted_work: float = 0.0  # what the planner minimised, in the profile's time units
    predicted_overhead_work: float = 0.0  # the part of it the plan adds (recompute, transfer stalls)

    @property
    def n_blocks(self) -> int:
        return len(self.modes)

    @property
    def predicted_step_time(self) -> float:
        """Seconds of a training step without checkpointing: the blocks' store-all steps as timed,
        plus the rest of the step (embeddings, head, loss; counted as work in the profile's sample
        step) at the blocks' seconds per work unit, forward and backward apart. 0 when the blocks
        were not timed."""
        p = self.profile
        if p.measured_step_time <= 0:
            return 0.0
        return p.measured_step_time + p.outside_time

    @property
    def predicted_overhead(self) -> float:
        """The recompute (and transfer) time as a fraction of a step without checkpointing (0.25:
        steps 25% slower); NaN when the blocks were not timed."""
        step = self.predicted_step_time
        return self.predicted_overhead_time / step if step > 0 else float("nan")

    def depth(self, i: int) -> int:
        """How many regions contain block ``i``."""
        return sum(1 for s, e in self.regions if s <= i < e)

    def recomputed(self, i: int) -> bool:
        """Is block ``i``'s forward run again in the backward (in a region, or checkpointed alone)?"""
        return self.depth(i) > 0 or self.modes[i] == INPUT_ONLY

    def block_label(self, i: int) -> str:
        inner = [(s, e) for s, e in self.regions if s <= i < e]
        if not inner:
            return "recomputed alone" if self.modes[i] == INPUT_ONLY else self.modes[i]
        host = ", input on host" if any(s <= i < e for s, e in self.offloaded) else ""
        if len(inner) == 1 and inner[0] == (i, i + 1):
            return "recomputed alone" + host
        s, e = min(inner, key=lambda r: r[1] - r[0])
        return f"recomputed in [{s},{e}) depth {len(inner)}{host}"

    def describe(self) -> str:
        """A readable table of the plan and its predictions."""
        p = self.profile
        timed = math.isfinite(p.time_unit)
        if p.seconds:  # as the prediction prices them
            times, unit, label = p.to_chain(seconds=True), 1e3, "ms"
            _price_by_work(times, p)
        elif timed:
            times, unit, label = p.__dict__, 1e3 * p.time_unit, "ms"
        else:  # counted work only (repeats=0), in 1e9 units
            times, unit, label = p.__dict__, 1e-9, "Gwork"
        fwd, bwd = f"fwd {label}", f"bwd {label}"
        rows = [
            f"{'block':>5}  {'plan':<32} {fwd:>9} {bwd:>9} {'input':>11} {'kept (plan)':>12} {'kept (store-all)':>17}"
        ]
        for i in range(self.n_blocks):
            k = p.modes.index(self.modes[i])
            kept = "recomputed" if self.recomputed(i) else format_bytes(p.saved_bytes[i][k])
            rows.append(
                f"{i:>5}  {self.block_label(i):<32} {unit * times['fwd_time'][i][k]:>9.3f} "
                f"{unit * times['bwd_time'][i][k]:>9.3f} {format_bytes(p.input_bytes[i]):>11} {kept:>12} "
                f"{format_bytes(p.saved_bytes[i][0]):>17}"
            )
        recomputed = sum(1 for i in range(self.n_blocks) if self.recomputed(i))
        alone = self.modes.count(INPUT_ONLY)
        summary = f"{recomputed} of {self.n_blocks} blocks recomputed"
        summary += f" ({alone} alone)" if alone else f" in {len(self.regions)} region(s)"
        others = recomputed
        for mode in p.modes[1:]:
            n = sum(1 for i, m in enumerate(self.modes) if m == mode and not self.recomputed(i))
            if n:
                summary += f", {n} {mode}"
                others += n
        if others < self.n_blocks:
            left = self.n_blocks - others
            summary += f"; the other {left} keep their tape" if left > 1 else "; the other one keeps its tape"
        rows += ["", summary]
        base = self.predicted_time - self.predicted_overhead_time
        what = "recompute and transfers" if self.offloaded else "recompute"
        reference = "measured" if self.reference_measured else "predicted"
        rows += [
            "",
            f"budget                {format_bytes(self.budget_bytes)}  (least feasible "
            f"{format_bytes(self.min_budget_bytes)}; no checkpointing peaks at "
            f"{format_bytes(self.no_checkpoint_peak_bytes)}, {reference})",
            f"predicted peak        {format_bytes(self.predicted_peak_bytes)}",
            f"held after forward    {format_bytes(self.predicted_held_bytes)}"
            + (" on the device" if self.offloaded else ""),
        ]
        if p.head is not None:
            rows.append(
                f"outside the blocks    {format_bytes(self.static_bytes)} held throughout, "
                f"head and loss {format_bytes(p.head['saved_bytes'])} kept + "
                f"{format_bytes(max(p.head['fwd_tmp_bytes'], p.head['bwd_tmp_bytes']))} transient"
            )
        overhead = f"{1e3 * self.predicted_overhead_time:.2f} ms"
        if not timed:
            work = self.predicted_work - self.predicted_overhead_work
            share = f" (+{100 * self.predicted_overhead_work / work:.1f}% of the chain's work)" if work > 0 else ""
            overhead = f"{self.predicted_overhead_work / 1e9:.3g}e9 work units{share}; not timed (repeats=0)"
        elif p.measured_step_time > 0:
            overhead += f" (+{100 * self.predicted_overhead:.1f}% of a {1e3 * self.predicted_step_time:.2f} ms step: "
            overhead += f"blocks {1e3 * p.measured_step_time:.2f} ms measured"
            if p.outside_time > 0:
                overhead += f", the rest {1e3 * p.outside_time:.2f} ms from its work"
            overhead += ")"
        elif base > 0:
            overhead += f" (+{100 * self.predicted_overhead_time / base:.1f}% over no checkpointing)"
        rows += [
            f"{what + ' time':<21} {overhead}",
            f"regions               {self.regions if self.regions else 'none'}",
        ]
        if self.host_bandwidth is not None:
            source = "measured" if self.host_bandwidth_measured else "assumed, not measured"
            if self.offloaded:
                rows += [
                    f"offloaded to host     {self.offloaded}: {format_bytes(self.predicted_host_bytes)} "
                    f"on the host after the forward",
                    f"transfer time         {1e3 * self.predicted_transfer_time:.2f} ms of the step (modelled at "
                    f"{format_bytes(self.host_bandwidth)}/s, {source}: copy back not prefetched, copy out hidden "
                    f"behind the region's forward)",
                ]
            else:
                rows.append(f"offloaded to host     none (allowed at {format_bytes(self.host_bandwidth)}/s, {source})")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.describe()


BUDGET_FORMS = (
    "bytes (an int such as 6_000_000_000), a string like '6GB' or '512MiB', a fraction in (0, 1] "
    "(a float such as 0.5) or a percent like '50%' of the peak without checkpointing"
)
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*%\s*$")


def parse_budget(budget, who: str = "budget") -> int | float:
    """A planner budget as bytes (``int``) or as a fraction in (0, 1] (``float``) of the peak
    without checkpointing: bytes or a byte string (``"6GB"``) give bytes, a float or a percent
    string (``"50%"``) the fraction. Raises ``ValueError`` listing the accepted forms."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{who}: budget {why}; expected {BUDGET_FORMS}")

    if isinstance(budget, bool):
        raise bad(f"cannot be a bool, got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise bad(f"as a fraction must be in (0, 1], got {budget!r}")
        return budget
    if isinstance(budget, str) and "%" in budget:
        m = _PERCENT.match(budget)
        if m is None:
            raise bad(f"{budget!r} is not a percent")
        percent = float(m.group(1))
        if not 0.0 < percent <= 100.0:
            raise bad(f"as a percent must be in (0%, 100%], got {budget!r}")
        return percent / 100.0
    name = f"{who}: budget"
    try:
        return parse_bytes(budget, name=name)
    except ValueError as e:
        detail = str(e).removeprefix(f"{name}: ")
        raise bad(f"{budget!r} is not valid ({detail})") from None


def _resolve_budget(budget, reference_peak: int, who: str) -> int:
    """Bytes of a planner budget (:func:`parse_budget`): a fraction is of ``reference_peak``, the
    peak without checkpointing."""
    value = parse_budget(budget, who)
    return int(value * reference_peak) if isinstance(value, float) else value


def measure_host_bandwidth(device="cpu", nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, bool]:
    """Bytes per second of a copy between pinned host memory and ``device``, and whether it was measured.

    On a CUDA device: the slower direction of ``nbytes`` copies each way (median of ``repeats``).
    On the CPU there is nothing to copy across, so :data:`DEFAULT_HOST_BANDWIDTH` is returned with
    ``measured=False``. Memory: ``nbytes`` on the device and pinned on the host, briefly;
    synchronises the device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_HOST_BANDWIDTH, False
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        seconds = median_time(lambda: dst.copy_(src, non_blocking=True), repeats, device)
        rates.append(nbytes / max(seconds, 1e-9))
    del host, dev
    return min(rates), True


def _price_by_work(chain: dict, profile: ChainProfile) -> None:
    """In a chain of timed seconds, what checkpointing and the recompute-cheap mode add to a block's
    store-all seconds becomes the work they add at ``profile.time_unit`` seconds per unit, plus their
    Python: a checkpoint's bookkeeping timed on a null block (:mod:`llmmem.checkpointing.bookkeeping`),
    the recompute-cheap hooks' seconds less those of the operators they run (timed with the block).
    Without those timings (an accelerator) the recompute-cheap mode keeps its own timed cost.

    In a region the planner charges a block's no-store forward on top of what a tape costs (its
    recompute keeps a tape): the checkpoint's bookkeeping goes there, or half on the forward and
    half on the backward of the one-block checkpoint column of a chain that is not chainable. So it
    is charged per block and per level of nesting: a nested region's per-tensor work runs once,
    and a bare chain's region pays its fixed part once, not per block; both price a little high."""
    unit, sec = profile.time_unit, profile.seconds
    books = list(sec.get("bookkeeping") or [])
    books += [{}] * (profile.n_blocks - len(books))  # a profile made by hand may have none
    cheap = [k for k, m in enumerate(profile.modes) if m == "recompute-cheap"]
    for i, book in enumerate(books[: profile.n_blocks]):
        region = book.get("checkpoint", 0.0)
        chain["fwd_nostore_time"][i] = profile.fwd_nostore_time[i] * unit + region
        if "recompute-cheap" in book:
            pack, unpack, operators = book["recompute-cheap"]
            python = (pack, max(0.0, unpack - operators))
            for k in cheap:
                for part, key in enumerate(("fwd_time", "bwd_time")):
                    work = getattr(profile, key)[i]
                    chain[key][i][k] = sec[key][i][0] + max(0.0, work[k] - work[0]) * unit + python[part]
        if not profile.chainable:  # the last column: the block checkpointed alone
            chain["fwd_time"][i][-1] = profile.fwd_time[i][-1] * unit + 0.5 * region
            chain["bwd_time"][i][-1] = (
                sec["bwd_time"][i][0] + (profile.bwd_time[i][-1] - profile.bwd_time[i][0]) * unit + 0.5 * region
            )


def _distinct_sizes(a: int, b: int) -> tuple[str, str]:
    """``format_bytes`` of two different sizes, with as many more decimals as it takes for them not
    to read the same (a budget just under the least feasible one: "25.3274 MiB" < "25.3345 MiB",
    not "25.33 MiB" twice)."""
    shown_a, shown_b = format_bytes(a), format_bytes(b)
    if shown_a != shown_b or a == b:
        return shown_a, shown_b
    unit = shown_a.split()[1]
    scale = 1024 ** ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB").index(unit)
    for digits in range(3, 10):  # 9 decimals of a GiB are single bytes; the messages give bytes too
        shown_a, shown_b = f"{a / scale:.{digits}f} {unit}", f"{b / scale:.{digits}f} {unit}"
        if shown_a != shown_b:
            break
    return shown_a, shown_b


def plan_checkpoints(
    blocks,
    sample_input=None,
    budget=1.0,
    *,
    profile: ChainProfile | None = None,
    slots: int = DEFAULT_SLOTS,
    fast_path: bool = True,
    offload: bool = False,
    host_bandwidth: float | None = None,
    **profile_options,
) -> CheckpointPlan:
    """The fastest checkpointing plan for ``blocks`` whose predicted peak fits ``budget``: never
    slower, in the planner's model, than a uniform plan that fits (every block in one mode, every
    k-th block checkpointed, segments of k blocks), whatever the rounding of ``slots``.

    :param blocks: the chain (as for :func:`profile_blocks`); may be ``None`` with ``profile=``.
    :param sample_input: input of the first block (not needed with ``profile=``).
    :param budget: bytes, a string (``"6GB"``), or a fraction (``0.5``, or a percent string
        ``"50%"``) of the no-checkpoint peak.
    :param profile: reuse a :class:`ChainProfile` instead of measuring.
    :param slots: memory discretisation of the DP (more: closer to optimal, slower); default 2000
        for identical blocks or chains of at most 32 blocks, else 500.
    :param offload: also consider keeping the inputs of top-level regions in host memory (see the
        module docstring for the cost model); the plan says which in ``.offloaded``.
    :param host_bandwidth: bytes per second of a host<->device copy, for ``offload=True``. Default:
        measured on a CUDA device (:func:`measure_host_bandwidth`), :data:`DEFAULT_HOST_BANDWIDTH` on the CPU.
    :raises llmmem.InfeasibleError: (a ``ValueError``) when no plan fits; the message states the
        smallest feasible budget, also in ``.min_budget_bytes`` (and the peak without checkpointing in
        ``.no_checkpoint_peak_bytes``).

    Memory and time: profiling (see :func:`profile_blocks`), then the C solver (milliseconds for
    identical blocks; O(L³·slots) otherwise), which runs without the GIL.
    """
    if not isinstance(offload, bool):
        raise ValueError(f"plan_checkpoints: offload must be True or False, got {offload!r}")
    if profile is not None and not isinstance(profile, ChainProfile):
        raise TypeError(
            f"plan_checkpoints: profile must be a ChainProfile (from llmmem.profile_blocks) or None, "
            f"got {type(profile).__name__}"
        )
    if host_bandwidth is not None:
        if (
            isinstance(host_bandwidth, bool)
            or not isinstance(host_bandwidth, (int, float))
            or not math.isfinite(host_bandwidth)
            or host_bandwidth <= 0
        ):
            raise ValueError(
                f"plan_checkpoints: host_bandwidth must be a finite number of bytes per second > 0, "
                f"got {host_bandwidth!r}"
            )
        if not offload:
            raise ValueError("plan_checkpoints: host_bandwidth is only used with offload=True")
    if profile is None:
        if blocks is None or sample_input is None:
            raise ValueError("plan_checkpoints: give blocks and sample_input, or profile=")
        profile = profile_blocks(as_block_list(blocks, "plan_checkpoints"), sample_input, **profile_options)
    elif profile_options:
        raise ValueError(f"plan_checkpoints: {sorted(profile_options)} only apply when profiling (profile=None)")
    if slots is None:
        slots = _default_slots(profile)
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= 100000:
        raise ValueError(f"plan_checkpoints: slots must be an int in 1..100000, got {slots!r}")
    timed = math.isfinite(profile.time_unit)
    if offload and not timed:
        raise ValueError(
            "plan_checkpoints: offload=True needs timed blocks, to price a transfer against a recompute "
            "(profile with repeats >= 1)"
        )
    measured = False
    if offload and host_bandwidth is None:
        host_bandwidth, measured = measure_host_bandwidth(profile.device)
    # The chain's times are in units of profile.time_unit seconds: so is the bandwidth handed over.
    chain = profile.to_chain(host_bandwidth * profile.time_unit if offload else 0.0)
    L = profile.n_blocks
    n = len(chain["fwd_time"])  # L, or L + 1 with the head
    static, outside = int(profile.static_bytes), int(profile.outside_peak_bytes)
    plain = native.plan_simulate(chain, [0] * n, [])["peak_bytes"]
    reference = profile.measured_peak_bytes or max(plain + static, outside)
    budget_bytes = _resolve_budget(budget, reference, "plan_checkpoints")
    try:
        if budget_bytes < outside or budget_bytes < static:
            raise InfeasibleError("outside the blocks")
        result = native.plan_solve(chain, budget_bytes - static, slots, fast_path=fast_path)
    except InfeasibleError:
        least = max(native.plan_min_budget(chain) + static, outside)
        with_offload = " with offloading" if offload else " (offload=True may lower it on a CUDA device)"
        shown_budget, shown_least = _distinct_sizes(budget_bytes, least)
        err = InfeasibleError(
            f"plan_checkpoints: no plan fits a budget of {budget_bytes} bytes ({shown_budget}); the smallest "
            f"feasible budget for these blocks and this input{with_offload} is {least} bytes ({shown_least}), "
            f"{100 * least / reference:.1f}% of the {format_bytes(reference)} needed without checkpointing"
        )
        err.min_budget_bytes = least
        err.no_checkpoint_peak_bytes = reference  # as the plan's: what a fractional budget is of
        raise err from None
    regions = [tuple(r) for r in result["regions"]]
    if any(e > L for _, e in regions):  # pragma: no cover - the head is always the last tape
        raise RuntimeError(f"plan_checkpoints: the planner put the head in a region {regions} (please report)")
    offloaded = [tuple(r) for r in result["offloaded"]]
    if offloaded and torch.device(profile.device).type == "cpu":
        # the planner's offload model describes a device with its own memory; on the CPU the copy
        # lands in the same memory, so say what this plan really peaks at here
        here = native.plan_simulate(chain, result["modes"], regions)["peak_bytes"] + static  # nothing flagged
        warnings.warn(
            f"llmmem: offload=True on the CPU: host memory is the device's, so keeping "
            f"{len(offloaded)} region input(s) on the host frees nothing here. The plan's predicted peak, "
            f"{format_bytes(max(result['peak_bytes'] + static, outside))}, is what a CUDA device would hold; "
            f"on the CPU it peaks at about {format_bytes(max(here, outside))}",
            stacklevel=user_stacklevel(),
        )
    # Chosen on work, so the same plan every run (without offload, whose price also depends on the
    # timed rate); predicted in seconds (_price_by_work). Timed alone, a block's checkpointed form
    # cost 3-24% more than its forward from run to run, its recompute-cheap form 2-6x what that mode
    # adds inside the model; the work they add at the store-all rate plus their Python timed apart
    # comes closer (benchmarks/README.md).
    # Untimed (repeats=0): no seconds at all.
    unit = profile.time_unit
    transfer = result["transfer_time"] * unit
    if profile.seconds:
        timed_chain = profile.to_chain(host_bandwidth if offload else 0.0, seconds=True)
        _price_by_work(timed_chain, profile)
        in_seconds = native.plan_simulate(
            timed_chain, result["modes"], [r + ((1,) if r in offloaded else ()) for r in regions]
        )
        overhead, transfer = in_seconds["overhead_time"], in_seconds["transfer_time"]
    else:
        overhead = result["overhead_time"] * unit
    if profile.measured_step_time > 0:
        base = profile.measured_step_time
    else:
        base = (result["time"] - result["overhead_time"]) * unit
    return CheckpointPlan(
        modes=[profile.modes[k] for k in result["modes"][:L]],
        regions=regions,
        budget_bytes=budget_bytes,
        min_budget_bytes=max(result["min_budget_bytes"] + static, outside),
        predicted_peak_bytes=max(result["peak_bytes"] + static, outside),
        predicted_held_bytes=result["held_bytes"] + static,
        predicted_time=base + overhead,
        predicted_overhead_time=overhead,
        no_checkpoint_peak_bytes=reference,
        profile=profile,
        offloaded=offloaded,
        predicted_transfer_time=transfer,
        predicted_host_bytes=result["host_bytes"],
        host_bandwidth=float(host_bandwidth) if offload else None,
        host_bandwidth_measured=measured,
        static_bytes=static,
        outside_peak_bytes=outside,
        reference_measured=bool(profile.measured_peak_bytes),
        predicted_work=result["time"],
        predicted_overhead_work=result["overhead_time"],
    )
