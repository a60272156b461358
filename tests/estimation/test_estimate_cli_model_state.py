"""``python -m llmmem estimate`` with llmmem.optim's model state (issue 23, items 5 and 6): the
question users ask, "does a full-parameter fine-tune of a 7B model fit one 24 GiB GPU, and what is
left for activations?", answered with the same numbers as the API; the flags and their errors."""

from __future__ import annotations

import json
import re

import pytest

import llmmem
from llmmem.__main__ import main
from llmmem.units import format_bytes

LEAN = ["--optim", "adamw-int8", "--bf16-weights", "--step-in-backward", "--checkpoint", "all"]


def _api(seq: int, optimizer: str):
    return llmmem.estimate(
        "llama-7b",
        batch=1,
        seq=seq,
        precision="bf16",
        optimizer=optimizer,
        step_in_backward=True,
        checkpointing="full",
        device_memory="24GiB",
    )


@pytest.mark.parametrize("seq", [2048, 4096])
@pytest.mark.parametrize("state", ["int8", "int4"])
def test_the_7b_on_24gib_question_is_answered(seq, state, capsys):
    argv = ["estimate", "llama-7b", "--batch", "1", "--seq", str(seq), *LEAN, "--device-memory", "24GiB"]
    argv[argv.index("adamw-int8")] = f"adamw-{state}"
    assert main(argv) == 0
    out = capsys.readouterr().out
    est = _api(seq, f"adamw-{state}")
    assert f"{est.total:,}" in out and f"{est.optimizer_state:,}" in out and f"{est.gradients:,}" in out
    assert "step in backward: the largest tensor's only (131,072,000 elements x 2 B)" in out
    assert "none: bf16 weights updated with stochastic rounding" in out
    assert f"llmmem.optim {state} moments" in out and "all 32 layers (full)" in out
    verdict = next(line for line in out.splitlines() if line.startswith("device memory 24.00 GiB"))
    assert ("does NOT fit" in verdict) == (not est.fits) and ("fits" in verdict) == est.fits
    left = next(line for line in out.splitlines() if line.startswith("model state "))
    assert format_bytes(est.model_state) in left
    if est.device_memory > est.model_state:
        assert f"{format_bytes(est.device_memory - est.model_state)} left for activations" in left
    else:
        assert "nothing left for activations" in left


def test_aliases_and_flags_are_the_api_s_arguments(capsys):
    assert main(["estimate", "llama-7b", *LEAN, "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    long = [
        "estimate",
        "llama-7b",
        "--optimizer",
        "adamw-int8",
        "--precision",
        "bf16",
        "--step-in-backward",
        "--checkpointing",
        "full",
        "--json",
    ]
    assert main(long) == 0
    assert json.loads(capsys.readouterr().out) == short
    assert short["settings"]["checkpointing"] == "full" and short["settings"]["master_weights"] is False
    api = llmmem.estimate("llama-7b", precision="bf16", optimizer="adamw-int8", step_in_backward=True, checkpointing=1)
    assert short["bytes"] == api.to_dict()["bytes"]
    argv = ["estimate", "llama-7b", "--optim", "adamw-int4", "--block-size", "64", "--min-quantized-numel", "0"]
    assert main([*argv, "--master-weights", "--bf16-weights", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    api = llmmem.estimate(
        "llama-7b", precision="bf16", optimizer="adamw-int4", master_weights=True, block_size=64, min_quantized_numel=0
    )
    assert d["bytes"] == api.to_dict()["bytes"] and d["bytes"]["master_weights"] > 0


def test_the_table_without_device_memory_still_adds_up(capsys):
    assert main(["estimate", "gpt2", "--optim", "adamw-int8", "--bf16-weights"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"  (\S.*?)\s{2,}\S+ \S+\s+([\d,]+)", line)
        if m:
            rows[m.group(1)] = int(m.group(2).replace(",", ""))
    state = sum(rows[k] for k in ("parameters", "gradients", "master weights", "optimizer state"))
    assert rows["total"] == state + rows["activations"] + rows["largest temporary"]
    assert "tensors under 4096 elements keep fp32" in out  # GPT-2's biases and norms


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--bf16-weights", "--precision", "fp32"], ["--bf16-weights", "precision bf16", "fp32"]),
        (["--optim", "adamw-int2"], ["optimizer", "adamw-int2"]),
        (["--optim", "adamw-int8", "--block-size", "100"], ["block_size", "power of two"]),
        (["--block-size", "256"], ["block_size", "quantized llmmem optimizers"]),
        (["--step-in-backward", "--data-parallel", "2"], ["step_in_backward", "one data-parallel rank"]),
        (["--optim", "adamw-int8", "--precision", "fp32", "--master-weights"], ["master_weights", "fp32"]),
        (["--no-master-weights"], ["master_weights", "torch optimizer"]),
        (["--checkpoint", "most"], ["checkpointing", "full (or all)"]),
    ],
)
def test_bad_model_state_flags_give_one_line(argv, words, capsys):
    assert main(["estimate", "llama-7b", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
