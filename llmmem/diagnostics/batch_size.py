"""``llmmem.find_batch_size``: the largest batch that fits, predicted and verified, no crash loop.

Out-of-memory-and-retry finders (accelerate's ``find_executable_batch_size``, Lightning's
``BatchSizeFinder``) run the step until it fails, ~2·log2(N) trials, each near the limit, and
leave the allocator fragmented. Peak memory grows with the batch as a straight line (every
activation is proportional to it; parameters, gradients and optimizer state are not), so two
small trials give the line, the line gives the answer, and one trial at the answer checks it;
if the check fails, the line through the two nearest points gives a smaller answer, checked once
more. At most four trials; an out-of-memory error in one is caught and its memory released.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import traceback
from dataclasses import dataclass, field

import torch

from llmmem.diagnostics.oom import cuda_capacity
from llmmem.diagnostics.tracker import MemoryTracker, is_out_of_memory
from llmmem.errors import InfeasibleError
from llmmem.units import format_bytes, parse_bytes

__all__ = ["find_batch_size", "BatchSizeSearch", "MAX_TRIALS"]

MAX_TRIALS = 4
_log = logging.getLogger(__name__)
# Kept free when the budget is the device's own memory (fraction): allocator rounding and
# fragmentation on CUDA, other allocations of the process on the host.
_DEVICE_MARGIN = {"cuda": 0.05, "cpu": 0.10}


@dataclass
class BatchSizeSearch:
    """The search: ``batch`` (the answer), ``budget`` (bytes), ``device``, ``measure`` (what a
    trial's peak is), ``trials`` (dicts: ``batch``, ``peak`` bytes or None, ``fits``, ``error``,
    ``grew`` bytes left allocated after it), ``slope`` (bytes per sample) and ``intercept`` (bytes)
    of the fitted line."""

    batch: int
    budget: int
    device: str
    measure: str
    trials: list = field(default_factory=list)
    slope: float | None = None
    intercept: float | None = None

    def describe(self) -> str:
        rows = [f"largest batch that fits {format_bytes(self.budget)} on {self.device}: {self.batch}"]
        for t in self.trials:
            what = "fits" if t["fits"] else "does not fit"
            peak = "peak unknown" if t["peak"] is None else f"peak {format_bytes(t['peak'])}"
            rows.append(f"  batch {t['batch']:>6}: {peak}, {what}" + (f" ({t['error']})" if t["error"] else ""))
        if self.slope is not None:
            rows.append(
                f"  line: {format_bytes(self.intercept)} + {format_bytes(self.slope)} per sample ({self.measure})"
            )
        return "\n".join(rows)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"find_batch_size: {name} must be a positive int, got {value!r}")
    return value


def _host_capacity() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


class _Trials:
    def __init__(self, step, device: str, budget: int, cap: int | None) -> None:
        self.step, self.device, self.budget, self.cap = step, device, budget, cap
        self.done: list[dict] = []

    def run(self, batch: int) -> dict:
        if len(self.done) >= MAX_TRIALS:
            raise RuntimeError("find_batch_size: internal error, more than four trials")
        peak = grew = error = None
        fixed = 0
        try:
            peak, grew, fixed = self._measure(batch)
        except BaseException as exc:  # only out-of-memory errors are kept, after the except block
            if not is_out_of_memory(exc):
                raise
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if exc.__traceback__ is not None:  # the failed step's locals hold its tensors
                traceback.clear_frames(exc.__traceback__)
            del exc
        # outside the except block: the exception and its frames are gone, the memory can go too
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        trial = {
            "batch": batch,
            "peak": peak,
            "fits": error is None and peak <= self.budget,
            "error": error,
            "grew": grew,
            "fixed": fixed,
        }
        self.done.append(trial)
        _log.info(
            "find_batch_size: batch %d: %s, %s",
            batch,
            "out of memory" if error else f"peak {format_bytes(peak)}",
            "fits" if trial["fits"] else "does not fit",
        )
        return trial

    def _measure(self, batch: int):
        """(peak bytes, bytes left allocated after the step, batch-independent bytes at the peak)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            self.step(batch)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_reserved(self.device)
            return peak, torch.cuda.memory_allocated(self.device) - before, 0
        # The process's live tensor bytes; a runaway trial is stopped at twice the budget (cap).
        with MemoryTracker(device="cpu", budget=self.cap, timeline=False, stacks=False, existing="gc") as tr:
            before = sum(tr.current().values())
            self.step(batch)
            after = sum(tr.current().values())
        at_peak = tr.peak()["categories"]
        fixed = sum(at_peak[c] for c in ("parameters", "buffers", "gradients", "optimizer_state", "other"))
        return tr.peak_bytes(), after - before, fixed


