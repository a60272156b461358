"""``llmmem.find_batch_size``: the largest batch that fits, found by trials that never go past the
budget, and checked both ways (it fits, one more does not).

Out-of-memory-and-retry finders (accelerate's ``find_executable_batch_size``, Lightning's
``BatchSizeFinder``) run the step until it fails, each failure a full-size allocation that the
device refuses late and that leaves the allocator fragmented. Here every trial runs under a cap of
the budget that is checked *before* each allocation (:mod:`llmmem.diagnostics.cap`): a trial that
would not fit stops at its first operator that would cross the budget. The trials that fit give a
model of the peak (a line, or a parabola for memory that grows faster: attention over a sequence
that grows with the "batch"), the model gives the next trial, and once a trial has failed the
answer is looked for between the largest fit and the smallest failure (:mod:`~llmmem.diagnostics.batch_search`).
The search ends when the answer ``b`` has run and fit and ``b + 1`` has run and not fit: a few
trials on linear and quadratic memory (4 to 8 measured), more when it is step-shaped.
"""

from __future__ import annotations

import gc
import logging
import os
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from llmmem.diagnostics.batch_search import BatchSearch
from llmmem.diagnostics.cap import AllocationCap, cuda_cap
from llmmem.diagnostics.live import LiveBytes
from llmmem.diagnostics.oom import cuda_capacity
from llmmem.diagnostics.tracker import is_out_of_memory
from llmmem.errors import InfeasibleError, user_stacklevel
from llmmem.units import format_bytes, parse_bytes

__all__ = ["find_batch_size", "BatchSizeSearch", "MAX_TRIALS"]

# A ceiling that only memory which hardly depends on the batch comes near; typical searches take 4-8.
MAX_TRIALS = 32
# The peak staying flat from batch b to this many times b: the step's memory does not grow with the
# batch (a step-shaped peak, e.g. CUDA's segment rounding, is flat over a few doublings at most).
_FLAT_RATIO = 1024
_log = logging.getLogger(__name__)
# Kept free when the budget is the device's own memory (fraction): allocator rounding and
# fragmentation on CUDA, other allocations of the process on the host.
_DEVICE_MARGIN = {"cuda": 0.05, "cpu": 0.10}


