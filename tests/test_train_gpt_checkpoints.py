"""examples/train_gpt.py's checkpoint sets: one step on every rank or none, damage named in one
line, and flags given on resume applied over the saved state."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import zipfile

import pytest
from support.train_gpt import CHECKPOINTS, SMALL, captured_runs, load_example, run_ranks_here

TP2 = SMALL + ["--no-progress", "--tp", "2", "--dropout", "0.1"]
ONE = SMALL + ["--no-progress", "--dropout", "0.1"]


# ------------------------------------------------------------------------------------------------
# A rank killed during a save (TP 2, gloo)


def _save_killed(rank, world, folder, fault):
    """4 steps saved after each; one rank SIGKILLs itself during the save of step 3."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train = load_example()
    if fault == "third torch.save on rank 1":  # the report, in terms of torch.save only
        if rank == 1:
            import torch

            real, calls = torch.save, []

            def save(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)

            torch.save = save
    else:
        os.environ["TRAIN_GPT_FAULT"] = fault
    train.main(TP2 + ["--steps", "4", "--save-every", "1", "--save", f"{folder}/ckpt"])


def _resume_each(rank, world, root, names):
    """An uninterrupted run of 4 steps, then each folder resumed to step 4: the same losses."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train = load_example()
    assert train.main(TP2 + ["--steps", "4", "--log-json", f"{root}/full.json"]) == 0
    for name in names:
        log = f"{root}/{name}/resumed.json"  # written by rank 0
        assert train.main(TP2 + ["--steps", "4", "--resume", f"{root}/{name}/ckpt", "--log-json", log]) == 0
    if rank == 0:
        full = json.loads(open(f"{root}/full.json").read())["losses"]
        starts = {}
        for name in names:
            resumed = json.loads(open(f"{root}/{name}/resumed.json").read())["losses"]
            starts[name] = resumed[0][0] - 1
            assert resumed == full[starts[name] :], (name, full, resumed)  # bit for bit
        with open(f"{root}/starts.json", "w") as f:
            json.dump(starts, f)


@pytest.mark.distributed
def test_a_rank_killed_during_a_save_leaves_no_mixed_set(tmp_path):
    # the rank that dies, and where: as its file's write starts (the report: rank 0 had
    # written step 3, rank 1 not, and resume mixed them), rank 0 with every file and the manifest
    # written but the set not yet current, and rank 0 once it is current
    faults = {"report": "third torch.save on rank 1", "commit": "0:3:commit", "prune": "0:3:prune"}
    for name, fault in faults.items():
        killed = run_ranks_here(
            __file__, "_save_killed", 2, args=(str(tmp_path / name), fault), timeout=120, grace=3, check=False
        )
        dead = 1 if name == "report" else 0
        assert killed[dead].returncode == -signal.SIGKILL, killed[dead].output
    # a whole set but for one byte of rank 1's file, which rank 0 does not read: both fall back
    shutil.copytree(tmp_path / "prune", tmp_path / "flipped")
    _flip(tmp_path / "flipped" / "ckpt" / "step-00000003" / "rank1.pt", 3000)
    names = [*faults, "flipped"]
    ranks = run_ranks_here(__file__, "_resume_each", 2, args=(str(tmp_path), names), timeout=180)
    starts = json.loads((tmp_path / "starts.json").read_text())
    assert starts == {"report": 2, "commit": 2, "prune": 3, "flipped": 2}
    assert "step-00000003.partial is a save that never finished, ignored" in ranks[0].output
    assert "skipped a damaged set: " + str(tmp_path / "flipped/ckpt/step-00000003/rank1.pt") in ranks[0].output


# ------------------------------------------------------------------------------------------------
# Damaged files: each named in one line


def _nan_into_a_weight(path):
    """float32 NaN over the first element of the first storage (the token embedding's weight)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(bytes.fromhex("0000c07f"))


def _torch_save(path, obj):
    import torch

    torch.save(obj, path)


def _without(key):
    def damage(path):
        import torch

        state = torch.load(path, weights_only=True)
        del state[key]
        torch.save(state, path)

    return damage


def _reshaped_weight(path):
    import torch

    state = torch.load(path, weights_only=True)
    state["model"]["tok_emb.weight"] = state["model"]["tok_emb.weight"][:-1]
    torch.save(state, path)


def _flip(path, at, mask=0x01):
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


RANK0 = "step-00000002/rank0.pt"
MANIFEST = "step-00000002/MANIFEST.json"

# what is done to step 2's rank0.pt (or manifest); the file the message names; words it says
CORRUPT = {
    "16 zeroed bytes": (
        lambda p: p.write_bytes(p.read_bytes()[:5000] + bytes(16) + p.read_bytes()[5016:]),
        RANK0,
        "sha256",
    ),
    "a 1-byte flip": (lambda p: _flip(p, len(p.read_bytes()) // 2), RANK0, "sha256"),
    "NaN in a weight": (_nan_into_a_weight, RANK0, "sha256"),
    "empty": (lambda p: p.write_bytes(b""), RANK0, "0 bytes, the manifest says"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), RANK0, "the manifest says"),
    "half": (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), RANK0, "the manifest says"),
    "random": (lambda p: p.write_bytes(random.Random(0).randbytes(len(p.read_bytes()))), RANK0, "sha256"),
    "foreign": (lambda p: _torch_save(p, {"weights": [1.0] * 20000}), RANK0, "the manifest says"),
    "missing keys": (_without("optimizer"), RANK0, "the manifest says"),
    "deleted": (lambda p: p.unlink(), RANK0, "missing"),
    "manifest deleted": (lambda p: (p.parent / "MANIFEST.json").unlink(), MANIFEST, "missing"),
    "manifest not JSON": (lambda p: (p.parent / "MANIFEST.json").write_text("{"), MANIFEST, "not valid JSON"),
    "manifest edited": (lambda p: _flip(p.parent / "MANIFEST.json", 40, 0x02), MANIFEST, ""),
}
# done to rank0.pt, then the manifest re-sealed with its new size and digest: what loading finds
WRONG_CONTENT = {
    "random, re-sealed": (lambda p: p.write_bytes(random.Random(0).randbytes(5000)), "not a loadable torch file"),
    "empty, re-sealed": (lambda p: p.write_bytes(b""), "not a loadable torch file"),
    "a list, re-sealed": (lambda p: _torch_save(p, [1, 2]), "holds a list"),
    "foreign, re-sealed": (lambda p: _torch_save(p, {"weights": 1}), "no 'step', 'model'"),
    "missing keys, re-sealed": (_without("optimizer"), "no 'optimizer'"),
    "NaN in a weight, re-sealed": (_nan_into_a_weight, "'tok_emb.weight' holds NaN"),
    "a weight of another shape, re-sealed": (_reshaped_weight, "'tok_emb.weight' is (255, 32)"),
}


def _reseal(folder):
    import hashlib

    ckpt = load_example(CHECKPOINTS, "train_gpt_checkpoints_test")
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    data = (folder / "rank0.pt").read_bytes()
    manifest["files"]["rank0.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ckpt.seal_manifest(folder / "MANIFEST.json", manifest)


def test_every_damaged_file_is_named_in_one_line_and_never_resumed(tmp_path):
    base = tmp_path / "base"
    [saved] = captured_runs([ONE + ["--steps", "2", "--save-every", "1", "--save", str(base)]])
    assert saved["code"] == 0, saved["stderr"]
    # kind -> (the file named, words); each in a copy with step 1 to fall back on and one without
    cases = {kind: (named, words) for kind, (_, named, words) in CORRUPT.items()}
    cases.update({kind: (RANK0, words) for kind, (_, words) in WRONG_CONTENT.items()})
    runs = []
    for i, kind in enumerate(cases):
        for fallback in (True, False):
            folder = tmp_path / f"case{i}-{fallback}"
            shutil.copytree(base, folder)
            if not fallback:
                shutil.rmtree(folder / "step-00000001")
            path = folder / RANK0
            if kind in CORRUPT:
                CORRUPT[kind][0](path)
            else:
                WRONG_CONTENT[kind][0](path)
                _reseal(path.parent)
            runs.append(ONE + ["--steps", "3", "--resume", str(folder)])
    results = captured_runs(runs)
    for i, kind in enumerate(cases):
        named, words = cases[kind]
        for fallback, r in zip((True, False), results[2 * i : 2 * i + 2]):
            where = str(tmp_path / f"case{i}-{fallback}" / named)
            lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
            assert len(lines) == 1 and where in lines[0] and words in lines[0], (kind, fallback, r["stderr"])
            assert "Traceback" not in r["stderr"]
            if fallback:  # the set before, saying so
                assert r["code"] == 0 and lines[0].startswith("warning:"), (kind, r)
                assert "resumed at step 1 from" in r["stdout"], (kind, r["stdout"])
            else:
                assert r["code"] == 1 and lines[0].startswith("error: --resume"), (kind, r)
                assert "resumed" not in r["stdout"], (kind, r["stdout"])


def test_resume_from_a_named_set_supersedes_the_sets_ahead_and_keeps_the_newest(tmp_path):
    base, empty, legacy = tmp_path / "base", tmp_path / "empty", tmp_path / "legacy"
    empty.mkdir()
    legacy.mkdir()
    (legacy / "rank0.pt").write_bytes(b"")
    results = captured_runs(
        [
            ONE + ["--steps", "4", "--save-every", "1", "--save", str(base), "--keep", "3"],
            ONE + ["--steps", "3", "--resume", str(base / "step-00000002"), "--save", str(base), "--keep", "3"],
            ONE + ["--steps", "3", "--resume", str(empty)],
            ONE + ["--steps", "3", "--resume", str(legacy)],
        ]
    )
    assert [r["code"] for r in results] == [0, 0, 1, 1], results
    assert f"resumed at step 2 from {base / 'step-00000002'}" in results[1]["stdout"]
    assert f"removed {base / 'step-00000004'}: ahead of step 3" in results[1]["stderr"]
    assert sorted(p.name for p in base.iterdir()) == ["step-00000002", "step-00000003"]  # no .partial, no .stale
    assert json.loads((base / "step-00000003" / "MANIFEST.json").read_text())["args"]["steps"] == "3"  # the new run's
    message = f"no checkpoint set (a step-NNNNNNNN folder with a MANIFEST.json) in {empty}"
    assert results[2]["stderr"].strip().splitlines() == [f"error: --resume {empty}: {message}"]
    [line] = results[3]["stderr"].strip().splitlines()
    assert "earlier train_gpt.py's format, which has no digests" in line


# ------------------------------------------------------------------------------------------------
# Flags given on resume


def test_flags_given_on_resume_apply_over_the_saved_state(tmp_path):
    import torch

    base = str(tmp_path / "base")
    runs = [ONE + ["--steps", "2", "--save", base]]
    for name, flags in {"tiny": ["--lr", "1e-9"], "huge": ["--lr", "1"], "same": []}.items():
        runs.append(
            ONE
            + [
                "--steps",
                "4",
                "--resume",
                base,
                "--save",
                str(tmp_path / name),
                "--log-json",
                str(tmp_path / f"{name}.json"),
            ]
            + flags
        )
    runs.append(ONE + ["--steps", "2", "--save", str(tmp_path / "lr01"), "--lr", "0.01"])
    runs.append(ONE + ["--steps", "3", "--resume", str(tmp_path / "lr01"), "--save", str(tmp_path / "kept")])
    runs.append(ONE + ["--steps", "3", "--resume", base, "--seed", "1"])
    runs.append(ONE + ["--steps", "3", "--resume", base, "--seed", "0", "--amp", "bf16"])
    r = captured_runs(runs)
    assert [x["code"] for x in r] == [0, 0, 0, 0, 0, 0, 1, 0], r
    assert "flags applied over the saved state: --lr 1e-09 (saved 0.003)" in r[1]["stdout"]
    assert "flags applied over the saved state: --lr 1.0 (saved 0.003)" in r[2]["stdout"]
    assert "flags applied" not in r[3]["stdout"] and "flags applied" not in r[5]["stdout"]
    assert "flags applied over the saved state: --amp bf16 (saved none)" in r[7]["stdout"]  # same --seed: not listed
    assert "--seed 1: the saved run (seed 0)" in r[6]["stderr"]

    def saved_lr(name, step):
        folder = tmp_path / name / f"step-{step:08d}"
        state = torch.load(folder / "rank0.pt", weights_only=True)
        return state["optimizer"]["param_groups"][0]["lr"], json.loads((folder / "MANIFEST.json").read_text())

    for name, lr in {"tiny": 1e-9, "huge": 1.0, "same": 3e-3, "kept": 0.01}.items():
        got, manifest = saved_lr(name, 3 if name == "kept" else 4)
        assert got == lr and float(manifest["args"]["lr"]) == lr, name
    losses = {n: json.loads((tmp_path / f"{n}.json").read_text())["losses"] for n in ("tiny", "huge", "same")}
    assert losses["tiny"][0] == losses["huge"][0] == losses["same"][0]  # step 3: before the first step at the new rate
    assert len({losses[n][1][1] for n in losses}) == 3  # step 4: after it
