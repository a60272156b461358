"""`python -m llmmem profile`: one step of a named model (llmmem's GPT, or a Hugging Face model
from a config) under the tracker, the table beside the estimate, the PNG and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from llmmem.__main__ import main


def test_profile_gpt_prints_the_table_beside_the_estimate(tmp_path, capsys):
    png, out_json = tmp_path / "m.png", tmp_path / "m.json"
    code = main(["profile", "--model", "gpt-tiny", "--batch", "2", "--png", str(png), "--json", str(out_json)])
    assert code == 0
    out = capsys.readouterr().out
    assert "gpt-tiny (llmmem GPT" in out and "MemoryTracker on cpu" in out
    assert "top 10 modules" in out and "GPT.blocks.0" in out
    assert "measured vs llmmem.estimate(model, batch=2, seq=64, precision=fp32, optimizer=adamw" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(out_json.read_text())
    rows = {r["what"]: r for r in data["comparison"]}
    # parameters, gradients, optimizer state: exact counts against the estimator's formulas
    grads = rows["gradients (most at once)"]
    assert grads["measured"] == grads["estimate"]
    assert rows["optimizer state"]["measured"] >= rows["optimizer state"]["estimate"]  # + Adam's step counters
    act = rows["activations kept at backward start"]
    assert abs(act["measured"] - act["estimate"]) <= 0.05 * act["estimate"]
    assert data["tracker"]["peak"]["bytes"] == rows["peak (estimate: all terms at once)"]["measured"]


@pytest.mark.parametrize("hf", ["llama", "gpt2"])
def test_profile_hugging_face(tmp_path, capsys, hf):
    pytest.importorskip("transformers", reason="transformers is not installed")
    code = main(["profile", "--model", "gpt-tiny", "--hf", hf, "--batch", "2", "--seq", "32", "--no-png"])
    assert code == 0
    out = capsys.readouterr().out
    root = "LlamaForCausalLM" if hf == "llama" else "GPT2LMHeadModel"
    assert f"Hugging Face {hf}" in out and root in out and "measured vs llmmem.estimate" in out


def test_profile_runs_as_a_command():
    proc = subprocess.run(
        [sys.executable, "-m", "llmmem", "profile", "--model", "gpt-tiny", "--batch", "1", "--steps", "2", "--no-png"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tempfile.gettempdir(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 step(s)" in proc.stdout


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "gpt-huge"], "unknown model"),
        (["--batch", "0"], "--batch"),
        (["--heads", "5"], "--heads"),
        (["--dropout", "1.5"], "--dropout"),
        (["--device", "tpu"], "--device"),
        (["--model", "llama-7b"], "--hf llama"),
        (["--warmup", "-1"], "--warmup"),
    ],
)
def test_bad_arguments_are_one_clear_line(argv, match, capsys):
    assert main(["profile", "--no-png", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and "Traceback" not in err
