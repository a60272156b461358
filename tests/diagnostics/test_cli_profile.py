"""`python -m llmmem profile`: one step of a named model (llmmem's GPT, or a Hugging Face model
from a config) under the tracker, the table beside the estimate, the PNG and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest
from support.procs import run_python

from llmmem.__main__ import main


def test_profile_gpt_prints_the_table_beside_the_estimate(tmp_path, capsys):
    png, out_json = tmp_path / "m.png", tmp_path / "m.json"
    code = main(["profile", "--model", "gpt-tiny", "--batch", "2", "--png", str(png), "--json", str(out_json)])
    assert code == 0
    out = capsys.readouterr().out
    assert "gpt-tiny (llmmem GPT" in out and "MemoryTracker on cpu" in out
    assert "top 10 modules" in out and "GPT.blocks.0" in out
    assert "measured vs llmmem.estimate(model, batch=2, seq=64, precision=fp32, optimizer=adamw" in out
    # the prediction comes first, checked against what the host can still give
    assert out.startswith("llmmem.estimate predicts a peak of ") and "  within the " in out
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
        (["--hf", "llama", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
        (["--hf", "llama", "--kv-heads", "0"], "--kv-heads"),
        (["--kv-heads", "2"], "grouped key/value heads need --hf llama"),  # llmmem's GPT would ignore it
        (["--hf", "gpt2", "--kv-heads", "2"], "grouped key/value heads need --hf llama"),
        (["--hf", "llama", "--ffn", "0"], "--ffn"),
        (["--seed", str(2**64)], "--seed"),
        (["--json", "/nonexistent-llmmem-folder/m.json"], "--json: cannot write"),
        (["--json", "/proc/llmmem-m.json"], "--json: cannot write"),  # not creatable, even by root
    ],
)
def test_bad_arguments_are_one_clear_line(argv, match, capsys):
    assert main(["profile", "--no-png", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("error: ") and match in err and "Traceback" not in err
    assert "llmmem.estimate predicts" not in captured.out  # refused before any work


@pytest.mark.parametrize("where", ["folder", "missing", "under-a-file", "suffix"])
def test_png_paths_are_checked_before_the_run(where, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    png = {
        "folder": tmp_path,
        "missing": tmp_path / "no" / "m.png",
        "under-a-file": tmp_path / "a-file" / "m.png",
        "suffix": tmp_path / "m",  # matplotlib would write m.png and the run report "wrote m"
    }[where]
    assert main(["profile", "--png", str(png)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: --png") and "llmmem.estimate predicts" not in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


# Each case runs main() in one fresh interpreter whose RLIMIT_DATA (3 GiB) stands in for the
# machine's memory, and is what llmmem reads: a run that would take the machine's memory fails at
# its first large allocation instead of bringing the OOM killer (as in the report, a 10 GB causal
# mask per layer, built even with sdpa). One interpreter for all: torch is imported once.
_LIMITED = {
    "seq": ["--seq", "100000"],
    "seq-sdpa": ["--seq", "100000", "--attention", "sdpa"],
    "batch": ["--batch", "100000"],
    "force": ["--seq", "100000", "--batch", "1", "--force"],
    "layers": ["--layers", "200000"],  # sized from the config: even a meta-device model takes minutes
}


@pytest.fixture(scope="module")
def limited_runs():
    code = f"""
    import contextlib, io, json, resource, traceback
    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    from llmmem.__main__ import main
    results = {{}}
    for name, argv in {_LIMITED!r}.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["profile", "--no-png", *argv])
            except BaseException:
                traceback.print_exc()
                code = "raised"
        results[name] = dict(code=code, out=out.getvalue(), err=err.getvalue())
    print(json.dumps(results))
    """
    proc = run_python(code, env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["seq", "seq-sdpa", "batch"])
def test_a_run_that_cannot_fit_is_refused_with_the_prediction(case, limited_runs):
    run = limited_runs[case]
    assert run["code"] == 2, run
    assert "Traceback" not in run["err"]
    assert run["out"].startswith("llmmem.estimate predicts a peak of ")
    err = run["err"].strip()
    assert err.startswith("error: llmmem.estimate predicts a peak of ") and err.count("\n") == 0
    assert "(RLIMIT_DATA)" in err and "--force" in err


def test_a_model_whose_state_cannot_fit_is_refused_before_it_is_built(limited_runs):
    run = limited_runs["layers"]
    assert run["code"] == 2 and "Traceback" not in run["err"], run
    assert "the model's state alone does not fit" in run["err"]


def test_force_runs_anyway_and_an_out_of_memory_is_one_line(limited_runs):
    run = limited_runs["force"]
    assert run["code"] == 1, run
    assert "--force: running although" in run["out"]
    assert run["err"].startswith("error: out of memory in the training step") and "Traceback" not in run["err"]


@pytest.mark.cuda
def test_a_cuda_device_that_is_not_there_is_one_line(capsys):
    import torch

    assert main(["profile", "--no-png", "--device", f"cuda:{torch.cuda.device_count()}"]) == 2
    assert "CUDA device(s)" in capsys.readouterr().err


@pytest.mark.parametrize("hf", [None, "llama", "gpt2"])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_the_run_is_sized_from_its_config_as_from_its_model(hf, attention):
    # profile estimates from the config, before anything is built: the same settings and figures
    # as from the model built from it
    import torch

    import llmmem
    from llmmem.diagnostics.advice import estimate_settings
    from llmmem.diagnostics.profile_cli import SMALL_MODELS, build_config, model_from_config

    if hf is not None:
        pytest.importorskip("transformers", reason="transformers is not installed")
    config = build_config(dict(SMALL_MODELS["gpt-tiny"], name="gpt-tiny"), hf, attention)
    with torch.device("meta"):
        model = model_from_config(config)
    opt = torch.optim.AdamW(model.parameters())
    kw = dict(batch=2, seq=64, optimizer=opt, autocast_dtype=torch.bfloat16)
    settings = estimate_settings(config, **kw)
    assert settings == estimate_settings(model, **kw) and settings["attention"] == attention
    a, b = (llmmem.estimate(x, **settings).to_dict() for x in (config, model))
    a["model"].pop("name"), b["model"].pop("name")  # the class's name: GPTConfig vs GPT
    assert a == b
