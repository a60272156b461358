"""Mixed-precision training of the small GPT with llmmem.GradScaler, the drop-in for
torch.amp.GradScaler, and what it adds: which parameter overflowed, and how many steps were skipped.

    python examples/amp_grad_scaler.py            # CUDA with fp16 autocast if available, else CPU (bf16)
    python examples/amp_grad_scaler.py --steps 50 --poison-every 10

`--poison-every N` writes an inf into one gradient every N steps, to show a skipped step being
reported and the learning-rate scheduler being held back.
"""

from __future__ import annotations

import argparse

import torch

import llmmem
from llmmem.models.gpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--poison-every", type=int, default=10, help="inject an inf gradient every N steps (0: never)")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, seq_len=32, vocab_size=256)).to(device)
    # fused=True: the scaler hands grad_scale/found_inf to the optimizer, no host sync per step
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    scaler = llmmem.GradScaler(device, init_scale=2.0**12, growth_interval=20, min_scale=1.0)

    for step in range(args.steps):
        idx = torch.randint(0, 256, (8, 32), device=device)
        opt.zero_grad()
        with torch.autocast(device, dtype=amp_dtype):
            _, loss = model(idx, idx)
        scaler.scale(loss).backward()
        if args.poison_every and step % args.poison_every == args.poison_every - 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if scaler.last_step_skipped():  # synchronises: fine once per step in an example
            print(f"step {step}: skipped, non-finite gradients in {scaler.overflowed_params(model)}")
        else:
            sched.step()
    print(f"final scale {scaler.get_scale():g}, {scaler.stats()}")


if __name__ == "__main__":
    main()
