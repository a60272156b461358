"""``python -m llmmem compare --preset finetune``: the model-state rows (torch AdamW, llmmem AdamW
with int8 moments, bf16 weights with stochastic rounding, the step in backward, and all of them with
the planner) at their quick sizes, the largest model fitted and verified, and --resume over them."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from llmmem.__main__ import main
from llmmem.compare.finetune import fit_line
from llmmem.compare.measure import search_largest
from llmmem.compare.strategies import FINETUNE_STRATEGIES, Strategy

KEYS = [s.key for s in FINETUNE_STRATEGIES]


def _compare(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "llmmem", "compare", "--preset", "finetune", "--quick", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),  # off the checkout: `-m` would import its unbuilt llmmem
    )


def test_finetune_rows_measure_the_model_state_and_the_largest_model(tmp_path):
    proc = _compare("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["preset"] == "finetune-quick" and not results["partial"]
    rows = {r["key"]: r for r in results["rows"]}
    assert list(rows) == KEYS and not any(r["error"] for r in rows.values())
    base, params = rows["baseline"], rows["baseline"]["params"]
    # bytes a parameter when a step starts: weight + gradient + moments (4 + 4 + 8 for the baseline)
    per_param = {k: r["state_bytes_per_param"] for k, r in rows.items()}
    assert 16.0 <= per_param["baseline"] < 16.1
    assert 12.0 <= per_param["bf16-weights"] < 12.1  # 2 + 2 + 8
    assert 12.0 <= per_param["step-in-backward"] < 12.1  # 4 + 0 + 8
    assert per_param["int8-state"] < 10.5  # 4 + 4 + 2 (+ fp32 moments of the small tensors)
    assert per_param["lean"] < 4.5  # 2 + 0 + 2
    assert base["peak_bytes"] - rows["step-in-backward"]["peak_bytes"] >= 0.9 * 4 * params
    for key, r in rows.items():
        assert abs(r["derived"]["loss_ratio"] - 1.0) < 0.05, key
        s = r["search"]
        assert s["kind"] == "model" and s["exact"], (key, s)
        trials = dict(s["trials"])
        assert s["largest_peak_bytes"] <= s["cap_bytes"] < trials[s["largest"] + 1], (key, s)
        assert s["fit"]["bytes_per_param"] > 0 and s["predicted_layers"] >= 1
    assert base["search"]["largest"] == base["model"]["layers"]  # its own peak is the cap
    lean = rows["lean"]
    assert (
        lean["plan"]["budget_fraction"] == 0.5 and lean["plan"]["least_budget_bytes"] <= lean["plan"]["budget_bytes"]
    )
    assert lean["search"]["largest_params"] > 2 * params
    out = proc.stdout
    assert "loss ratio" in out and "state B/param" in out and "targets (what llmmem sets out to reach here)" in out
    assert results["headline"] in out and "verified by running it" in results["headline"]
    assert results["headline"] in (tmp_path / "results.md").read_text()
    assert {t["target"].split(":")[0] for t in results["targets"]} >= {"step in backward", "int8 state"}
    for name in ("memory_timeline.png", "saved_vs_overhead.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # an interrupted run (the last row not yet written) resumed: only that row runs again
    partial = dict(results, partial=True, rows=results["rows"][:-1])
    (tmp_path / "results.json").write_text(json.dumps(partial))
    proc = _compare("--out", str(tmp_path), "--no-charts", "--resume")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "resuming: 4 row(s)" in proc.stdout and "lean" in proc.stdout.split("resuming")[1]
    again = {r["key"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert list(again) == KEYS
    for key in KEYS[:-1]:
        assert again[key]["peak_bytes"] == rows[key]["peak_bytes"] and again[key]["losses"] == rows[key]["losses"]
    assert again["lean"]["search"]["exact"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "finetune", "--only", "every"], "unknown strategies ['every']"),
        (["--only", "lean"], "unknown strategies ['lean']"),
    ],
)
def test_rows_of_another_preset_are_refused(argv, message, tmp_path, capsys):
    assert main(["compare", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only:") and message in err


def test_the_fit_and_the_search_use_both_measured_depths():
    assert fit_line([(300, 4900), (100, 1700)]) == (16.0, 100.0)
    with pytest.raises(ValueError, match="two different"):
        fit_line([(100, 1), (100, 2)])
    # peaks 16 B a layer: a line through the known depth and the start reaches the cap at 6 layers
    peaks = {n: 16 * n for n in range(1, 40)}
    ran = []

    def peak_at(n):
        ran.append(n)
        return peaks[n]

    found = search_largest(peak_at, start=4, start_peak=64, cap=100, trials=3, kind="layers", known={8: 128})
    assert found["largest"] == 6 and found["exact"] and found["trials"] == [[6, 96], [7, 112]]
    # without the known depth the first guess doubles the start
    ran.clear()
    search_largest(peak_at, start=4, start_peak=64, cap=100, trials=1, kind="layers")
    assert ran == [8]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bf16_weights=True), "needs an llmmem optim"),
        (dict(optim="int3"), "optim must be one of"),
        (dict(step_in_backward=True, amp="fp16"), "refuses an fp16 scaler"),
        (dict(step_in_backward=True, tp=2), "single-process rows only"),
        (dict(checkpoint="auto", budget_fraction=1.5), "budget_fraction in (0, 1]"),
        (dict(checkpoint="auto"), "budget_fraction goes with"),
    ],
)
def test_strategy_settings_that_cannot_train_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Strategy("x", "x", **kwargs)
