"""The LM head and its loss, forward + backward: llmmem.linear_cross_entropy against torch's plain
head (``F.cross_entropy(F.linear(h, w).float(), y)``), the same compiled with ``torch.compile``
and, when installed, Cut Cross-Entropy (its ``torch_compile`` implementation on the CPU, its
Triton kernel on a GPU) and Liger's fused linear cross-entropy (GPU only) — all in one run.

Workloads (tokens N, hidden H, vocabulary V; fp32 unless --dtype):
  n4k-h256-v32k    the issue's memory target (peak <= 0.2x torch's)
  n4k-h512-v32k    a wider hidden state
  n8k-h256-v128k   the large-vocabulary target (peak <= 0.1x torch's)
  n256-h64-v4k     --quick (seconds): the candidates that compile are left out unless named
                   in --candidates (torch.compile takes ~20 s a candidate on this CPU)

For each candidate:
- time: the median of forward + backward over repeats, the candidates interleaved (one call of
  each in turn, so a load that comes and goes slows them alike), as a ratio to torch's; one torch
  thread on the CPU, CUDA events on a GPU;
- peak: the memory forward + backward adds above what its inputs hold (the gradients of hidden
  and weight included, which every candidate makes). On the CPU, the resident set's high-water
  mark (``/proc/self/clear_refs`` restarts it after a warm-up call), with glibc's mmap threshold
  pinned at 128 KiB so that a freed large block leaves the resident set (glibc otherwise raises the
  threshold after the first such free and keeps later blocks on its heap, resident, where the next
  call reuses them unseen). Each candidate is measured in a fresh process (``--peak fresh``, the
  default: nothing else has touched its heap) or in this one (``--peak inprocess``, which pins the
  threshold for the rest of the process; --quick measures none). Beside it, for the candidates
  that run eagerly (--quick too), the live tensor bytes that
  llmmem.diagnostics.LiveBytes counts (every storage made and freed; compiled code allocates
  outside the dispatcher, so it is not counted there): the two agree when nothing but tensors
  takes memory. On a GPU, ``torch.cuda.max_memory_allocated``;
- the loss's difference from torch's and the largest difference of the gradients (hidden and
  weight) relative to the largest of torch's, so a fast wrong answer shows.

``--chunk-sizes 64,512`` adds llmmem with those rows of logits a chunk (its default picks them
from a memory target: ``llmmem.head.chunks.chunk_rows``), to compare chunk sizes in one run.

``--profile`` also splits one llmmem call (CPU) into its matmuls (torch.profiler's self time of
``aten::mm``, ``aten::addmm`` and ``aten::addmm_``), its two C passes over the logits (timed around
``llmmem.head.passes.stats`` and ``grad_``) and the rest (Python and small torch ops).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

import llmmem
from llmmem.head.chunks import chunk_rows

WORKLOADS = {
    "n256-h64-v4k": (256, 64, 4096),
    "n4k-h256-v32k": (4096, 256, 32000),
    "n4k-h512-v32k": (4096, 512, 32000),
    "n8k-h256-v128k": (8192, 256, 128256),
}
QUICK = ["n256-h64-v4k"]
FULL = ["n4k-h256-v32k", "n4k-h512-v32k", "n8k-h256-v128k"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_MIB = 2**20
_MMAP_THRESHOLD = 128 << 10  # bytes; glibc's default before it adapts
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def _torch_head(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def _llmmem(rows=None, reduction="mean"):
    if reduction == "none":
        return lambda h, w, y: llmmem.linear_cross_entropy(h, w, y, reduction="none", chunk_size=rows).mean()
    return lambda h, w, y: llmmem.linear_cross_entropy(h, w, y, chunk_size=rows)


def _cce(impl: str):
    from cut_cross_entropy import linear_cross_entropy as cce

    return lambda h, w, y: cce(h, w, y, impl=impl)


def _liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss()
    return lambda h, w, y: liger(w, h, y)


def _installed(module: str) -> str | None:
    """None when ``module`` can be imported, else why not."""
    try:
        __import__(module)
        return None
    except ImportError as e:
        return f"not installed ({e})"


def _candidates(device: str, chunk_sizes=()) -> dict:
    """name -> (make() -> loss function, why it cannot run or None, whether it compiles). Made
    only when it runs (importing torch's compiler alone takes seconds)."""
    out = {
        "torch": (lambda: _torch_head, None, False),
        "torch.compile": (lambda: torch.compile(_torch_head), None, True),
        "llmmem": (_llmmem, None, False),
        "llmmem none->mean": (lambda: _llmmem(reduction="none"), None, False),
    }
    for rows in chunk_sizes:
        out[f"llmmem chunk={rows}"] = (lambda rows=rows: _llmmem(rows), None, False)
    impl = "torch_compile" if device == "cpu" else "cce"
    why = _installed("cut_cross_entropy")
    out["cce" if why else f"cce {impl}"] = (lambda: _cce(impl), why, impl == "torch_compile")
    why = _installed("liger_kernel") if device == "cuda" else "GPU only"
    out["liger"] = (_liger, why, False)
    return out


def _inputs(n, hdim, v, dtype, device):
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(n, hdim, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(v, hdim, generator=gen) / hdim**0.5).to(device, dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen).to(device)
    return h, w, y


def _step(fn, h, w, y) -> float:
    h.grad = w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return loss.item()


# ---- peak memory ---------------------------------------------------------------------------------


def _pin_mmap_threshold() -> bool:
    """Freed blocks of 128 KiB and more go back to the OS from now on (see the module docstring)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_peak(fn, h, w, y) -> int:
    """Bytes the resident set's high-water mark rises by in one forward + backward, after one
    warm-up call (compiles, first touch of code and of the C core's pages)."""
    _step(fn, h, w, y)
    h.grad = w.grad = None
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current resident set
    _step(fn, h, w, y)
    return (_status_kib("VmHWM") - before) * 1024


def _peak_child(name: str, workload: str, dtype: str) -> None:
    """In a fresh process: :func:`_rss_peak` of one candidate. Prints one JSON line."""
    torch.set_num_threads(1)
    if not _pin_mmap_threshold():
        raise RuntimeError("glibc's mallopt is not usable here")
    fn = _candidate_by_name(name, "cpu")
    h, w, y = _inputs(*WORKLOADS[workload], DTYPES[dtype], "cpu")
    print("PEAK " + json.dumps({"peak_bytes": _rss_peak(fn, h, w, y)}), flush=True)


def _candidate_by_name(name: str, device: str):
    chunk = [int(name.split("=")[1])] if name.startswith("llmmem chunk=") else []
    make, why, _ = _candidates(device, chunk)[name]
    if why is not None:
        raise RuntimeError(f"{name}: {why}")
    return make()


def _peak_fresh(name: str, workload: str, dtype: str) -> int | None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--peak-child", name, workload, dtype],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PEAK "):
            return json.loads(line[5:])["peak_bytes"]
    print(f"  {name}: peak not measured: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}", file=sys.stderr)
    return None


def _live_peak(fn, h, w, y) -> int:
    """Live tensor bytes above the inputs at the peak of one forward + backward (LiveBytes)."""
    from llmmem.diagnostics.live import LiveBytes

    h.grad = w.grad = None
    with LiveBytes() as live:
        live.track((h, w, y))
        base = live.allocated()
        _step(fn, h, w, y)
        return live.max_allocated() - base


def _peak_cuda(fn, h, w, y) -> int:
    _step(fn, h, w, y)
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(fn, h, w, y)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ---- time and the comparison ---------------------------------------------------------------------


def _sample(fn, h, w, y, device) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(fn, h, w, y)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    _step(fn, h, w, y)
    return time.perf_counter() - t0


def _rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def run_workload(workload: str, dtype: str, device: str, repeats: int, names, peak: str, chunk_sizes) -> list[dict]:
    """One row per candidate in ``names`` (name -> None, or why it is left out)."""
    n, hdim, v = WORKLOADS[workload]
    chosen = {
        k: (make, why or names[k], compiles)
        for k, (make, why, compiles) in _candidates(device, chunk_sizes).items()
        if k in names
    }
    if any(compiles and why is None for _, why, compiles in chosen.values()):
        torch._dynamo.reset()  # each workload compiles afresh (else the second is compiled for dynamic shapes)
    cands = {k: (make() if why is None else None, why, compiles) for k, (make, why, compiles) in chosen.items()}
    h, w, y = _inputs(n, hdim, v, DTYPES[dtype], device)
    runnable = {k: fn for k, (fn, why, _) in cands.items() if why is None}
    losses, grad_err = {}, {}
    ref = None
    for k, fn in runnable.items():  # the warm-up: compiles, first touch; the answers compared
        losses[k] = _step(fn, h, w, y)
        if ref is None:  # torch's, first
            ref = (h.grad.clone(), w.grad.clone())
        grad_err[k] = max(_rel_diff(h.grad, ref[0]), _rel_diff(w.grad, ref[1]))
    samples: dict = {k: [] for k in runnable}
    for _ in range(repeats):
        for k, fn in runnable.items():
            samples[k].append(_sample(fn, h, w, y, device))
    base_t = statistics.median(samples["torch"])
    rows = []
    for k, (fn, why, compiles) in cands.items():
        if why is not None:
            rows.append({"candidate": k, "skipped": why})
            continue
        row = {"candidate": k, "median_s": statistics.median(samples[k]), "samples_s": samples[k]}
        row["time_vs_torch"] = row["median_s"] / base_t
        row["loss_minus_torch"] = losses[k] - losses["torch"]
        row["grad_rel_diff"] = grad_err[k]
        if device == "cuda":
            row["peak_bytes"] = _peak_cuda(fn, h, w, y)
        else:
            if peak == "fresh":
                row["peak_bytes"] = _peak_fresh(k, workload, dtype)
            elif peak == "inprocess":
                row["peak_bytes"] = _rss_peak(fn, h, w, y)
            if not compiles:
                row["live_peak_bytes"] = _live_peak(fn, h, w, y)
        rows.append(row)
    for key in ("peak_bytes", "live_peak_bytes"):
        base = rows[0].get(key)
        for r in rows:
            if r.get(key) is not None and base:
                r[key.replace("_bytes", "_vs_torch")] = r[key] / base
    return rows


def profile_llmmem(workload: str, dtype: str) -> dict:
    """Seconds of one llmmem call (CPU) in its matmuls, its C passes and the rest."""
    from llmmem.head import passes

    h, w, y = _inputs(*WORKLOADS[workload], DTYPES[dtype], "cpu")
    fn = _llmmem()
    _step(fn, h, w, y)  # warm-up
    spent = {"passes": 0.0}
    originals = passes.stats, passes.grad_

    def timed(f):
        def call(*args):
            t0 = time.perf_counter()
            try:
                return f(*args)
            finally:
                spent["passes"] += time.perf_counter() - t0

        return call

    passes.stats, passes.grad_ = timed(originals[0]), timed(originals[1])
    try:
        with (
            warnings.catch_warnings(),
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
        ):
            warnings.simplefilter("ignore")  # torch's note that a profiler clears its events each cycle
            t0 = time.perf_counter()
            _step(fn, h, w, y)
            total = time.perf_counter() - t0
    finally:
        passes.stats, passes.grad_ = originals
    matmuls = ("aten::mm", "aten::addmm", "aten::addmm_")
    matmul = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in matmuls) / 1e6  # us -> s
    return {
        "total_s": total,
        "matmul_s": matmul,
        "passes_s": spent["passes"],
        "rest_s": total - matmul - spent["passes"],
    }


