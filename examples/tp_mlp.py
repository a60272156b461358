"""A tensor-parallel MLP trained for a few steps, checked against the same MLP on one process.

Run on CPU with 2 ranks (gloo; llmmem's shared-memory collectives are used automatically):

    torchrun --nproc_per_node 2 examples/tp_mlp.py

or on GPUs (NCCL; llmmem's CUDA IPC all-reduce for small messages is opt-in with
``LLMMEM_TP_CUDA_IPC=1``): ``--device cuda``. Every rank
builds the single-process reference with the same seed, so the script prints how far the TP
model is from it after training (fp32 rounding only).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import llmmem
import llmmem.parallel as tp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    tp.init(backend="nccl" if a.device == "cuda" else "gloo")  # all ranks form one TP group
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    h = a.hidden

    torch.manual_seed(0)  # same seed on every rank: TP shards are slices of the reference weights
    ref = nn.Sequential(nn.Linear(h, 4 * h, device=dev), nn.GELU(), nn.Linear(4 * h, h, device=dev))
    torch.manual_seed(0)
    model = nn.Sequential(
        llmmem.ColumnParallelLinear(h, 4 * h, device=dev), nn.GELU(), llmmem.RowParallelLinear(4 * h, h, device=dev)
    )
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator(device="cpu").manual_seed(1)
    for step in range(a.steps):
        x = torch.randn(32, h, generator=g).to(dev)
        y = torch.randn(32, h, generator=g).to(dev)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.5f}")
    diff = (model[0].full_weight() - ref[0].weight).abs().max().item()
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"TP={world}: max |W_tp - W_ref| after {a.steps} steps = {diff:.2e}; "
            f"parameters per rank {params} vs {sum(p.numel() for p in ref.parameters())} on one device"
        )
    tp.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
