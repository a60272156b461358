"""The examples run as a user would run them."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from llmmem.units import parse_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_estimate_sweep_runs_and_never_grows():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "estimate_sweep.py"), "gpt2-xl", "--seq", "1024"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    totals = []
    for line in proc.stdout.splitlines()[2:]:
        sizes = re.findall(r"[\d.]+ (?:B|KiB|MiB|GiB|TiB)", line)  # as format_bytes prints them
        totals.append(parse_bytes(sizes[2]))
    assert len(totals) == 7
    assert all(b <= a * 1.0001 for a, b in zip(totals, totals[1:])), totals
    assert totals[-1] < totals[0] / 4
