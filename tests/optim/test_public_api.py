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
