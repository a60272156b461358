"""Diagnostics: the host memory the tracker keeps per tensor storage.

``tracemalloc`` (Python allocations only: the records, weak references, dictionaries, and the
storage's Python object, which counting makes) over N small storages made inside a
``MemoryTracker`` and kept alive, minus the same storages made without one: bytes per live
storage; then N made and freed inside a tracker: what a timeline keeps per storage ever made. The
storages take seven shapes in turn, as a model's tensors repeat theirs. A tracker alone, and
``LiveBytes`` (the counter under it) alone.

python benchmarks/run.py --only tracker_memory [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness
import torch

from llmmem.diagnostics.live import LiveBytes
from llmmem.diagnostics.tracker import MemoryTracker


def _python_bytes(make_counter, n: int, free: bool) -> int:
    """Python bytes still allocated after making ``n`` storages (kept, or freed when ``free``) inside
    ``make_counter()`` (``None``: no counter)."""
    gc.collect()
    keep: list = []
    counter = make_counter()
    if counter is not None:
        counter.__enter__()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(n):
        keep.append(torch.empty(1 + i % 7))
    if free:
        keep.clear()
    if counter is not None:
        (counter.live if hasattr(counter, "live") else counter).flush()
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    if counter is not None:
        counter.__exit__(None, None, None)
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


def storage_memory(n: int) -> list[dict]:
    bare = _python_bytes(lambda: None, n, False)
    rows = [
        {
            "counter": "LiveBytes",
            "per_live_storage": (_python_bytes(LiveBytes, n, False) - bare) / n,
            "per_freed_storage": _python_bytes(LiveBytes, n, True) / n,
        }
    ]
    for timeline in (False, True):
        for stacks in (False, True):
            make = lambda: MemoryTracker(timeline=timeline, stacks=stacks)  # noqa: E731
            rows.append(
                {
                    "counter": f"MemoryTracker(timeline={timeline}, stacks={stacks})",
                    "per_live_storage": (_python_bytes(make, n, False) - bare) / n,
                    "per_freed_storage": _python_bytes(make, n, True) / n,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="ignored: host memory is measured")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    n = 5000 if args.quick else 20000
    rows = storage_memory(n)
    _harness.print_table(
        f"host bytes the counter keeps per storage ({n} storages, tracemalloc)",
        ["counter", "per live storage", "per storage made and freed"],
        [[r["counter"], round(r["per_live_storage"]), round(r["per_freed_storage"])] for r in rows],
    )
    path = _harness.write_json("tracker_memory", {"storages": n, "rows": rows}, args.json)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
