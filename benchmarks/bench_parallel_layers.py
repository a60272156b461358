"""Tensor-parallel MLP step time: 2 ranks (llmmem shared memory, and gloo) vs one process, same run.

``python benchmarks/bench_parallel_layers.py [--quick] [--json PATH]``

The MLP is ``ColumnParallelLinear(h, 4h) -> GELU -> RowParallelLinear(4h, h)`` on ``tokens x h``
fp32 activations, forward + backward. The baseline is the same MLP built from ``nn.Linear`` in one
process using as many threads as the ranks have together, so the comparison holds the core count
fixed. The TP runs differ only in the engine behind the two all-reduces per step; the two
engines alternate step by step in the same processes (medians per engine). What TP buys on CPU is memory per rank (1/t of the weights),
not speed; the table shows what the collectives cost on top.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def _step_fn(fc1, fc2, x):
    import torch.nn.functional as F

    def step():
        y = fc2(F.gelu(fc1(x)))
        y.sum().backward()

    return step


def _tp_rank(rank, world, hidden, tokens, repeats):
    """Alternates the two engines step by step (same processes, same tensors), so a machine whose
    load drifts during the run (shared CI cores) biases neither."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from _harness import print_rank_result

    import llmmem
    from llmmem.parallel import collectives

    torch.set_num_threads(1)
    torch.manual_seed(0)
    fc1 = llmmem.ColumnParallelLinear(hidden, 4 * hidden)
    fc2 = llmmem.RowParallelLinear(4 * hidden, hidden)
    x = torch.randn(tokens, hidden, requires_grad=True)
    step = _step_fn(fc1, fc2, x)
    engines = {"llmmem": 1 << 62, "gloo": 0}  # shared-memory threshold: everything / nothing
    samples = {name: [] for name in engines}
    for i in range(repeats + 1):
        for name, threshold in engines.items():
            collectives.set_collective_thresholds(cpu_shm_max_bytes=threshold)
            dist.barrier()
            t0 = time.perf_counter()
            step()
            if i > 0:  # the first round warms up both engines
                samples[name].append(time.perf_counter() - t0)
    if rank == 0:
        print_rank_result({name: statistics.median(v) for name, v in samples.items()})


def main(argv=None) -> int:
    import torch
    import torch.nn as nn
    from _harness import print_table, rank_result, time_fn, write_json

    from llmmem.parallel.ranks import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.device != "cpu":
        print(
            "bench_parallel_layers: the TP step benchmark runs on CPU ranks only (one GPU cannot host two NCCL ranks)"
        )
        return 0
    world = 2
    configs = [(512, 256)] if a.quick else [(512, 256), (1024, 512), (2048, 512)]
    repeats = 5 if a.quick else 9
    rows, payload = [], {}
    for hidden, tokens in configs:
        threads_before = torch.get_num_threads()
        torch.set_num_threads(world)
        torch.manual_seed(0)
        fc1, fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        x = torch.randn(tokens, hidden, requires_grad=True)
        single = time_fn(_step_fn(fc1, fc2, x), repeats=repeats, warmup=2)["median_s"]
        torch.set_num_threads(threads_before)
        res = run_ranks(__file__, "_tp_rank", world, args=(hidden, tokens, repeats), timeout=600)
        tp = rank_result(res[0].output)
        rows.append(
            [
                f"h={hidden}, tokens={tokens}",
                single * 1e3,
                tp["llmmem"] * 1e3,
                tp["gloo"] * 1e3,
                tp["gloo"] / tp["llmmem"],
                single / tp["llmmem"],
            ]
        )
        payload[f"h{hidden}_t{tokens}"] = {"single_s": single, "tp2_llmmem_s": tp["llmmem"], "tp2_gloo_s": tp["gloo"]}
    print_table(
        f"TP MLP forward+backward, {world} ranks x 1 thread vs 1 process x {world} threads (ms)",
        ["shape", "1 process", "TP llmmem", "TP gloo", "llmmem vs gloo", "1 proc / TP llmmem"],
        rows,
    )
    path = write_json("tp", payload, a.json)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
