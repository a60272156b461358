"""``python -m llmmem compare`` end to end (two strategies of the quick run), and its usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest


def _compare(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "llmmem", "compare", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),  # off the checkout: `-m` would import its unbuilt llmmem
    )


def test_compare_writes_table_json_markdown_and_charts(tmp_path):
    proc = _compare("--quick", "--only", "every+bf16", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    assert "fp32 baseline" in out and "llmmem.checkpoint every layer + bf16" in out
    assert "targets (what llmmem sets out to reach here)" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["key"] for r in results["rows"]] == ["baseline", "every+bf16"]
    row = results["rows"][1]
    assert row["derived"]["activation_change_pct"] < -50  # measured, in this run
    assert row["derived"]["max_batch"] > results["rows"][0]["derived"]["max_batch"]
    assert {t["target"].split(":")[0] for t in results["targets"]}  # every target is reported
    md = (tmp_path / "results.md").read_text()
    assert md.count("\n|") >= 3 and "largest batch" in md
    for name in ("memory_timeline.png", "saved_vs_overhead.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # the table and the charts again from results.json, without re-running
    again = tmp_path / "again"
    again.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "llmmem.compare.report", str(tmp_path / "results.json"), str(again)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "llmmem.checkpoint every layer + bf16" in proc.stdout
    assert (again / "memory_timeline.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "nonsense"], "unknown strategies"),
        (["--steps", "2"], "expected an integer >= 3"),
        (["--threads", "0"], "expected a positive integer"),
        (["--timer", "sundial"], "invalid choice"),
    ],
)
def test_bad_flags_are_usage_errors(args, message):
    proc = _compare(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_every_strategy():
    proc = _compare("--help", timeout=60)
    assert proc.returncode == 0
    from llmmem.compare.strategies import STRATEGIES

    for s in STRATEGIES:
        assert s.key in proc.stdout
