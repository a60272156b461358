"""The examples run as a user would run them."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from support.train_gpt import SMALL, TRAIN, captured_runs, load_example, main_runs, run_code, run_ranks_here

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


# ------------------------------------------------------------------------------------------------
# examples/train_gpt.py


def _train(*args, timeout=300, env=None):
    return subprocess.run(
        [sys.executable, str(TRAIN), *SMALL, "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "0.5"], "--budget goes with --checkpoint auto"),
        (["--checkpoint", "auto", "--budget", "lots"], "--budget"),
        (["--checkpoint", "sometimes"], "invalid choice"),
        (["--offload"], "add --checkpoint"),
        (["--tp", "2"], "needs 2 processes"),
        (["--sequence-parallel"], "needs --tp > 1"),
        (["--batch", "3", "--grad-accum", "2"], "must be divisible"),
        (["--heads", "3"], "must divide --hidden"),
        (["--save-every", "2"], "needs --save"),
        (["--steps", "0"], "positive integer"),
        (["--dropout", "1.5"], "--dropout"),
        (["--lr", "-1"], "positive number"),
        (["--lr", "nan"], "positive number"),
        (["--save", str(TRAIN)], "not a folder"),
        (["--budget", "0", "--checkpoint", "auto"], "--budget"),
        (["--grad-accum", "0"], "positive integer"),
        (["--amp", "fp8"], "invalid choice"),
        (["--model", "gpt3"], "invalid choice"),
        (["--optim", "sgd"], "invalid choice"),
        (["--step-in-backward", "--grad-accum", "2"], "gradient accumulation (--grad-accum 2)"),
        (["--step-in-backward", "--amp", "fp16"], "the loss scaler must find inf/NaN"),
        (["--bf16-weights", "--amp", "fp16"], "--bf16-weights trains in bf16"),
    ],
)
def test_train_gpt_bad_flags_are_usage_errors(args, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    train = load_example()
    with pytest.raises(SystemExit) as exc:
        train.parse_args(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "error:" in err


@pytest.mark.parametrize(
    "args, message",
    [
        # DDP averages a gradient after its accumulate hook has stepped it: each replica would drift
        (["--step-in-backward"], "with 2 data-parallel ranks"),
        (["--step-in-backward", "--tp", "2", "--sequence-parallel"], "--step-in-backward with --sequence-parallel"),
    ],
)
def test_train_gpt_step_in_backward_refuses_what_runs_after_backward(args, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun --nproc-per-node 2
    with pytest.raises(SystemExit) as exc:
        load_example().parse_args(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "error:" in err


def test_train_gpt_pool_needs_cuda(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: --pool is valid here")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        load_example().parse_args(["--pool"])
    assert "needs a CUDA device" in capsys.readouterr().err


def test_train_gpt_impossible_budget_states_the_smallest_feasible_one():
    proc = _train("--steps", "2", "--checkpoint", "auto", "--budget", "1KB")
    assert proc.returncode == 2
    assert "smallest feasible budget" in proc.stderr and "Traceback" not in proc.stderr


def test_train_gpt_sequence_longer_than_the_data_is_a_usage_error(tmp_path, capsys, monkeypatch):
    # checked before the model (whose causal mask is seq_len^2 bytes) is built
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = tmp_path / "tiny.txt"
    data.write_text("a short corpus")
    with pytest.raises(SystemExit) as exc:
        load_example().parse_args(["--data", str(data), "--seq-len", "64"])
    assert exc.value.code == 2 and "fewer than --seq-len" in capsys.readouterr().err


def test_train_gpt_every_technique_flag_trains(tmp_path):
    # each single-process technique flag once, a few steps, without dropout so that they compare:
    # fp32 checkpointing (every, selective, the planner, offload) is exact, gradient accumulation
    # splits the same batch, bf16 and fp16 train close to fp32
    common = SMALL + ["--layers", "4", "--no-progress", "--dropout", "0", "--steps", "3"]
    flags = {
        "none": ["--checkpoint", "none"],
        "every": ["--checkpoint", "every"],
        "selective": ["--checkpoint", "selective"],
        "auto": ["--checkpoint", "auto", "--budget", "0.6"],
        "auto-bytes": ["--checkpoint", "auto", "--budget", "64MB"],
        "every-offload": ["--checkpoint", "every", "--offload"],
        "auto-offload": ["--checkpoint", "auto", "--budget", "0.6", "--offload"],
        "accum": ["--grad-accum", "2"],
        "bf16": ["--amp", "bf16"],
        "fp16": ["--amp", "fp16", "--checkpoint", "every"],
    }
    runs = [common + f + ["--log-json", str(tmp_path / f"{k}.json")] for k, f in flags.items()]
    proc = main_runs(runs)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.count("exit 0") == len(flags), proc.stdout
    losses = {k: [v for _, v in json.loads((tmp_path / f"{k}.json").read_text())["losses"]] for k in flags}
    for k in ("every", "selective", "auto", "auto-bytes", "every-offload", "auto-offload"):
        assert losses[k] == losses["none"], k  # bit for bit
    assert losses["accum"] == pytest.approx(losses["none"], rel=1e-5)
    for k in ("bf16", "fp16"):
        assert losses[k] == pytest.approx(losses["none"], rel=2e-2), k
    assert losses["none"][-1] < losses["none"][0]


def test_train_gpt_resume_refuses_another_model_and_a_finished_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = SMALL + ["--no-progress", "--dropout", "0"]
    proc = main_runs(
        [
            common + ["--steps", "2", "--save", ckpt],
            common + ["--steps", "4", "--resume", ckpt, "--layers", "3"],
            common + ["--steps", "2", "--resume", ckpt],
            common + ["--steps", "3", "--resume", ckpt, "--amp", "fp16"],  # a fresh scaler
        ]
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("exit ")]
    assert lines[0] == "exit 0" and lines[3] == "exit 0", proc.stdout
    assert lines[1].startswith("exit 1") and "another model: --layers 2 (now 3)" in lines[1]
    assert lines[2].startswith("exit 1") and "already at step 2" in lines[2]
    assert "resumed at step 2" in proc.stdout and "step 3: loss" in proc.stdout


def test_train_gpt_resumed_run_gives_the_same_losses(tmp_path):
    # dropout (RNG state), fp16 with llmmem.GradScaler (scaler state), recompute (RNG replay); the
    # three runs in one fresh process, each from main() as the command line would call it
    common = SMALL + ["--no-progress", "--amp", "fp16", "--checkpoint", "every", "--dropout", "0.1"]
    runs = [
        common + ["--steps", "6", "--log-json", str(tmp_path / "full.json")],
        common + ["--steps", "3", "--save", str(tmp_path / "ckpt")],
        common + ["--steps", "6", "--resume", str(tmp_path / "ckpt"), "--log-json", str(tmp_path / "resumed.json")],
    ]
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('train_gpt_example', {str(TRAIN)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"for argv in {runs!r}:\n"
        "    assert m.main(argv) == 0\n"
    )
    proc = run_code(code, timeout=300)
    assert proc.returncode == 0, proc.stderr
    uninterrupted = json.loads((tmp_path / "full.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "resumed.json").read_text())["losses"]
    assert [s for s, _ in resumed] == [4, 5, 6]
    assert resumed == uninterrupted[3:]  # bit for bit
    assert uninterrupted[-1][1] < uninterrupted[0][1]


def _train_ranks(rank, world, folder):
    """Every rank runs the script's main three times: 6 steps, 3 steps saved, resumed to 6."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train = load_example()
    common = SMALL + ["--no-progress", "--tp", "2", "--sequence-parallel", "--amp", "fp16", "--checkpoint", "every"]
    assert train.main(common + ["--steps", "6", "--log-json", f"{folder}/full.json"]) == 0
    assert train.main(common + ["--steps", "3", "--save", f"{folder}/ckpt"]) == 0
    assert train.main(common + ["--steps", "6", "--resume", f"{folder}/ckpt", "--log-json", f"{folder}/res.json"]) == 0
    if rank == 0:
        full = json.loads(open(f"{folder}/full.json").read())["losses"]
        resumed = json.loads(open(f"{folder}/res.json").read())["losses"]
        assert resumed == full[3:], (full, resumed)


