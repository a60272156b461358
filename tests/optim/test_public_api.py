"""llmmem.optim as users reach it: ``import llmmem`` then ``llmmem.optim.AdamW`` (DESIGN.md's
spelling), loaded only when first touched (``import llmmem`` alone still imports no torch)."""

from __future__ import annotations

from support.procs import run_python


def test_llmmem_optim_is_an_attribute_loaded_on_first_use():
    proc = run_python(
        """
        import sys, llmmem
        assert "torch" not in sys.modules
        assert "optim" in dir(llmmem)
        import torch
        p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)
        llmmem.optim.AdamW([p], lr=0.1).step()
        print(llmmem.optim.step_in_backward.__name__, float(p[0]) < 1.0)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["step_in_backward", "True"]


def test_memory_tracker_counts_quantized_state_as_optimizer_state():
    import torch

    import llmmem
    import llmmem.optim as lo

    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = lo.AdamW(m.parameters(), state_dtype="int8")
    x = torch.randn(8, 256)
    with llmmem.MemoryTracker(model=m, optimizer=opt) as tracker:
        for _ in range(2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    state = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )
    assert tracker.current()["optimizer_state"] == state  # int8 codes, uint8 codes, scales and steps
