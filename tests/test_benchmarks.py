"""Benchmark scripts run (tiny sizes, one or two rounds): the planner's and the LM head's back the
figures of benchmarks/README.md, and nothing else would notice them break."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytest.importorskip("transformers", reason="the Hugging Face benchmarks need transformers")


def _run(script: str, *argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tempfile.gettempdir(),  # the installed llmmem, not the source tree's
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_recompute_in_context_prints_each_mode_beside_its_pieces():
    out = _run(
        "recompute_in_context.py", "llama", "sdpa", "--rounds", "2", "--batch", "1", "--hidden", "16", "--seq", "8"
    )
    assert "one recompute inside the model" in out and "null-block bookkeeping" in out
    assert "recompute-cheap, per layer: adds" in out and "plan at 50%" in out


def test_hf_bench_reports_an_infeasible_budget_and_goes_on(tmp_path):
    path = tmp_path / "checkpoint.json"
    out = _run(
        "bench_checkpointing.py",
        "--hf", "llama", "--quick", "--skip-chain", "--skip-solver",
        "--batch", "1", "--hidden", "16", "--seq", "8", "--json", str(path),
    )  # fmt: skip
    assert "no plan fits" in out  # 25% is below the least feasible budget at this size
    rows = json.loads(path.read_text())["hf"]
    assert rows and all(r["measured_peak_bytes"] <= r["budget_bytes"] for r in rows)


def test_head_bench_quick_compares_every_eager_candidate_with_torch(tmp_path):
    path = tmp_path / "head.json"
    out = _run("bench_head.py", "--quick", "--profile", "--json", str(path))
    assert "torch.compile: skipped" in out  # compiling is left out of --quick
    assert "llmmem, one call profiled" in out
    rows = {r["candidate"]: r for r in json.loads(path.read_text())["results"]["n256-h64-v4k"]}
    for name in ("torch", "llmmem", "llmmem none->mean"):
        r = rows[name]
        assert abs(r["loss_minus_torch"]) < 1e-4 and r["grad_rel_diff"] < 1e-4, r
        assert r["live_peak_bytes"] > 0 and r["time_vs_torch"] > 0
    assert rows["llmmem"]["live_peak_bytes"] < rows["torch"]["live_peak_bytes"]
