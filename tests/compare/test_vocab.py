"""``python -m llmmem compare --preset vocab``: the LM-head rows (the plain head, llmmem.patch_lm_loss,
the planner alone, the fused head with the planner) at their quick size, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from llmmem.__main__ import main
from llmmem.compare.strategies import VOCAB_STRATEGIES, Strategy

KEYS = [s.key for s in VOCAB_STRATEGIES]


def test_vocab_rows_the_fused_head_saves_the_logits_at_the_plain_heads_loss(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmmem",
            "compare",
            "--preset",
            "vocab",
            "--quick",
            "--no-charts",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tempfile.gettempdir(),  # off the checkout: `-m` would import its unbuilt llmmem
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["preset"] == "vocab-quick" and not results["partial"]
    rows = {r["key"]: r for r in results["rows"]}
    assert list(rows) == KEYS
    for key, r in rows.items():  # a result each: measured, or the planner's answer that no plan fits
        assert not r["error"] or r.get("infeasible"), (key, r.get("log"))
    base, fused = rows["baseline"], rows["fused"]
    model = base["model"]
    assert model["vocab_size"] >= 32768
    logits = 4 * base["batch"] * model["seq_len"] * model["vocab_size"]  # the plain head's fp32 logits
    assert base["peak_bytes"] - fused["peak_bytes"] >= 1.5 * logits
    # the byte pairs are learnt from ln(32768) down, and the fused head gives the plain head's losses
    assert base["losses"][-1] < base["losses"][0] < 10.5
    assert len(fused["losses"]) == len(base["losses"])
    for a, b in zip(fused["losses"], base["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert abs(fused["derived"]["loss_ratio"] - 1.0) <= 1e-5
    # patched first, then planned at half its own activation peak: the plan holds, the loss is the same
    both = rows["fused+plan-50"]
    assert both["plan"]["budget_fraction"] == 0.5 and both["activation_bytes"] <= both["plan"]["budget_bytes"]
    assert abs(both["derived"]["loss_ratio"] - 1.0) <= 1e-5
    assert both["peak_bytes"] < fused["peak_bytes"]
    # the planner alone cannot halve activations that are mostly the head's: its least budget is said
    alone = rows["plan-50"]
    if alone.get("infeasible"):
        assert alone["plan"]["least_budget_bytes"] > 0.5 * alone["plan"]["no_checkpoint_peak_bytes"]
    out, md = proc.stdout, (tmp_path / "results.md").read_text()
    for r in rows.values():
        assert r["label"] in out and r["label"] in md
    assert "loss ratio" in md and "targets (what llmmem sets out to reach here)" in out and results["headline"] in out
    targets = {t["target"].split(":")[1].strip(): t["holds"] for t in results["targets"] if ":" in t["target"]}
    assert targets["the step's peak lower by >= 1.5x the logits' bytes"] is True
    assert targets["the loss equal to the plain head's (fp32"] is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "vocab", "--only", "every"], "unknown strategies ['every']"),
        (["--only", "fused"], "unknown strategies ['fused']"),
    ],
)
def test_rows_of_another_preset_are_refused(argv, message, tmp_path, capsys):
    assert main(["compare", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only:") and message in err


@pytest.mark.parametrize("kwargs", [dict(tp=2), dict(bf16_weights=True, optim="fp32")])
def test_a_fused_head_is_refused_where_its_loss_is_not_the_patched_models(kwargs):
    with pytest.raises(ValueError, match="fused_head runs single-process rows without bf16_weights"):
        Strategy("x", "x", fused_head=True, **kwargs)
