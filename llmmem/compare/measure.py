"""What ``python -m llmmem compare`` measures in each training step, and the largest-fit search.

Memory of a step (bytes):

* on the CPU, live tensor bytes counted by :class:`~llmmem.diagnostics.live.LiveBytes`, which sees
  every storage an operator makes and every free (not the process's RSS, not a model); the
  parameters, gradients, optimizer state and the batch, made before the step, are counted from its
  start;
* on CUDA, ``torch.cuda.max_memory_allocated`` and ``memory_allocated`` (LiveBytes still draws the
  timeline);
* for the compiled preset (``memory="resident"``, :func:`resident_step`), no dispatch mode: on the
  CPU, the rise of the process's resident set over the step on top of the tensor bytes the step
  starts from; on CUDA, torch.cuda's counters. No timeline.

``peak``: the most that is live at any moment of the step (forward, backward and optimizer step).
``start``: what is live when the step begins: parameters, gradients (kept allocated between steps),
optimizer state, the batch. ``activation``: the most that is live during forward and backward, less
``start``: what the step's activations, their gradients and the recompute add.

Step time: wall clock of a whole step (synchronised on CUDA), median of the timed steps; the
process's CPU time is recorded too (less sensitive to other load on a shared machine).
"""

from __future__ import annotations

import ctypes
import gc
import math
import statistics
import time

import torch

from llmmem.compare.report import MIN_SPREAD_PAIRS
from llmmem.diagnostics.live import LiveBytes, device_key

__all__ = [
    "measured_step",
    "resident_step",
    "unmap_large_frees",
    "train_and_measure",
    "search_largest",
    "decimate",
    "MEMORY_KINDS",
]

MEMORY_KINDS = ("live", "resident")

# glibc's mallopt parameter for the size from which an allocation is its own mapping
_M_MMAP_THRESHOLD = -3
# bytes: a tensor of a page or more is mapped when made and unmapped when freed. Not 64 KiB as in
# benchmarks/bench_compile_memory.py: the quick preset's activations are 16 KiB each, and freed
# into the heap they would be reused unseen.
_MMAP_THRESHOLD = 4096

TIMELINE_POINTS = 1500

# A linear guess is at most this many times the largest size measured to fit: a peak that barely
# grows with the size (fixed costs dominate: a fused LM head's [vocab x hidden] gradients at a small
# batch) gives a line whose slope is a few bytes a sample, which puts the cap at a batch of tens of
# thousands; running that would take the machine's whole memory.
MAX_GROWTH = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decimate(points: list, limit: int = TIMELINE_POINTS) -> list:
    """At most ``limit`` of the ``(t, bytes)`` points, keeping the largest of each time bucket (so
    the peaks survive)."""
    if len(points) <= limit:
        return points
    t0, t1 = points[0][0], points[-1][0]
    width = (t1 - t0) / limit or 1.0
    out: dict[int, tuple] = {}
    for t, b in points:
        k = min(limit - 1, int((t - t0) / width))
        if k not in out or b > out[k][1]:
            out[k] = (t, b)
    return [out[k] for k in sorted(out)]


def measured_step(trainer, x, y, device: torch.device, *, timeline: bool = False) -> dict:
    """One training step under LiveBytes: its loss, peak, start and activation bytes, phase times
    and (``timeline=True``) the live bytes after every allocation and free."""
    key = device_key(device)
    live = LiveBytes()
    live.track(trainer.tracked())
    live.track([x, y])
    samples: list = []
    marks: dict = {}
    fb_peak = {}
    t0 = [0.0]
    if timeline:
        live.listeners.append(
            lambda event, sid, dev, nbytes: samples.append((time.perf_counter(), live.allocated(key)))
        )
    cuda = device.type == "cuda"
    if cuda:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    with live:
        live.reset_peak()
        start = live.allocated(key)
        cuda_start = torch.cuda.memory_allocated(device) if cuda else None

        def mark(name: str) -> None:
            _sync(device)
            marks[name] = time.perf_counter() - t0[0]
            if name == "backward":
                fb_peak["live"] = live.max_allocated(key)
                if cuda:
                    fb_peak["cuda"] = torch.cuda.max_memory_allocated(device)

        if timeline:
            samples.append((time.perf_counter(), start))
        t0[0] = time.perf_counter()
        loss = trainer.step(x, y, mark)
    out = {
        "loss": loss,
        "live_peak_bytes": live.max_allocated(key),
        "live_start_bytes": start,
        "live_activation_bytes": fb_peak["live"] - start,
        "phases": marks,
    }
    if cuda:
        out.update(
            peak_bytes=torch.cuda.max_memory_allocated(device),
            start_bytes=cuda_start,
            activation_bytes=fb_peak["cuda"] - cuda_start,
            reserved_peak_bytes=torch.cuda.max_memory_reserved(device),
        )
    else:
        out.update(peak_bytes=out["live_peak_bytes"], start_bytes=start, activation_bytes=out["live_activation_bytes"])
    if timeline:
        base = t0[0]
        out["timeline"] = [(round(t - base, 6), b) for t, b in decimate(samples)]
    return out