@dataclass
class BatchSizeSearch:
    """The search: ``batch`` (the answer), ``budget`` (bytes), ``device``, ``measure`` (what a
    trial's peak is), ``trials`` (dicts: ``batch``, ``peak`` bytes or None when it stopped at the
    cap, ``fits``, ``error``, ``grew`` bytes left allocated after it), ``exact`` (``batch`` fit and
    ``batch + 1`` did not, or ``batch`` is ``high``), ``slope`` (bytes per sample) and ``intercept``
    (bytes) of the line through the two largest fitting trials (None with fewer)."""

    batch: int
    budget: int
    device: str
    measure: str
    trials: list = field(default_factory=list)
    exact: bool = False
    slope: float | None = None
    intercept: float | None = None

    def describe(self) -> str:
        rows = [f"largest batch that fits {format_bytes(self.budget)} on {self.device}: {self.batch}"]
        if not self.exact:
            rows[0] += f" (not checked against {self.batch + 1}: the search stopped after {len(self.trials)} trials)"
        for t in self.trials:
            what = "fits" if t["fits"] else "does not fit"
            peak = "stopped at the cap" if t["peak"] is None else f"peak {format_bytes(t['peak'])}"
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
    def __init__(self, step, device: str, budget: int) -> None:
        self.step, self.device, self.budget = step, device, budget
        self.done: list[dict] = []

    def run(self, batch: int) -> dict:
        peak = grew = error = None
        try:
            peak, grew = self._measure(batch)
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
        """(peak bytes, bytes left allocated after the step), under a cap of the budget."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            with cuda_cap(self.device, self.budget):
                self.step(batch)
                torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_reserved(self.device)
            return peak, torch.cuda.memory_allocated(self.device) - before
        # The process's live tensor bytes. The cap is entered first so that it sits below the
        # counter on the mode stack: it sizes each operator before it runs, the counter after.
        live = LiveBytes(existing="gc")
        with AllocationCap(self.budget, lambda: live.allocated("cpu")), live:
            before = live.allocated("cpu")
            self.step(batch)
            after = live.allocated("cpu")
        return live.max_allocated("cpu"), after - before


def find_batch_size(step, *, low: int = 1, high: int | None = None, budget=None, device=None, details: bool = False):
    """The largest batch size whose training step fits in memory: tried, never past the budget, and
    checked both ways (the answer fits, one more does not).

    :param step: ``step(batch_size)`` runs one training step (forward, backward, optimizer) at that
        batch size. It is called once per trial (typically 4 to 8 times; at most
        :data:`MAX_TRIALS`), so it should not build persistent state that changes its memory each
        call. State made on the first call (the optimizer's moments, the gradients that a step
        beginning with ``zero_grad(set_to_none=True)`` frees and re-creates) is taken as present
        in every later step: the first trial only tells whether ``low`` fits, and if the answer
        rests on it alone, ``low`` is run again once that state exists.
    :param low: the smallest batch to consider (the first trial); :param high: the largest
        (default: no limit).
    :param budget: bytes (or ``"20GB"``) the step may use at its peak: live tensor bytes of the
        whole process on the CPU, ``torch.cuda.max_memory_reserved`` on CUDA. Default: the
        device's memory (CUDA: free + reserved by torch, or the per-process fraction's cap, less
        5%; CPU: available host memory plus live tensors, less 10%).
    :param device: ``"cpu"`` or ``"cuda[:N]"``; default: the current CUDA device if CUDA is in use,
        else the CPU.
    :param details: return a :class:`BatchSizeSearch` instead of the int.
    :raises llmmem.InfeasibleError: (a ``ValueError``) when ``low`` itself does not fit.
    :raises ValueError: when the peak does not grow with the batch (and no ``high`` bounds it).

    **The cap.** No trial takes more than the budget: on the CPU each operator's new storages are
    sized before it runs (:class:`llmmem.diagnostics.cap.AllocationCap`) and one that would take
    the live bytes past the budget raises :class:`llmmem.OutOfMemoryError` instead of allocating;
    on CUDA ``torch.cuda.set_per_process_memory_fraction`` is lowered to the budget for the trial
    (and restored), so the caching allocator refuses before asking the driver. An out-of-memory
    error in a trial (the cap's or the device's) is caught, its memory released, and the trial
    counts as not fitting.

    Memory: each trial's own, at most the budget; between trials the garbage collector runs and
    (CUDA) the allocator's cache is emptied. Time: one step per trial (a failed one stops at the
    cap), plus on the CPU a walk of the garbage collector's objects and an extra run on meta tensors
    for each operator that is not a view or in-place. Synchronises the GPU around each trial.

    Example::

        def step(b):
            opt.zero_grad(set_to_none=True)
            idx = torch.randint(0, vocab, (b, seq))
            logits, loss = model(idx, targets=idx)
            loss.backward(); opt.step()

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
        measure = "live tensor bytes of the process"
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
        with LiveBytes(existing="gc") as live:
            held = live.allocated("cpu")
        budget_bytes = int((avail + held) * (1 - _DEVICE_MARGIN["cpu"]))
    trials = _Trials(step, dev_key, budget_bytes)
    search = BatchSizeSearch(batch=low, budget=budget_bytes, device=dev_key, measure=measure, trials=trials.done)

    first = trials.run(low)
    if not first["fits"]:
        raise InfeasibleError(
            f"find_batch_size: even batch {low} does not fit the budget of {format_bytes(budget_bytes)} "
            f"({budget_bytes:,} bytes) on {dev_key}: "
            + (
                first["error"]
                if first["error"]
                else f"its peak is {format_bytes(first['peak'])} ({first['peak']:,} bytes)"
            )
        )
    # The first trial's peak is a steady one only if it left nothing behind: otherwise (optimizer
    # state made, gradients kept) later steps carry what it did not, and it is not used for the model.
    bracket = BatchSearch(low, high, budget_bytes)
    bracket.record(low, True, first["peak"], steady=first["grew"] == 0)
    while not bracket.done:
        if len(trials.done) >= MAX_TRIALS:
            warnings.warn(
                f"find_batch_size: stopped after {MAX_TRIALS} trials with batch {bracket.lo} fitting and "
                + (f"{bracket.hi} not" if bracket.hi is not None else "no batch found that does not fit")
                + "; the answer may be short of the largest",
                stacklevel=user_stacklevel(),
            )
            break
        if bracket.hi is None and len(bracket.fits) >= 2:
            (b0, p0), (b1, p1) = min(bracket.fits.items()), max(bracket.fits.items())
            if p1 <= p0 and b1 >= _FLAT_RATIO * b0:
                raise ValueError(
                    f"find_batch_size: the peak did not grow from batch {b0} to {b1} "
                    f"({format_bytes(p0)} -> {format_bytes(p1)}): the step's memory does not depend on "
                    "the batch; pass high= to bound the search"
                )
        trial = trials.run(bracket.propose())
        bracket.record(trial["batch"], trial["fits"], trial["peak"])
    lo = bracket.lo
    if lo == low and low not in bracket.fits and len(trials.done) > 1:
        # the answer rests on the first trial, made before the state that later steps carry
        again = trials.run(low)
        if not again["fits"]:
            raise InfeasibleError(
                f"find_batch_size: batch {low} fit the budget of {format_bytes(budget_bytes)} only on the first "
                f"call, before the state that step made (optimizer state, gradients) existed: "
                + (again["error"] or f"its peak is now {format_bytes(again['peak'])}")
            )
        bracket.record(low, True, again["peak"])
    search.batch = lo
    search.exact = bracket.done
    points = sorted(bracket.fits.items())[-2:]
    if len(points) == 2:
        (b1, p1), (b2, p2) = points
        search.slope = (p2 - p1) / (b2 - b1)
        search.intercept = p2 - search.slope * b2
    return search if details else lo
