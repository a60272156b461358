"""What every llmmem benchmark shares: timing by median of repeats, ratios, tables, JSON.

Timing on shared machines is noisy, so a benchmark never reports a bare time: it reports the
ratio of llmmem against a baseline measured in the same run (and, where one applies, against the
physical limit, e.g. the copy bandwidth measured in the same run). CUDA work is timed with events
after a synchronize; CPU work with perf_counter.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_fn(
    fn: Callable[[], object], *, repeats: int = 7, warmup: int = 2, device: str = "cpu", inner: int = 1
) -> dict:
    """Median, min and max seconds of one call of ``fn`` over ``repeats`` samples.

    Each sample runs ``fn`` ``inner`` times (use it for calls far shorter than a millisecond).
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples), "repeats": repeats}


# A benchmark run in spawned ranks (llmmem.parallel.ranks.run_ranks) gets rank 0's result back
# through that rank's output, as one marked JSON line.
_RANK_MARK = "BENCH_JSON "


def print_rank_result(payload: object) -> None:
    print(_RANK_MARK + json.dumps(payload), flush=True)


def rank_result(output: str) -> object:
    """The payload a rank printed with print_rank_result."""
    line = next(ln for ln in output.splitlines() if ln.startswith(_RANK_MARK))
    return json.loads(line[len(_RANK_MARK) :])


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def write_json(name: str, payload: dict, path: str | None = None) -> str:
    """Writes ``payload`` (plus machine facts) to ``path`` or benchmarks/results/<name>.json."""
    path = path or os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    with open(path, "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=2, default=str)
    return path
