"""examples/train_gpt.py --fsdp: ZeRO-2 and ZeRO-3 through torch's FSDP2, alone and under llmmem's
tensor parallelism (a 2-D layout), with llmmem's checkpointing, planner, GradScaler and optimizer."""

from __future__ import annotations

import json
import pathlib

import pytest
from support.train_gpt import SMALL, captured_runs, load_example, run_ranks_here

COMMON = SMALL + ["--no-progress", "--dropout", "0"]


def _log(folder, name) -> dict:
    return json.loads((pathlib.Path(folder) / f"{name}.json").read_text())


def _fsdp_ranks(rank, world, folder):
    """Every rank runs the script's main once per layout; rank 0 writes each run's log."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train = load_example()
    runs = {"ddp": ["--no-zero"], "zero2": ["--fsdp", "zero2"], "zero3": ["--fsdp", "zero3"]}
    if world == 4:  # tensor parallel 2 x data parallel 2
        runs = {"tp": ["--tp", "2", "--no-zero"], "tp-zero3": ["--tp", "2", "--fsdp", "zero3"]}
    for name, flags in runs.items():
        assert train.main(COMMON + ["--steps", "4", "--log-json", f"{folder}/{name}.json"] + flags) == 0
    # a saved and resumed run: the moments of torch's AdamW come back as DTensors laid out as their
    # parameters; fp16 with the scaler, every block checkpointed, two micro-batches a step
    resumed = list(flags) + ["--amp", "fp16", "--checkpoint", "every", "--grad-accum", "2"]
    assert train.main(COMMON + ["--steps", "5", "--log-json", f"{folder}/whole.json"] + resumed) == 0
    assert train.main(COMMON + ["--steps", "2", "--save", f"{folder}/ckpt"] + resumed) == 0
    assert (
        train.main(
            COMMON + ["--steps", "5", "--resume", f"{folder}/ckpt", "--log-json", f"{folder}/res.json"] + resumed
        )
        == 0
    )


def _single_process_losses(tmp_path) -> list:
    [run] = captured_runs([COMMON + ["--steps", "4", "--log-json", str(tmp_path / "one.json")]])
    assert run["code"] == 0, run["stderr"]
    return _log(tmp_path, "one")


def _close(a: list, b: list, rtol: float) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(abs(x - y) <= rtol * abs(y) for (_, x), (_, y) in zip(a, b))


@pytest.mark.distributed
def test_zero2_and_zero3_train_as_one_process_and_shard_the_model_state(tmp_path):
    run_ranks_here(__file__, "_fsdp_ranks", 2, args=(str(tmp_path),), timeout=240)
    one = _single_process_losses(tmp_path)
    logs = {name: _log(tmp_path, name) for name in ("ddp", "zero2", "zero3")}
    for name, log in logs.items():
        assert _close(log["losses"], one["losses"], 1e-6), (name, log["losses"], one["losses"])
    # each rank holds half of the parameters, gradients and AdamW moments that a DDP rank holds
    # (FSDP2 shards along the first dimension: an odd row count leaves one rank a row more)
    whole = logs["ddp"]["model_state_bytes"]
    for name in ("zero2", "zero3"):
        part = logs[name]["model_state_bytes"]
        for kind in ("parameters", "gradients", "optimizer"):
            assert part[kind] <= whole[kind] * (0.5 + 0.05), (name, kind, part, whole)
    assert logs["zero3"]["peak_bytes"] < logs["ddp"]["peak_bytes"]
    assert _log(tmp_path, "res")["losses"] == _log(tmp_path, "whole")["losses"][2:]  # bit for bit


@pytest.mark.distributed
def test_tp2_x_zero3_trains_as_tp2_and_resumes_exactly(tmp_path):
    run_ranks_here(__file__, "_fsdp_ranks", 4, args=(str(tmp_path),), timeout=300)
    tp, both = _log(tmp_path, "tp"), _log(tmp_path, "tp-zero3")
    assert _close(both["losses"], tp["losses"], 1e-6), (both["losses"], tp["losses"])
    for kind in ("parameters", "gradients", "optimizer"):  # per rank: half of a tensor-parallel rank's
        assert both["model_state_bytes"][kind] <= tp["model_state_bytes"][kind] * (0.5 + 0.05), kind
    assert _log(tmp_path, "res")["losses"] == _log(tmp_path, "whole")["losses"][2:]
    files = sorted(p.name for p in (tmp_path / "ckpt" / "step-00000002").iterdir())
    assert files == ["MANIFEST.json"] + [f"rank{r}.pt" for r in range(4)]


@pytest.mark.parametrize(
    "world, args, message",
    [
        ("1", ["--fsdp", "zero3"], "this run has one"),
        ("2", ["--fsdp", "zero3", "--tp", "2"], "this run has one"),
        ("2", ["--fsdp", "zero2", "--zero"], "drop --zero"),
        ("4", ["--fsdp", "zero3", "--tp", "2", "--sequence-parallel"], "lose their mark"),
        ("2", ["--fsdp", "zero3", "--offload-optimizer"], "not sharded"),
    ],
)
def test_fsdp_usage_errors(world, args, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", world)  # as under torchrun --nproc-per-node N
    with pytest.raises(SystemExit):
        load_example().parse_args(args)
    assert message in capsys.readouterr().err
