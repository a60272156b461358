"""MemoryTracker under tensor parallelism: each rank reports its own rank and holds its share of
the weights (gloo on CPU, spawned ranks). No test helper imports here: the ranks load this file."""

from __future__ import annotations

import pytest
import torch


def _tracked_rank(rank, world):
    import llmmem
    from llmmem.models.gpt import GPT, GPTConfig
    from llmmem.parallel.gpt import TensorParallelGPT

    torch.manual_seed(0)
    ref = GPT(GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab_size=64, dropout=0.0))
    model = TensorParallelGPT.from_gpt(ref)
    opt = torch.optim.AdamW(model.parameters())
    with llmmem.MemoryTracker(model, opt) as tracker:
        idx = torch.randint(0, 64, (2, 16))
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
    assert tracker.rank == {
        "rank": rank,
        "world_size": world,
        "tensor_parallel_rank": rank,
        "tensor_parallel_size": world,
    }
    assert f"rank {rank} of {world} (tensor-parallel rank {rank} of {world})" in tracker.table()
    mine = tracker.current()["parameters"]
    assert mine == sum(p.untyped_storage().nbytes() for p in model.parameters())
    full = sum(p.untyped_storage().nbytes() for p in ref.parameters())
    assert mine < 0.75 * full  # the big matrices are split; norms and positions are replicated
    assert tracker.current()["gradients"] == sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert tracker.to_dict()["rank"]["rank"] == rank
    rows = {r["module"]: r for r in tracker.modules()}
    assert rows["TensorParallelGPT.blocks.0"]["kept_for_backward"] > 0
    print("tracker rank check passed")


@pytest.mark.distributed
def test_each_rank_reports_its_rank_and_its_share():
    from llmmem.parallel.ranks import run_ranks

    results = run_ranks(__file__, "_tracked_rank", 2, timeout=180)
    assert all("tracker rank check passed" in r.output for r in results)
