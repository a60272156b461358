"""Largest batch of a GPT training step that fits under a fixed device-memory cap, in a fresh
process: ``python benchmarks/_max_batch.py native|llmmem CAP_GIB``. Prints one JSON line.

native: PyTorch's caching allocator limited with set_per_process_memory_fraction.
llmmem: llmmem.install_allocator(MemoryPool(max_size=cap)) — process-wide, so autograd's
backward threads allocate from the pool too (use_pool would only route this thread).
"""

from __future__ import annotations

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import llmmem
from llmmem.models.gpt import GPT, GPTConfig

CFG = dict(layers=12, hidden=768, heads=12, seq_len=512, vocab_size=8192)


def fits(batch: int) -> bool:
    model = opt = None
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            idx = torch.randint(0, CFG["vocab_size"], (batch, CFG["seq_len"]), device="cuda")
            _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return True
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if "out of memory" not in str(exc):
            raise
        return False
    finally:
        del model, opt
        gc.collect()


def main() -> int:
    mode, cap = sys.argv[1], float(sys.argv[2]) * 2**30
    if mode == "llmmem":
        llmmem.install_allocator(llmmem.MemoryPool(initial_size=0, max_size=int(cap), device="cuda"))
    else:
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1024:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    print(json.dumps({"mode": mode, "cap_gib": cap / 2**30, "max_batch": lo}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
