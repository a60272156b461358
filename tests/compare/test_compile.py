"""``python -m llmmem compare --preset compile``: checkpointing under ``torch.compile`` (issue 25),
end to end at the quick size (inductor), and its table and targets on synthetic rows."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from llmmem.__main__ import main
from llmmem.compare import report
from llmmem.compare.strategies import COMPILE_QUICK_KEYS, COMPILE_STRATEGIES, Strategy, strategies_of

MiB = 2**20


def test_quick_compile_rows_train_as_the_eager_baseline_and_are_measured(tmp_path):
    pytest.importorskip("torch._dynamo", reason="needs torch.compile")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmmem",
            "compare",
            "--preset",
            "compile",
            "--quick",
            "--no-charts",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,  # inductor compiles each row's forward and backward on one core
        cwd=tempfile.gettempdir(),  # off the checkout: `-m` would import its unbuilt llmmem
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["preset"] == "compile-quick" and not results["partial"]
    rows = {r["key"]: r for r in results["rows"]}
    assert tuple(rows) == COMPILE_QUICK_KEYS
    for key, r in rows.items():
        assert not r["error"] or r.get("infeasible"), (key, r.get("log"))
    base = rows["baseline"]
    assert not base["strategy"]["compile"]
    for key, r in rows.items():
        if r.get("error"):
            continue
        # measured outside the dispatcher, every row alike: the resident set's rise over the step
        assert r["memory"] == "resident" and "timeline" not in r
        assert r["memory_apart"]  # in a process of its own: its mapping would slow the timed steps
        assert r["activation_bytes"] > 0 and r["peak_bytes"] > r["start_bytes"] > 0
        assert len(r["losses"]) == len(base["losses"])
        for a, b in zip(r["losses"], base["losses"]):
            assert abs(a - b) <= report.COMPILE_LOSS_TOLERANCE * abs(b), key
        assert "search" not in r  # a new batch would be a new compilation
    assert rows["compile+amb-50"]["plan"] == {"budget_fraction": 0.5, "by": "activation_memory_budget"}
    if not rows["compile+plan-50"].get("error"):
        assert rows["compile+plan-50"]["plan"]["budget_fraction"] == 0.5
        # the plan compiled its blocks with the row's backend, and runs as made
        assert rows["compile+plan-50"]["plan"]["compile_blocks"] == {"backend": "inductor"}
        assert "compile_changes" not in rows["compile+plan-50"]["plan"]
    targets = results["targets"]
    assert all(t["holds"] in (True, False, None) for t in targets)
    computed = {t["target"]: t["holds"] for t in targets if "50%" in t["target"] or "compiled rows" in t["target"]}
    # measured, whether they hold or not; the step time is not judged on the quick run's two pairs
    assert len(computed) == 4, targets
    assert [k for k, v in computed.items() if v is None] == [
        "compile + llmmem plan 50%: step time <= compile + activation_memory_budget 0.50's"
    ], targets
    out = proc.stdout
    assert "targets (what llmmem sets out to reach here)" in out and "resident set" in out
    for r in rows.values():
        assert r["label"] in out


def _row(
    key, *, peak, act, overhead=0.0, losses=(2.0, 1.5, 1.2), budget=None, error=None, infeasible=False, spread=0.01
):
    s = next(s for s in COMPILE_STRATEGIES if s.key == key)
    row = {
        "key": key,
        "label": s.label,
        "preset": "compile",
        "strategy": s.to_dict(),
        "world": 1,
        "error": error,
        "peak_bytes": peak * MiB,
        "start_bytes": 1 * MiB,
        "activation_bytes": act * MiB,
        "step_time": 0.01 * (1 + overhead / 100),
        "cpu_step_time": 0.01 * (1 + overhead / 100),
        "relative_cpu_step_time": 1 + overhead / 100,
        "relative_step_time": 1 + overhead / 100,
        "relative_cpu_step_time_spread": spread,
        "relative_step_time_spread": spread,
        "losses": list(losses),
        "final_loss": losses[-1],
        "params": 1000,
        "params_per_rank": 1000,
        "memory": "resident",
    }
    if infeasible:
        row["infeasible"] = True
    if budget is not None:
        row["plan"] = {"budget_bytes": int(budget * MiB), "budget_fraction": s.budget_fraction}
    if s.checkpoint == "torch-budget":
        row["plan"] = {"budget_fraction": s.budget_fraction, "by": "activation_memory_budget"}
    return row


def _targets(rows):
    rows = report.derive(rows, "cpu")
    assert report.preset_family(rows) == "compile"
    return {t["target"]: t for t in report.check_preset_targets(rows)}, rows


def _holds(targets, start):
    (t,) = [t for name, t in targets.items() if name.startswith(start)]
    return t["holds"]


def test_compile_targets_compare_the_plan_with_its_budget_and_with_torchs_planner():
    rows = [
        _row("baseline", peak=9, act=8),
        _row("compile", peak=10, act=9, overhead=-40, losses=(2.0, 1.5, 1.2000001)),
        _row("compile+amb-50", peak=6, act=5, overhead=-30),
        _row("compile+plan-50", peak=5, act=4, overhead=-35, budget=4.5),
        _row("compile+amb-25", peak=4, act=3, overhead=-20),
        _row("compile+plan-25", peak=4.5, act=3.5, overhead=-10, budget=2.0),
    ]
    targets, rows = _targets(rows)
    assert _holds(targets, "compiled rows: the loss") is True
    assert _holds(targets, "compile + llmmem plan 50%: measured activation peak") is True
    assert _holds(targets, "compile + llmmem plan 50%: peak") is True
    assert _holds(targets, "compile + llmmem plan 50%: step time") is True
    # at 25% the plan is over its budget, above torch's peak and slower: each is said, not hidden
    assert _holds(targets, "compile + llmmem plan 25%: measured activation peak") is False
    assert _holds(targets, "compile + llmmem plan 25%: peak") is False
    assert _holds(targets, "compile + llmmem plan 25%: step time") is False
    # too few pairs for a spread (--quick): the step time is not judged
    quick = [dict(r, relative_cpu_step_time_spread=None, relative_step_time_spread=None) for r in rows]
    assert _holds(_targets(quick)[0], "compile + llmmem plan 25%: step time") is None
    text = report.table(rows)
    assert text.splitlines()[0].split()[:2] == ["strategy", "peak"] and "budget" in text.splitlines()[0]
    assert "0.50 (torch)" in text and "0.50 = 4.50 MiB" in text and "0.25 = 2.00 MiB" in text
    assert "| worst step rel. diff |" in report.markdown(rows)


def test_compile_targets_say_what_is_missing_failed_or_strays():
    rows = [
        _row("baseline", peak=9, act=8),
        _row("compile", peak=10, act=9, losses=(2.0, 1.5, 1.3)),  # a loss 8% off the eager one
        _row("compile+amb-50", peak=6, act=5),
        _row(
            "compile+plan-50", peak=0, act=0, error="infeasible: no plan fits 50% (least budget 60%)", infeasible=True
        ),
        _row("compile+amb-25", peak=0, act=0, error="RuntimeError: inductor failed"),
    ]
    targets, rows = _targets(rows)
    assert _holds(targets, "compiled rows: the loss") is False
    assert _holds(targets, "compile + llmmem plan 50%: measured activation peak") is False
    assert _holds(targets, "compile + llmmem plan 50%: peak") is False
    assert _holds(targets, "compile + llmmem plan 25%: peak") is None  # not run
    assert "row compile+plan-25 not run" in [t for n, t in targets.items() if "25%: peak" in n][0]["detail"]
    text = report.table(rows)
    assert "infeasible" in text and "failed" in text
    assert "compile + activation_memory_budget 0.25: RuntimeError: inductor failed" in text


def test_the_quick_preset_keeps_the_rows_of_the_targets_at_half():
    quick = strategies_of("compile-quick")
    assert tuple(s.key for s in quick) == COMPILE_QUICK_KEYS
    assert len(quick) < len(strategies_of("compile"))
    assert {"compile+amb-50", "compile+plan-50"} <= set(COMPILE_QUICK_KEYS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(checkpoint="torch-budget", budget_fraction=0.5), "needs compile=True"),
        (dict(checkpoint="torch-budget", budget_fraction=1.5, compile=True), r"budget_fraction in \(0, 1\]"),
        (dict(checkpoint="torch-budget", compile=True), "budget_fraction goes with"),
        (dict(compile=True, tp=2), "compile runs single-process rows"),
        (dict(compile=True, checkpoint="plan", budget_fraction=0.5), "compile runs single-process rows"),
        (dict(compile=True, checkpoint="offload"), "compile runs single-process rows"),
    ],
)
def test_compiled_strategies_that_make_no_sense_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Strategy("x", "x", **kwargs)


def test_rows_of_another_preset_are_refused(tmp_path, capsys):
    assert main(["compare", "--preset", "compile", "--only", "every", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only:") and "unknown strategies ['every']" in err
