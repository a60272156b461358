"""Step time under ``torch.compile``, the candidates stepped in turn in one process: llmmem's plan of
compiled blocks (``auto_checkpoint(compile_blocks=True)``) against compile alone, torch's checkpoint
on every block and torch's compile-time planner (``activation_memory_budget``).

Per-process step times on a shared VM move by tens of percent from one process to the next; here
every candidate is built and compiled in one process, warmed up, then stepped in rounds that
alternate their order, and each one's median process CPU time is reported with its ratio to compile
alone. Memory is not measured here (see ``bench_compile_memory.py`` and ``compare --preset
compile``): compiled graphs allocate below the dispatcher, and one process holds every candidate.

Model: ``compare --preset compile``'s GPT (6 layers, hidden 128, 4 heads, 256 tokens, batch 4, fp32,
no dropout), one thread, inductor.

    python benchmarks/bench_compile_interleaved.py [--candidates none,every,amb50,plan50,amb25,plan25]
        [--rounds 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

CANDIDATES = {
    "none": "torch.compile",
    "every": "torch.compile + torch checkpoint on every block",
    "amb50": "torch.compile + activation_memory_budget 0.5",
    "amb25": "torch.compile + activation_memory_budget 0.25",
    "plan50": "llmmem.auto_checkpoint(budget=0.5, compile_blocks=True) + torch.compile",
    "plan25": "llmmem.auto_checkpoint(budget=0.25, compile_blocks=True) + torch.compile",
}


def _build(kind: str, x, y):
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    import llmmem
    from llmmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6, hidden=128, heads=4, seq_len=256, dropout=0.0))
    if kind == "every":

        class Checkpointed(nn.Module):
            def __init__(self, block) -> None:
                super().__init__()
                self.block = block

            def forward(self, h, *args, **kwargs):
                return checkpoint(self.block, h, *args, use_reentrant=False, **kwargs)

        model.blocks = nn.ModuleList([Checkpointed(b) for b in model.blocks])
    if kind.startswith("plan"):
        llmmem.auto_checkpoint(model, sample=(x, y), budget=int(kind[4:]) / 100, repeats=3, compile_blocks=True)
    return model, torch.compile(model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated: " + ", ".join(CANDIDATES))
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    kinds = a.candidates.split(",")
    for k in kinds:
        if k not in CANDIDATES:
            p.error(f"--candidates: unknown {k!r}; known: {', '.join(CANDIDATES)}")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")

    import torch
    import torch._functorch.config as functorch_config

    torch.set_num_threads(1)
    x = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(2))
    steps = {}
    for kind in kinds:
        model, run = _build(kind, x, y)
        # the partitioner reads the budget when it compiles: each candidate compiles under its own
        amb = int(kind[3:]) / 100 if kind.startswith("amb") else 1.0

        def step(model=model, run=run, amb=amb):
            with functorch_config.patch(activation_memory_budget=amb):
                _, loss = run(x, y)
            loss.backward()
            for q in model.parameters():
                q.grad = None

        for _ in range(2):
            step()
        steps[kind] = step
    times = {k: [] for k in kinds}
    for r in range(a.rounds):
        for kind in kinds if r % 2 else kinds[::-1]:
            t0 = time.process_time()
            steps[kind]()
            times[kind].append(time.process_time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med.get("none")
    print(f"{'candidate':<8} {'ms':>7} {'x compile':>9}  what")
    for kind in kinds:
        ratio = f"{med[kind] / ref:9.2f}" if ref else f"{'-':>9}"
        print(f"{kind:<8} {1e3 * med[kind]:7.1f} {ratio}  {CANDIDATES[kind]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": a.rounds, "median_s": med, "times_s": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
