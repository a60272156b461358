"""Diagnostics: what the memory tracker costs, what the monitor costs, how many trials batch-size
searches take.

Part 1, tracking overhead: a GPT training step (forward, backward, AdamW step) without anything,
under ``llmmem.MemoryTracker`` (timeline and stacks: what ``profile`` and ``plot`` need), under a
tracker without timeline or stacks (what ``oom_report`` keeps on), and inside ``llmmem.oom_report``.
Steps alternate between the four, median of repeats; the ratio to the bare step is reported for
wall time and for process CPU time (less disturbed by other jobs on a shared machine).

Part 2, monitor overhead: the cost of one sample (median of 200), so the share of one core at an
interval of 1 s; and the ratio of a loop of steps with a monitor sampling every 50 ms to the bare
loop (interleaved, median).

Part 3, batch-size search: for budgets that make the largest batch 5, 19 and 77 on a small GPT (CPU,
live tensor bytes), the trials of ``llmmem.find_batch_size`` and the trials an out-of-memory-and-retry
finder needs: halving from 128 (accelerate before v1.10), x0.9 from 128 (accelerate now), and
Lightning's "binsearch" (double from 2 until a failure, then bisect). Counted on the measured peaks:
the searches themselves are only simulated for the retry finders.

python benchmarks/run.py --only diagnostics [--quick]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness
import torch

import llmmem
from llmmem.diagnostics.tracker import MemoryTracker
from llmmem.models.gpt import GPT, GPTConfig

CONFIGS = {
    "tiny": dict(layers=2, hidden=64, heads=4, seq_len=64, vocab_size=256, batch=4),
    "small": dict(layers=4, hidden=256, heads=4, seq_len=256, vocab_size=2048, batch=4),
    "medium": dict(layers=6, hidden=512, heads=8, seq_len=256, vocab_size=4096, batch=8),
}


def _model(cfg: dict, device: str):
    torch.manual_seed(0)
    dims = {k: v for k, v in cfg.items() if k != "batch"}
    model = GPT(GPTConfig(**dims)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _stepper(model, opt, batch: int, device: str):
    cfg = model.cfg

    def step():
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
        _, loss = model(idx, targets=idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return step


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def tracking_overhead(names, repeats: int, device: str) -> list[dict]:
    rows = []
    for name in names:
        cfg = CONFIGS[name]
        model, opt = _model(cfg, device)
        step = _stepper(model, opt, cfg["batch"], device)
        step()  # the optimizer state exists from here on
        modes = {
            "bare": lambda: step(),
            "tracker": lambda: _under(MemoryTracker(model, opt), step),
            "tracker (no timeline, no stacks)": lambda: _under(
                MemoryTracker(model, opt, timeline=False, stacks=False), step
            ),
            "oom_report": lambda: _under(llmmem.oom_report(model, opt), step),
        }
        samples = {m: ([], []) for m in modes}
        for _ in range(repeats):
            for m, fn in modes.items():
                gc.collect()
                w, c = _timed(fn)
                samples[m][0].append(w)
                samples[m][1].append(c)
        base_w, base_c = (statistics.median(samples["bare"][i]) for i in (0, 1))
        for m in modes:
            w, c = (statistics.median(samples[m][i]) for i in (0, 1))
            rows.append(
                {
                    "model": name,
                    "mode": m,
                    "step_ms": 1e3 * w,
                    "wall_ratio": w / base_w,
                    "cpu_ratio": c / base_c if base_c > 0 else None,
                }
            )
    return rows


def _under(ctx, step):
    with ctx:
        step()


def monitor_overhead(repeats: int, device: str) -> dict:
    mon = llmmem.monitor(1.0, callback=lambda s: None)
    costs = []
    for _ in range(200):
        t = time.perf_counter()
        mon.sample()
        costs.append(time.perf_counter() - t)
    per_sample = statistics.median(costs)
    cfg = CONFIGS["small"]
    model, opt = _model(cfg, device)
    step = _stepper(model, opt, cfg["batch"], device)
    step()

    def loop():
        for _ in range(3):
            step()

    bare, watched = [], []
    for _ in range(repeats):
        bare.append(_timed(loop))
        with llmmem.monitor(0.05, callback=lambda s: None):
            watched.append(_timed(loop))
    b = [statistics.median(x[i] for x in bare) for i in (0, 1)]
    m = [statistics.median(x[i] for x in watched) for i in (0, 1)]
    return {
        "sample_us": 1e6 * per_sample,
        "share_of_a_core_at_1s": per_sample / 1.0,
        "loop_wall_ratio_at_50ms": m[0] / b[0],
        "loop_cpu_ratio_at_50ms": m[1] / b[1],
    }


def batch_search(targets) -> list[dict]:
    cfg = CONFIGS["tiny"]
    model, opt = _model(cfg, "cpu")
    step_at = {}

    def step(b):
        idx = torch.randint(0, cfg["vocab_size"], (b, cfg["seq_len"]))
        _, loss = model(idx, targets=idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(1)

    def peak(b: int) -> int:
        if b not in step_at:
            gc.collect()
            with MemoryTracker(timeline=False, stacks=False, existing="gc") as tr:
                step(b)
            step_at[b] = tr.peak_bytes()
        return step_at[b]

    rows = []
    for target in targets:
        budget = (peak(target) + peak(target + 1)) // 2
        search = llmmem.find_batch_size(step, budget=budget, details=True)

        def fits(b, budget=budget):
            return peak(b) <= budget

        rows.append(
            {
                "largest": target,
                "llmmem": (len(search.trials), search.batch),
                "halving_from_128": _retry_trials(fits, 128, lambda b: b // 2),
                "x0.9_from_128": _retry_trials(fits, 128, lambda b: int(b * 0.9)),
                "binsearch": _binsearch_trials(fits),
            }
        )
    return rows


def _retry_trials(fits, start: int, shrink) -> tuple[int, int]:
    """(trials, batch found) of shrink-after-each-failure from ``start``."""
    b, n = start, 0
    while b >= 1:
        n += 1
        if fits(b):
            return n, b
        b = shrink(b)
    return n, 0


def _binsearch_trials(fits) -> tuple[int, int]:
    """Lightning's binsearch: double from 2 until a failure, then bisect (one trial per size)."""
    n, lo, b = 0, 0, 2
    while True:
        n += 1
        if not fits(b):
            hi = b
            break
        lo, b = b, 2 * b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        n += 1
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return n, lo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier timings)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "cuda" else "cpu"
    names = ["tiny", "small"] if args.quick else ["tiny", "small", "medium"]
    repeats = 3 if args.quick else 7
    overhead = tracking_overhead(names, repeats, device)
    _harness.print_table(
        f"tracking overhead, GPT step on {device} (ratio to the bare step, median of {repeats}, interleaved)",
        ["model", "mode", "step ms", "wall x", "cpu x"],
        [[r["model"], r["mode"], r["step_ms"], r["wall_ratio"], r["cpu_ratio"]] for r in overhead],
    )
    mon = monitor_overhead(repeats, device)
    print(
        f"\nmonitor: {mon['sample_us']:.0f} us per sample = {100 * mon['share_of_a_core_at_1s']:.4f}% of a core at 1 s; "
        f"3 steps with a sample every 50 ms: wall x{mon['loop_wall_ratio_at_50ms']:.3f}, "
        f"cpu x{mon['loop_cpu_ratio_at_50ms']:.3f}"
    )
    targets = [5, 19] if args.quick else [5, 19, 77]
    search = batch_search(targets)
    _harness.print_table(
        "batch-size search: trials / batch found (tiny GPT on the CPU, budget halfway between the largest "
        "batch and one more)",
        ["largest", "llmmem", "halve from 128", "x0.9 from 128", "binsearch"],
        [
            [r["largest"]]
            + [f"{r[k][0]} / {r[k][1]}" for k in ("llmmem", "halving_from_128", "x0.9_from_128", "binsearch")]
            for r in search
        ],
    )
    path = _harness.write_json(
        "diagnostics",
        {"device": device, "threads": args.threads, "overhead": overhead, "monitor": mon, "batch_search": search},
        args.json,
    )
    print(f"\nwrote {path}")
    ok = all(r["llmmem"][1] == r["largest"] and r["llmmem"][0] <= 4 for r in search)
    return 0 if ok and not math.isnan(mon["sample_us"]) else 1


if __name__ == "__main__":
    sys.exit(main())