def unmap_large_frees() -> None:
    """Have glibc map each allocation of :data:`_MMAP_THRESHOLD` bytes or more on its own and unmap
    it when freed, from now on in this process. Its default keeps freed memory in the heap for reuse
    and raises the threshold as large blocks are freed, so a step that reuses what the previous one
    freed would show no rise of the resident set. Called when the worker starts: set only before the
    measured step instead, the heap left by the earlier steps served the step's tensors in fragments
    and the rise read twice LiveBytes' count on the eager baseline (154.8 MiB against 76.6). Its cost
    is in every step of such a row, the timed ones too: a page fault per new page of every tensor (on
    the compiled preset's GPT, eager steps about 2x slower, compiled ones 1.3x), which is why the worker
    measures such a row's memory in a process of its own (``llmmem.compare.worker``). ``MALLOC_MMAP_THRESHOLD_``
    does the same but is read only when a process starts, and the rows are forked from a server.

    :raises RuntimeError: where the C library has no ``mallopt`` (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    except (OSError, AttributeError) as exc:
        raise RuntimeError(f"memory='resident' needs glibc's mallopt: {exc}") from None
    if ok != 1:
        raise RuntimeError("memory='resident': mallopt(M_MMAP_THRESHOLD) was refused")


def _return_free_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim``), so that a step that
    reuses them is seen writing them again; a no-op where the C library has none."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _vm(*keys: str) -> dict:
    """Lines of /proc/self/status, in bytes (``VmRSS``: resident now; ``VmHWM``: its high-water mark)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_high_water() -> None:
    # "5" resets VmHWM to the resident set now (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident_step(trainer, x, y, device: torch.device) -> dict:
    """One training step measured without a dispatch mode, for compiled models (what a compiled
    graph allocates never passes through one, and Dynamo does not compile under one).

    On the CPU: the rise of the process's resident set (Linux: ``VmHWM`` reset through
    ``/proc/self/clear_refs`` before the step, read after backward and at the end; see
    :func:`unmap_large_frees`), on top of ``start``, the tensor bytes of parameters, gradients,
    optimizer state and batch, counted from their storages. The rise counts pages written, not
    tensors: an allocation never written is not resident, and Python's own objects are. On CUDA:
    ``torch.cuda.max_memory_allocated`` and ``memory_allocated`` as :func:`measured_step`.

    :raises RuntimeError: on the CPU of a system without ``/proc/self/clear_refs``.
    """
    marks: dict = {}
    fb: dict = {}
    cuda = device.type == "cuda"
    key = device_key(device)
    counted = LiveBytes()  # never entered: it only sums the storages it is given
    counted.track(trainer.tracked())
    counted.track([x, y])
    start = counted.allocated(key)
    gc.collect()  # what earlier steps left in reference cycles is freed now, not inside the step
    if cuda:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        _return_free_heap()
        try:
            base = _vm("VmRSS")["VmRSS"]
            _reset_high_water()
        except OSError as exc:
            raise RuntimeError(f"memory='resident' on the CPU needs Linux's /proc/self/clear_refs: {exc}") from None

    def high() -> int:
        if cuda:
            return torch.cuda.max_memory_allocated(device) - base
        return _vm("VmHWM")["VmHWM"] - base

    t0 = time.perf_counter()

    def mark(name: str) -> None:
        _sync(device)
        marks[name] = time.perf_counter() - t0
        if name == "backward":
            fb["rise"] = high()

    loss = trainer.step(x, y, mark)
    rise = high()
    out = {
        "loss": loss,
        "memory": "resident",
        "peak_bytes": (base if cuda else start) + rise,
        "start_bytes": base if cuda else start,
        "activation_bytes": fb["rise"],
        "peak_rise_bytes": rise,
        "phases": marks,
    }
    if cuda:
        out["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        out["resident_start_bytes"] = base
    return out


def _timed(fn, device):
    _sync(device)
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - w, time.process_time() - c


def train_and_measure(
    trainer, batches, steps: int, device: torch.device, *, reduce_loss=None, reference=None, memory: str = "live"
) -> dict:
    """Train ``steps`` steps on ``batches()``: the first warms up, the middle ones are timed, the
    last is :func:`measured_step` (``memory="live"``) or :func:`resident_step` (``"resident"``).
    ``reduce_loss`` maps a rank's loss to the global one.

    ``reference`` (a trainer of the fp32 baseline on its own copy of the model): after each timed
    step it takes a step on the same batch, timed too, and is then dropped (before the measured
    step, so it holds no memory there). The median of the per-step ratios, ``relative_step_time``
    (``relative_cpu_step_time`` on the process's CPU time), compares the strategy with the baseline
    at the same moment, in the same process: what load on a shared machine does to one it does to
    the other, unlike a comparison of medians taken minutes apart in different processes.
    """
    if steps < 3:
        raise ValueError(f"steps must be at least 3 (warm-up, timed, measured), got {steps}")
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {memory!r}")
    losses, wall, cpu, ref_wall, ref_cpu = [], [], [], [], []
    measured = None
    for i in range(steps):
        x, y = batches()
        if i == steps - 1:
            reference = None  # its memory is freed before the measured step
            if memory == "resident":
                measured = resident_step(trainer, x, y, device)
            else:
                measured = measured_step(trainer, x, y, device, timeline=True)
            loss = measured.pop("loss")
        else:
            # Which of the pair runs first alternates: the second of two steps on the same batch
            # finds it in cache, and a fixed order would hand that to the strategy every time.
            if reference is not None and i % 2 == 1:
                _, rw, rc = _timed(lambda: reference.step(x, y), device)
                loss, w, c = _timed(lambda: trainer.step(x, y), device)
            else:
                loss, w, c = _timed(lambda: trainer.step(x, y), device)
                if reference is not None:
                    _, rw, rc = _timed(lambda: reference.step(x, y), device)
            if i >= 1:
                wall.append(w)
                cpu.append(c)
                if reference is not None:
                    ref_wall.append(rw)
                    ref_cpu.append(rc)
        losses.append(reduce_loss(loss) if reduce_loss is not None else loss)
    out = {
        "losses": losses,
        "final_loss": losses[-1],
        "step_times": wall,
        "cpu_step_times": cpu,
        "step_time": statistics.median(wall),
        "cpu_step_time": statistics.median(cpu),
        **measured,
    }
    if ref_wall:
        ratios = [a / max(b, 1e-9) for a, b in zip(wall, ref_wall)]
        cpu_ratios = [a / max(b, 1e-9) for a, b in zip(cpu, ref_cpu)]
        out.update(
            reference_step_times=ref_wall,
            reference_cpu_step_times=ref_cpu,
            relative_step_time=statistics.median(ratios),
            relative_cpu_step_time=statistics.median(cpu_ratios),
            relative_step_time_spread=median_spread(ratios),
            relative_cpu_step_time_spread=median_spread(cpu_ratios),
        )
    return out


def median_spread(values) -> float | None:
    """How far the median of ``values`` (the paired ratios) may be from where another run would put
    it: half the width of the narrowest interval between order statistics (ranks k and n - k + 1)
    that holds the true median with probability at least 68%, whatever the ratios' distribution
    (76% at the full run's 18 pairs); the spread printed beside each overhead. None for fewer than
    :data:`~llmmem.compare.report.MIN_SPREAD_PAIRS` values.

    Not the spread of the steps themselves (half their interquartile range, printed before): two
    runs of the same rows on a quiet 2-core machine, 18 pairs each, put their overheads 0.5 to 4.5
    points apart while the steps' half interquartile ranges read 6 to 17."""
    v = sorted(values)
    n = len(v)
    if n < MIN_SPREAD_PAIRS:
        return None
    # coverage of ranks (k, n - k + 1): 1 - 2 P(Binomial(n, 1/2) <= k - 1)
    k, below = 1, 0
    while k < (n + 1) // 2:
        below += math.comb(n, k - 1)
        if 1 - 2 * (below + math.comb(n, k)) / 2**n < 0.68:
            break
        k += 1
    return (v[n - k] - v[k - 1]) / 2


def _guess(points: dict, cap: int, lo, hi, intercept: int | None = None) -> int:
    """The next size to try: where the line through the two measured sizes nearest the cap reaches it
    (with one size measured: the line through it and ``intercept``, the peak at size 0)."""
    if len(points) == 1 and intercept is not None:
        ((n1, p1),) = points.items()
        if p1 is not None and p1 > intercept:
            guess = int((cap - intercept) // ((p1 - intercept) / n1))
            if lo is not None and guess <= lo:
                guess = lo + 1
            if hi is not None and guess >= hi:
                guess = hi - 1
            return max(1, guess)
    fitting = sorted(n for n, p in points.items() if p is not None and p <= cap)
    over = sorted(n for n, p in points.items() if p is not None and p > cap)
    pair = []
    if fitting:
        pair.append(fitting[-1])
    if over:
        pair.append(over[0])
    if len(pair) < 2:
        known = sorted(n for n, p in points.items() if p is not None and n not in pair)
        if known:
            pair.append(known[-1] if fitting else known[0])
    if len(pair) == 2 and pair[0] != pair[1]:
        (n1, n2) = sorted(pair)
        p1, p2 = points[n1], points[n2]
        slope = (p2 - p1) / (n2 - n1)
        guess = int(n1 + (cap - p1) // slope) if slope > 0 else 2 * max(pair)
    elif fitting:
        guess = 2 * fitting[-1]
    else:
        guess = max(1, min(points) // 2)
    if lo is not None and guess <= lo:
        guess = lo + 1
    if hi is not None and guess >= hi:
        guess = hi - 1
    return max(1, guess)


def search_largest(
    peak_at,
    *,
    start: int,
    start_peak: int,
    cap: int,
    trials: int,
    kind: str,
    first: int | None = None,
    linear=True,
    intercept: int | None = None,
    known: dict | None = None,
) -> dict:
    """The largest size (batch or layers) whose measured peak is at most ``cap`` bytes.

    ``peak_at(n)`` runs a step at size ``n`` and returns its peak (``None``: cannot run, counts as
    not fitting). At most ``trials`` runs, until a size that fits and the next one, which does not,
    are both measured (``exact``); otherwise ``largest`` is the largest size measured to fit (a
    lower bound). The first size tried is ``first`` if given, then its neighbour; then, with
    ``linear``, where a line through the measured peaks nearest the cap crosses it (peaks grow
    linearly with the batch or the depth), else the middle of the bracket (or an eighth more than
    the largest fit while nothing is too big); a linear guess is at most :data:`MAX_GROWTH` times the
    largest size measured to fit. ``intercept``: the peak at size 0 (what does not grow
    with the size, e.g. parameters, gradients and optimizer state for a batch), so that a linear
    search's first guess is a line through it and ``start`` rather than a doubling. ``known``: peaks
    measured before the search, ``{size: peak}``, which its guesses use too.
    """
    points = {**(known or {}), start: start_peak}
    fits = [n for n, p in points.items() if p is not None and p <= cap]
    over = [n for n, p in points.items() if p is None or p > cap]
    lo = max(fits) if fits else None
    hi = min((n for n in over if lo is None or n > lo), default=None)
    log = []
    while len(log) < trials:
        if lo is not None and hi is not None and hi == lo + 1:
            break
        if lo is None and hi == 1:
            break
        if not log and first is not None:
            n = max(1, first)
            if lo is not None and n <= lo:
                n = lo + 1
        elif linear:
            n = _guess(points, cap, lo, hi, intercept)
            if lo is not None:
                n = min(n, MAX_GROWTH * lo)
        elif len(log) == 1 and first is not None:
            n = log[0][0] + 1 if log[0][0] == lo else log[0][0] - 1  # the guess's neighbour
        elif hi is None:
            n = lo + max(1, lo // 8)  # a plan's peak says little about the next size: grow gently
        else:
            n = ((lo or 0) + hi) // 2 if hi - (lo or 0) > 2 else (lo or 0) + 1
            n = max(1, n)
        if n in points:
            break
        peak = peak_at(n)
        points[n] = peak
        log.append([n, peak])
        if peak is not None and peak <= cap:
            lo = n if lo is None or n > lo else lo
        else:
            hi = n if hi is None or n < hi else hi
    return {
        "kind": kind,
        "cap_bytes": cap,
        "start": start,
        "trials": log,
        "largest": lo,
        "exact": lo is not None and hi is not None and hi == lo + 1,
    }