@pytest.mark.distributed
def test_train_gpt_tp2_x_dp2_zero1_resumes_exactly(tmp_path):
    run_ranks_here(__file__, "_train_ranks", 4, args=(str(tmp_path),), timeout=240)
    sets = list((tmp_path / "ckpt").iterdir())
    assert [p.name for p in sets] == ["step-00000003"]
    assert sorted(p.name for p in sets[0].iterdir()) == ["MANIFEST.json"] + [f"rank{r}.pt" for r in range(4)]


@pytest.mark.distributed
def test_train_gpt_under_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TRAIN)]
        + SMALL
        + ["--no-progress", "--tp", "2", "--sequence-parallel", "--checkpoint", "selective", "--amp", "bf16"]
        + ["--steps", "2", "--log-json", str(tmp_path / "log.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TP 2 x DP 1" in proc.stdout and "per rank" in proc.stdout
    assert len(json.loads((tmp_path / "log.json").read_text())["losses"]) == 2


def test_train_gpt_hf_llama():
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    proc = _train("--model", "hf-llama", "--checkpoint", "every", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "hf-llama" in proc.stdout and "step 2: loss" in proc.stdout


def test_train_gpt_hf_llama_auto_checkpoint():
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    proc = _train("--model", "hf-llama", "--layers", "4", "--checkpoint", "auto", "--budget", "0.7", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "predicted peak" in proc.stdout and "step 2: loss" in proc.stdout


def test_train_gpt_fused_head_trains_as_the_plain_head(tmp_path):
    # --fused-head (llmmem.patch_lm_loss): the same losses as the plain head, on our GPT (alone, with
    # every block recomputed, in fp16 under llmmem.GradScaler, whose first scale 2**16 is inf in fp16)
    # and on a Hugging Face Llama (labels already shifted: shift_labels)
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    common = SMALL + ["--no-progress", "--dropout", "0", "--steps", "2"]
    flags = {
        "gpt": [],
        "gpt-fused": ["--fused-head"],
        "gpt-fused-every": ["--fused-head", "--checkpoint", "every"],
        "gpt-fp16": ["--amp", "fp16"],
        "gpt-fp16-fused": ["--amp", "fp16", "--fused-head"],
        "llama": ["--model", "hf-llama"],
        "llama-fused": ["--model", "hf-llama", "--fused-head"],
    }
    runs = [common + f + ["--log-json", str(tmp_path / f"{k}.json")] for k, f in flags.items()]
    proc = main_runs(runs)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.count("exit 0") == len(flags), proc.stdout
    losses = {k: [v for _, v in json.loads((tmp_path / f"{k}.json").read_text())["losses"]] for k in flags}
    assert losses["gpt-fused"] == pytest.approx(losses["gpt"], rel=1e-5)
    assert losses["gpt-fused-every"] == pytest.approx(losses["gpt"], rel=1e-5)
    assert losses["gpt-fp16-fused"] == pytest.approx(losses["gpt-fp16"], rel=1e-3)  # no step skipped either
    assert losses["llama-fused"] == pytest.approx(losses["llama"], rel=1e-5)
    assert "fused-head" in proc.stdout


def test_train_gpt_fused_head_is_for_one_device_models(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        load_example().parse_args(["--fused-head", "--tp", "2"])
    assert exc.value.code == 2 and "--fused-head patches a one-device model" in capsys.readouterr().err


def test_train_gpt_without_transformers_says_how_to_install(tmp_path):
    blocker = tmp_path / "transformers"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('transformers is not installed')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = _train("--model", "hf-llama", "--steps", "1", env=env)
    assert proc.returncode == 2
    assert "pip install transformers" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------
# examples/train_gpt.py: the model state (--optim, --bf16-weights, --step-in-backward)


def test_train_gpt_model_state_flags_train(tmp_path):
    # each --optim, bf16 weights and the step in backward, alone and together with the planner:
    # close to torch's AdamW in fp32, the step in backward exactly it, and each in less memory
    # wide and short, so that the model state is most of the peak, as in fine-tuning
    shape = ["--layers", "4", "--hidden", "128", "--seq-len", "16", "--batch", "2"]
    common = SMALL + shape + ["--no-progress", "--dropout", "0", "--steps", "3"]
    flags = {
        "adamw": [],
        "bf16-moments": ["--optim", "adamw-bf16"],
        "int8": ["--optim", "adamw-int8"],
        "int4": ["--optim", "adamw-int4"],
        "bf16-weights": ["--bf16-weights"],
        "in-backward": ["--step-in-backward"],
        "lean": ["--bf16-weights", "--optim", "adamw-int8", "--step-in-backward", "--checkpoint", "auto"],
        "offload": ["--offload-optimizer"],  # llmmem's AdamW stepping host state (on the CPU: copies only)
    }
    runs = [common + f + ["--log-json", str(tmp_path / f"{k}.json")] for k, f in flags.items()]
    proc = main_runs(runs)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.count("exit 0") == len(flags), proc.stdout
    logs = {k: json.loads((tmp_path / f"{k}.json").read_text()) for k in flags}
    losses = {k: [v for _, v in log["losses"]] for k, log in logs.items()}
    peak = {k: log["peak_bytes"] for k, log in logs.items()}
    assert losses["in-backward"] == losses["adamw"]  # torch's AdamW, one parameter at a time
    assert losses["offload"] == pytest.approx(losses["adamw"], rel=1e-5)  # fp32: torch's AdamW, rounded alike
    for k, rel in (("bf16-moments", 1e-2), ("int8", 2e-2), ("int4", 5e-2), ("bf16-weights", 5e-2), ("lean", 5e-2)):
        assert losses[k] == pytest.approx(losses["adamw"], rel=rel), k
    for k in ("bf16-moments", "int8", "int4", "bf16-weights", "in-backward"):
        assert peak[k] < peak["adamw"], (k, peak)
    assert peak["lean"] < min(peak["int8"], peak["bf16-weights"], peak["in-backward"]), peak
    assert "optim=adamw-int8 bf16-weights step-in-backward" in proc.stdout


def test_train_gpt_resume_keeps_or_converts_the_optimizer_state(tmp_path):
    common = SMALL + ["--no-progress", "--dropout", "0.1"]
    lean = ["--bf16-weights", "--optim", "adamw-int8", "--step-in-backward"]
    ck8, ckl, ckt = (str(tmp_path / n) for n in ("ck8", "ckl", "ckt"))
    log = {k: str(tmp_path / f"{k}.json") for k in ("full8", "same8", "torch", "fulll", "samel")}
    results = captured_runs(
        [
            common + ["--optim", "adamw-int8", "--steps", "6", "--log-json", log["full8"]],
            common + ["--optim", "adamw-int8", "--steps", "3", "--save", ck8],
            common + ["--optim", "adamw-int8", "--steps", "6", "--resume", ck8, "--log-json", log["same8"]],
            # int8 codes widened to the fp32 moments torch's AdamW reads (read as numbers they train
            # 5% away from the int8 run within two steps)
            common + ["--optim", "adamw", "--steps", "6", "--resume", ck8, "--log-json", log["torch"]],
            common + lean + ["--steps", "6", "--log-json", log["fulll"]],
            common + lean + ["--steps", "3", "--save", ckl],
            common + lean + ["--steps", "6", "--resume", ckl, "--log-json", log["samel"]],
            common + ["--bf16-weights", "--optim", "adamw-int4", "--steps", "5", "--resume", ckl],
            common + ["--steps", "5", "--resume", ckl],  # fp32 weights: another model
            common + ["--steps", "3", "--save", ckt],
            common + ["--optim", "adamw-bf16", "--step-in-backward", "--steps", "5", "--resume", ckt],
        ]
    )
    codes = [r["code"] for r in results]
    assert codes == [0] * 8 + [1, 0, 0], [(r["code"], r["stderr"][-300:]) for r in results]
    losses = {k: json.loads(pathlib.Path(p).read_text())["losses"] for k, p in log.items()}
    assert losses["same8"] == losses["full8"][3:]  # bit for bit
    assert losses["samel"] == losses["fulll"][3:]  # stochastic rounding's streams resume too
    assert [s for s, _ in losses["torch"]] == [4, 5, 6]
    assert [v for _, v in losses["torch"]] == pytest.approx([v for _, v in losses["full8"][3:]], rel=2e-3)
    assert "--optim adamw (saved adamw-int8)" in results[3]["stdout"]
    assert "--optim adamw-int4 (saved adamw-int8)" in results[7]["stdout"]
    assert "another model: --bf16-weights True (now False)" in results[8]["stderr"]
    assert "--step-in-backward True (saved False)" in results[10]["stdout"]


def _model_state_ranks(rank, world, folder):
    """Two ranks. Tensor parallel: the step in backward trains as the step after it. Then 2
    data-parallel ranks with ZeRO-1 over llmmem.optim.AdamW (int8 moments, bf16 weights): 6 steps;
    3 saved and resumed to 6 (the same losses); resumed with bf16 moments instead (converted)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train = load_example()
    common = SMALL + ["--no-progress", "--dropout", "0.1", "--bf16-weights"]
    int8 = common + ["--optim", "adamw-int8"]
    tp = int8 + ["--tp", "2", "--steps", "3"]
    assert train.main(tp + ["--log-json", f"{folder}/tp.json"]) == 0
    assert train.main(tp + ["--step-in-backward", "--log-json", f"{folder}/tp-sib.json"]) == 0
    if rank == 0:
        after = json.loads(open(f"{folder}/tp.json").read())["losses"]
        inside = json.loads(open(f"{folder}/tp-sib.json").read())["losses"]
        assert inside == after, (after, inside)
    assert train.main(int8 + ["--steps", "6", "--log-json", f"{folder}/full.json"]) == 0
    assert train.main(int8 + ["--steps", "3", "--save", f"{folder}/ckpt"]) == 0
    assert train.main(int8 + ["--steps", "6", "--resume", f"{folder}/ckpt", "--log-json", f"{folder}/res.json"]) == 0
    switched = ["--steps", "4", "--resume", f"{folder}/ckpt", "--optim", "adamw-bf16", "--save", f"{folder}/bf16"]
    assert train.main(common + switched) == 0
    if rank == 0:
        import torch

        full = json.loads(open(f"{folder}/full.json").read())["losses"]
        resumed = json.loads(open(f"{folder}/res.json").read())["losses"]
        assert resumed == full[3:], (full, resumed)  # bit for bit, stochastic rounding included
        # ZeRO loads each rank's saved state as it was saved: the script converts it to bf16 moments
        for step, want in ((3, "int8"), (4, "bf16")):
            saved = torch.load(f"{folder}/{'ckpt' if step == 3 else 'bf16'}/step-{step:08d}/rank0.pt")
            formats = {s["state_dtype"] for s in saved["optimizer"]["state"].values()}
            assert want in formats and formats <= {want, "fp32"}, (step, formats)


@pytest.mark.distributed
def test_train_gpt_model_state_under_tp_and_zero1(tmp_path):
    run_ranks_here(__file__, "_model_state_ranks", 2, args=(str(tmp_path),), timeout=240)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "step-00000003").iterdir())
    assert files == ["MANIFEST.json", "rank0.pt", "rank1.pt"]