def find_batch_size(step, *, low: int = 1, high: int | None = None, budget=None, device=None, details: bool = False):
    """The largest batch size whose training step fits in memory, found in at most four trials.

    :param step: ``step(batch_size)`` runs one training step (forward, backward, optimizer) at that
        batch size. It is called at most four times, so it should not build persistent state
        that changes its memory each call (state made on the first call, such as the optimizer's,
        is counted as present in every later step).
    :param low: the smallest batch to consider (the first trial); :param high: the largest
        (default: no limit).
    :param budget: bytes (or ``"20GB"``) the step may use at its peak: live tensor bytes of the
        whole process on the CPU, ``torch.cuda.max_memory_reserved`` on CUDA. Default: the
        device's memory (CUDA: free + reserved by torch, or the per-process fraction's cap, less 5%; CPU: available host memory plus
        live tensors, less 10%).
    :param device: ``"cpu"`` or ``"cuda[:N]"``; default: the current CUDA device if CUDA is in use,
        else the CPU.
    :param details: return a :class:`BatchSizeSearch` instead of the int.
    :raises llmmem.InfeasibleError: (a ``ValueError``) when ``low`` itself does not fit.

    Memory: each trial's own; between trials the garbage collector runs and (CUDA) the allocator's
    cache is emptied. Time: at most four steps, plus a walk of the garbage collector's objects
    per trial on the CPU. Synchronises the GPU around each trial.

    Example::

        def step(b):
            idx = torch.randint(0, vocab, (b, seq))
            logits, loss = model(idx, targets=idx)
            loss.backward(); opt.zero_grad(set_to_none=True)

        batch = llmmem.find_batch_size(step, budget="20GB")
    """
    if not callable(step):
        raise TypeError(f"find_batch_size: step must be callable as step(batch_size), got {type(step).__name__}")
    low = _positive_int(low, "low")
    if high is not None:
        high = _positive_int(high, "high")
        if high < low:
            raise ValueError(f"find_batch_size: high ({high}) must be >= low ({low})")
    if not isinstance(details, bool):
        raise TypeError(f"find_batch_size: details must be True or False, got {details!r}")
    if device is None:
        device = (
            f"cuda:{torch.cuda.current_device()}"
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else "cpu"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"find_batch_size: device must be 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"find_batch_size: device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"find_batch_size: device {device!r} asked for, but no CUDA device is available")
        dev_key = f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
        measure = "torch.cuda.max_memory_reserved"
    else:
        dev_key = "cpu"
        measure = "live tensor bytes of the process (MemoryTracker)"
    if budget is not None:
        budget_bytes = parse_bytes(budget, "find_batch_size: budget")
        if budget_bytes == 0:
            raise ValueError("find_batch_size: budget must be more than 0 bytes")
    elif dev.type == "cuda":
        budget_bytes = int(cuda_capacity(dev_key)[0] * (1 - _DEVICE_MARGIN["cuda"]))
    else:
        avail = _host_capacity()
        if avail is None:
            raise ValueError("find_batch_size: cannot read the host's available memory; pass budget=")
        live = MemoryTracker(existing="gc", timeline=False, stacks=False)
        with live:
            held = sum(live.current().values())
        budget_bytes = int((avail + held) * (1 - _DEVICE_MARGIN["cpu"]))
    trials = _Trials(step, dev_key, budget_bytes, 2 * budget_bytes if dev.type == "cpu" else None)
    search = BatchSizeSearch(batch=low, budget=budget_bytes, device=dev_key, measure=measure, trials=trials.done)

    def done(batch: int):
        search.batch = batch
        return search if details else batch

    t1 = trials.run(low)
    if not t1["fits"]:
        raise InfeasibleError(
            f"find_batch_size: even batch {low} does not fit the budget of {format_bytes(budget_bytes)} "
            f"({budget_bytes:,} bytes) on {dev_key}: "
            + (t1["error"] if t1["error"] else f"its peak is {format_bytes(t1['peak'])} ({t1['peak']:,} bytes)")
        )
    if high == low:
        return done(low)
    # State the first step made (optimizer moments...) stays for every later step: count it in.
    p1 = t1["peak"] + max(0, t1["grew"] or 0)
    b2 = 2 * low if high is None else min(high, 2 * low)
    t2 = trials.run(b2)
    best = b2 if t2["fits"] else low
    if t2["peak"] is not None and b2 > low:
        slope = (t2["peak"] - p1) / (b2 - low)
        x0, p0 = b2, t2["peak"]
    else:  # b2 failed before its peak: the line through batch 0 at the batch-independent bytes
        slope = (t1["peak"] - t1["fixed"]) / low if t1["fixed"] else t1["peak"] / low
        x0, p0 = low, p1
    search.slope, search.intercept = slope, p0 - slope * x0
    if slope <= 0:
        if high is None:
            raise ValueError(
                f"find_batch_size: the peak did not grow from batch {low} to {b2} "
                f"({format_bytes(p1)} -> {format_bytes(t2['peak'] or 0)}); pass high= to bound the search"
            )
        guess = high
    else:
        guess = x0 + math.floor((budget_bytes - p0) / slope)
    if high is not None:
        guess = min(guess, high)
    if not t2["fits"]:
        guess = min(guess, b2 - 1)
    if guess <= best:
        return done(best)
    t3 = trials.run(guess)
    if t3["fits"]:
        best = guess
        if (high is None or guess < high) and t3["peak"] is not None and slope > 0:
            up = guess + math.floor((budget_bytes - t3["peak"]) / slope)
            if high is not None:
                up = min(up, high)
            if up > guess:  # the line was low: more room than it said
                t4 = trials.run(up)
                return done(up if t4["fits"] else guess)
        return done(best)
    # The prediction was high: the line through the largest fitting trial and this one.
    xa, pa = (b2, t2["peak"]) if t2["fits"] else (low, p1)
    if t3["peak"] is not None and guess > xa:
        local = (t3["peak"] - pa) / (guess - xa)
        down = xa + math.floor((budget_bytes - pa) / local) if local > 0 else guess - 1
    else:  # out of memory before its peak: back off by what the line says was missing, at least 1
        down = guess - 1
    down = min(down, guess - 1)
    if down <= best:
        return done(best)
    t4 = trials.run(down)
    return done(down if t4["fits"] else best)
