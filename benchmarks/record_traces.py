"""Record allocation traces of training steps of llmmem's small GPT, for bench_pool's replay.

``python benchmarks/record_traces.py [--device cpu|cuda] [--out benchmarks/traces]``

CPU: torch.profiler's memory events (every allocation and free of PyTorch's CPU allocator, with
its address and size). CUDA: ``torch.cuda.memory._record_memory_history`` (alloc and
free_requested actions). Either way each trace is the sequence of (alloc id size | free id) of
one process: building the model and AdamW, then a few forward/backward/step iterations.
Traces are written as gzipped JSON: {"name", "device", "config", "events": [[1, id, size] | [0, id, 0]]}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from llmmem.models.gpt import GPT, GPTConfig  # noqa: E402

# (name, GPTConfig kwargs, batch, sequence lengths of the steps). The last one varies the sequence
# length from step to step, the pattern that strands memory in per-request segments.
CONFIGS = [
    ("gpt_tiny", dict(layers=4, hidden=128, heads=4, seq_len=128, vocab_size=512), 8, [128] * 3),
    ("gpt_small", dict(layers=6, hidden=256, heads=8, seq_len=256, vocab_size=2048), 8, [256] * 3),
    ("gpt_medium", dict(layers=8, hidden=384, heads=6, seq_len=256, vocab_size=4096), 4, [256] * 3),
    (
        "gpt_varlen",
        dict(layers=6, hidden=256, heads=8, seq_len=320, vocab_size=2048),
        6,
        [96, 160, 224, 288, 320, 128],
    ),
    # recorded after the pool's growth policy was tuned on the four above: held-out checks
    ("gpt_sdpa", dict(layers=6, hidden=320, heads=5, seq_len=192, vocab_size=3000, attention="sdpa"), 10, [192] * 3),
    ("gpt_varlen2", dict(layers=5, hidden=192, heads=6, seq_len=256, vocab_size=5000), 8, [200, 64, 256, 144, 256]),
    # recorded after in-place growth (backend resize) was measured on the six above: held out
    ("gpt_varlen3", dict(layers=4, hidden=256, heads=4, seq_len=384, vocab_size=4096), 6, [384, 96, 256, 320, 192]),
    # recorded after hole decommitting was tuned on the seven above (on varlen2 in particular)
    ("gpt_varlen4", dict(layers=6, hidden=224, heads=7, seq_len=320, vocab_size=6000), 5, [160, 320, 96, 288, 224]),
]


def _steps(cfg: dict, batch: int, seqs: list[int], device: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seq in seqs:
        idx = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del idx, loss


def record_cpu(cfg: dict, batch: int, seqs: list[int]) -> list[list[int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _steps(cfg, batch, seqs, "cpu")
    events = []

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    for order, e in enumerate(walk(prof.profiler.kineto_results.experimental_event_tree())):
        f = e.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation" and f.device.type == "cpu":
            events.append((e.start_time_ns, order, f.ptr, f.alloc_size))
    events.sort()
    return _to_ops((ptr, size) for _, _, ptr, size in events)


def record_cuda(cfg: dict, batch: int, seqs: list[int]) -> list[list[int]]:
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    _steps(cfg, batch, seqs, "cuda")
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    pairs = []
    for trace in snap["device_traces"]:
        for t in trace:
            if t["action"] == "alloc":
                pairs.append((t["addr"], t["size"]))
            elif t["action"] == "free_requested":
                pairs.append((t["addr"], -t["size"]))
    return _to_ops(pairs)


def _to_ops(pairs) -> list[list[int]]:
    """(address, +size | -size) -> [[1, id, size] | [0, id, 0]]; frees of unknown blocks dropped."""
    live: dict[int, int] = {}
    ops, next_id = [], 0
    for ptr, size in pairs:
        if size > 0:
            live[ptr] = next_id
            ops.append([1, next_id, int(size)])
            next_id += 1
        elif size < 0 and ptr in live:
            ops.append([0, live.pop(ptr), 0])
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=os.path.join(HERE, "traces"))
    ap.add_argument("--only", nargs="*", help="record only these traces")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, cfg, batch, seqs in CONFIGS:
        if args.only and name not in args.only:
            continue
        ops = (record_cuda if args.device == "cuda" else record_cpu)(cfg, batch, seqs)
        path = os.path.join(args.out, f"{name}_{args.device}.json.gz")
        with gzip.open(path, "wt") as f:
            json.dump(
                {"name": name, "device": args.device, "config": cfg, "batch": batch, "seqs": seqs, "events": ops},
                f,
                separators=(",", ":"),
            )
        print(f"{path}: {len(ops)} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
