"""The examples run as a user would run them."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_estimate_sweep_runs_and_never_grows():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "estimate_sweep.py"), "gpt2-xl", "--seq", "1024"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    totals = []
    for line in proc.stdout.splitlines()[2:]:
        sizes = re.findall(r"([\d.]+) (B|KiB|MiB|GiB|TiB)", line)
        scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
        totals.append(float(sizes[2][0]) * scale[sizes[2][1]])
    assert len(totals) == 7
    assert all(b <= a * 1.0001 for a, b in zip(totals, totals[1:])), totals
    assert totals[-1] < totals[0] / 4
