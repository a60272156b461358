"""Issue 26's stress check of examples/train_gpt.py's checkpoint sets: N (20) runs of TP-2 training
that saves every step, each with one rank (drawn at random) SIGKILLed at a random moment of a save
(0-50 ms after its c-th torch.save starts, c drawn from 2-24); then every interrupted folder is
resumed to the end and its losses compared bit for bit with an uninterrupted run's (a set that mixed
steps would make them differ).

    python benchmarks/kill_during_saves.py OUT_DIR [N]     # about 13 s a kill on 2 cores
"""

import importlib.util
import json
import os
import pathlib
import random
import signal
import sys
import threading

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--batch", "4", "--threads", "1"]
TP2 = SMALL + ["--no-progress", "--tp", "2", "--dropout", "0.1"]
STEPS = "30"


def load():
    spec = importlib.util.spec_from_file_location("train_gpt_example", ROOT / "examples" / "train_gpt.py")
    m = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt_example"] = m
    spec.loader.exec_module(m)
    return m


def killed_run(rank, world, folder, victim, delay):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train = load()
    if rank == victim:  # a random moment around the start of its c-th save (c = int(delay))
        import torch

        real, calls = torch.save, []

        def save(*a, **k):
            calls.append(1)
            if len(calls) == int(delay):
                threading.Timer((delay % 1) * 0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            return real(*a, **k)

        torch.save = save
    train.main(TP2 + ["--steps", STEPS, "--save-every", "1", "--save", f"{folder}/ckpt"])


def resume_all(rank, world, root, names):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train = load()
    assert train.main(TP2 + ["--steps", STEPS, "--log-json", f"{root}/full.json"]) == 0
    for name in names:
        try:
            code = train.main(
                TP2
                + ["--steps", STEPS, "--resume", f"{root}/{name}/ckpt", "--log-json", f"{root}/{name}/resumed.json"]
            )
        except SystemExit as e:
            code = str(e)
        if rank == 0:
            with open(f"{root}/{name}/code.txt", "w") as f:
                f.write(str(code))


if __name__ == "__main__":
    from llmmem.parallel.ranks import run_ranks

    out, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
    rng = random.Random(1)
    names = []
    for i in range(n):
        victim, delay = rng.randrange(2), rng.uniform(2.0, 25.0)
        name = f"k{i:02d}-r{victim}-{delay:.2f}"
        r = run_ranks(
            __file__, "killed_run", 2, args=(f"{out}/{name}", victim, delay), timeout=120, grace=3, check=False
        )
        print(name, [x.returncode for x in r], flush=True)
        if (pathlib.Path(out) / name / "ckpt").exists():
            names.append(name)
    run_ranks(__file__, "resume_all", 2, args=(out, names), timeout=600)
    full = json.load(open(f"{out}/full.json"))["losses"]
    bad = 0
    for name in names:
        code = open(f"{out}/{name}/code.txt").read()
        try:
            res = json.load(open(f"{out}/{name}/resumed.json"))["losses"]
        except FileNotFoundError:
            res = None
        if res is None:
            print(name, "no resumed losses; exit", code)
            bad += 1
            continue
        start = res[0][0] - 1
        same = res == full[start:]
        bad += not same
        print(name, "resumed at", start, "identical" if same else "DIFFERENT", "exit", code)
    print(f"{len(names)} interrupted folders resumed, {bad} bad")
