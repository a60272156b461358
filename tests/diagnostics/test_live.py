"""LiveBytes: exact live tensor bytes on the CPU, checked against storages counted by hand."""

from __future__ import annotations

import gc

import pytest
import torch

import llmmem
from llmmem.diagnostics.live import LiveBytes
from llmmem.models.gpt import GPT, GPTConfig


def test_counts_each_storage_once_and_frees():
    with LiveBytes() as live:
        a = torch.empty(1000)  # 4000 B
        b = a[10:20]  # a view: same storage
        c = a.view(10, 100).t()  # another view
        assert live.allocated() == 4000
        d = torch.empty(250, dtype=torch.float64)  # 2000 B
        assert live.allocated() == 6000 and live.max_allocated() == 6000
        del a, b
        assert live.allocated() == 6000  # c still holds the storage
        del c
        assert live.allocated() == 2000
        del d
        assert live.allocated() == 0 and live.max_allocated() == 6000
        live.reset_peak()
        assert live.max_allocated() == 0


def test_in_place_growth_and_out_arguments_are_re_read():
    with LiveBytes() as live:
        x = torch.empty(10)
        x.resize_(1000)
        assert live.allocated() == 4000
        out = torch.empty(0)
        torch.add(torch.ones(100), 1, out=out)
        # torch.ones(100) was a temporary, freed when the operator returned
        assert live.allocated() == 4000 + out.untyped_storage().nbytes() == 4400


def test_tracked_existing_tensors_and_gc_mode():
    model = torch.nn.Linear(100, 10)
    expected = sum(p.untyped_storage().nbytes() for p in model.parameters())
    with LiveBytes() as live:
        assert live.allocated() == 0
        live.track(model)
        live.track(model)  # idempotent
        assert live.allocated() == expected
    with LiveBytes(existing="gc") as live:
        assert live.allocated() >= expected
    with pytest.raises(ValueError, match="existing"):
        LiveBytes(existing="all")


def test_training_step_peak_matches_storages_counted_by_hand():
    """A GPT step: the counter's value after backward equals the storages reachable from the
    model, its gradients and the optimizer state, counted independently."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, layers=2, heads=2, hidden=32)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 64, (2, 16))
    with LiveBytes() as live:
        live.track(model)
        live.track(idx)
        before = live.allocated()
        logits, loss = model(idx, targets=idx)
        del logits
        peak_fwd = live.allocated()
        assert peak_fwd > before  # activations kept for backward
        loss.backward()
        del loss
        gc.collect()
        opt.step()
        storages = {}
        for t in list(model.parameters()) + list(model.buffers()) + [p.grad for p in model.parameters()] + [idx]:
            storages[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    storages[id(v.untyped_storage())] = v.untyped_storage().nbytes()
        assert live.allocated() == sum(storages.values())
        assert live.max_allocated() >= peak_fwd


def test_checkpointing_lowers_the_measured_peak():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        [
            torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            for _ in range(4)
        ]
    )
    x = torch.randn(2048, 256, requires_grad=True)

    def peak(ckpt: bool) -> int:
        with LiveBytes() as live:
            h = x
            for b in blocks:
                h = llmmem.checkpoint(b, h) if ckpt else b(h)
            h.sum().backward()
            return live.max_allocated()

    assert peak(True) < 0.6 * peak(False)
    x.grad = None


def test_counts_nothing_on_meta_and_never_changes_results():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    (w @ w).sum().backward()
    expected = w.grad.clone()
    w.grad = None
    with LiveBytes() as live:
        torch.empty(100, device="meta")
        assert live.allocated() == 0
        (w @ w).sum().backward()
    assert torch.equal(w.grad, expected)