def _mib(r: dict, key: str) -> str:
    return "n/a" if r.get(key) is None else f"{r[key] / _MIB:.1f}"


def _ratio(r: dict, key: str) -> str:
    return "n/a" if r.get(key) is None else f"{r[key]:.3f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default=None, help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--candidates", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--chunk-sizes", default="", help="also llmmem with these rows a chunk, e.g. 64,512")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--peak", default=None, choices=["fresh", "inprocess", "none"], help="CPU peak memory")
    parser.add_argument("--profile", action="store_true", help="split one llmmem call's time (CPU)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--peak-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peak_child:
        _peak_child(*args.peak_child)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_head: --device cuda, but no CUDA GPU is usable here: skipped")
        return 0
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)
    try:
        return _bench(args, parser)
    finally:
        torch.set_num_threads(threads)  # benchmarks/run.py runs every benchmark in one process


def _bench(args, parser) -> int:
    workloads = args.workloads.split(",") if args.workloads else (QUICK if args.quick else FULL)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; known: {', '.join(WORKLOADS)}")
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",") if c]
    every = _candidates(args.device, chunk_sizes)
    if args.candidates:
        names = args.candidates.split(",")
        unknown = [c for c in names if c not in every]
        if unknown:
            parser.error(f"--candidates: unknown {unknown}; known here: {', '.join(every)}")
        names = dict.fromkeys(["torch"] + [c for c in names if c != "torch"])  # torch: every ratio's baseline
    else:
        left_out = "compiles for ~20 s: not in --quick unless named in --candidates"
        names = {k: (left_out if args.quick and compiles else None) for k, (_, _, compiles) in every.items()}
    peak = args.peak or ("none" if args.quick else "fresh")
    if args.device == "cpu" and peak != "none":
        usable = os.path.exists("/proc/self/clear_refs") and (peak == "fresh" or _pin_mmap_threshold())
        if not usable:
            print("bench_head: no /proc/self/clear_refs or glibc mallopt here: resident-set peaks not measured")
            peak = "none"
    repeats = args.repeats or (3 if args.quick else 5)
    results, load = {}, {"start": os.getloadavg()}
    for wl in workloads:
        n, hdim, v = WORKLOADS[wl]
        rows = run_workload(wl, args.dtype, args.device, repeats, names, peak, chunk_sizes)
        results[wl] = rows
        logits_mib = n * v * 4 / _MIB
        table, skipped = [], []
        for r in rows:
            if "skipped" in r:
                skipped.append(f"  {r['candidate']}: skipped: {r['skipped']}")
                continue
            table.append(
                [
                    r["candidate"],
                    f"{r['median_s'] * 1e3:.1f}",
                    f"{r['time_vs_torch']:.2f}x",
                    _mib(r, "peak_bytes"),
                    _ratio(r, "peak_vs_torch"),
                    _mib(r, "live_peak_bytes"),
                    _ratio(r, "live_peak_vs_torch"),
                    f"{r['loss_minus_torch']:+.1e}",
                    f"{r['grad_rel_diff']:.1e}",
                ]
            )
        default_rows = chunk_rows(n, v, n * hdim * DTYPES[args.dtype].itemsize, None)
        _harness.print_table(
            f"{wl} ({args.dtype}, {args.device}; fp32 logits would be {logits_mib:.0f} MiB; llmmem's chunk "
            f"{default_rows} rows; median of {repeats}; peak: {peak})",
            ["candidate", "fwd+bwd ms", "time/torch", "peak MiB", "peak/torch", "live MiB", "live/torch"]
            + ["loss - torch", "grad rel diff"],
            table,
        )
        print("\n".join(skipped))
        if args.profile and args.device == "cpu":
            p = profile_llmmem(wl, args.dtype)
            results[wl + " llmmem profile"] = p
            print(
                f"  llmmem, one call profiled: {p['total_s']:.2f} s = matmuls {p['matmul_s']:.2f} s "
                f"({p['matmul_s'] / p['total_s']:.0%}), C passes {p['passes_s']:.2f} s "
                f"({p['passes_s'] / p['total_s']:.0%}), the rest {p['rest_s']:.2f} s ({p['rest_s'] / p['total_s']:.0%})"
            )
    load["end"] = os.getloadavg()
    print(f"\nload average (1, 5, 15 min): at start {load['start']}, at end {load['end']}")
    payload = {"device": args.device, "dtype": args.dtype, "peak": peak, "load": load, "results": results}
    path = _harness.write_json("bench_head", payload, args.json)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
