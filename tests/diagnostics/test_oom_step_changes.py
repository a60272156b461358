"""oom_report says what the failed attempt changed: an out-of-memory error inside optimizer.step()
after some parameters were updated is reported as such (which ones, state inconsistent, restore,
do not retry), for torch's AdamW and for any other torch.optim.Optimizer; "untouched" only when no
parameter or state tensor was written. Checked against copies of the parameters and state."""

from __future__ import annotations

import pytest
import torch

import llmmem
from llmmem.diagnostics.tracker import MemoryTracker


def _mlp():
    """Four layers of growing size, so that an optimizer step's temporaries grow as it goes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 512),
    )


class PlainSGD(torch.optim.Optimizer):
    """Not one of torch's: a parameter at a time, with a temporary per parameter."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["steps"] = state.get("steps", 0) + 1
                p.sub_(p.grad * group["lr"])  # p.grad * lr: a temporary the size of p


class DataSGD(PlainSGD):
    """Writes through ``p.data``: a tensor with a version counter of its own, so ``p``'s stays put."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.sub_(p.grad * group["lr"])


class AllOrNothingSGD(PlainSGD):
    """Makes every temporary before it writes anything: a failure leaves everything as it was."""

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        updates = [p.grad * self.param_groups[0]["lr"] for p in params]
        for p, u in zip(params, updates):
            p.sub_(u)


OPTIMIZERS = {
    "torch AdamW": lambda params: torch.optim.AdamW(params, foreach=False),
    "a plain Optimizer subclass": PlainSGD,
    "writes through p.data": DataSGD,
}


def _step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state_copy(opt):
    return {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()}
        for g in opt.param_groups
        for p in g["params"]
    }


def _same(a, b) -> bool:
    return (
        all((torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]) for k, v in a.items())
        and a.keys() == b.keys()
    )


def _budget_inside_the_optimizer_step(model, opt, x) -> int:
    """A budget the forward and backward fit in and the optimizer step does not."""
    with MemoryTracker(model, opt) as tracker:
        _step(model, opt, x)
    peaks = tracker.phase_peaks()
    assert peaks["optimizer"] > max(peaks["forward"], peaks["backward"])
    return (max(peaks["forward"], peaks["backward"]) + peaks["optimizer"]) // 2


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_an_optimizer_step_that_fails_part_way_is_reported_with_what_it_updated(make):
    model = _mlp()
    opt = make(model.parameters())
    x = torch.randn(2, 32)
    _step(model, opt, x)
    budget = _budget_inside_the_optimizer_step(model, opt, x)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    state_before = _state_copy(opt)
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=budget, plan=False):
            _step(model, opt, x)
    updated = [n for n, p in params.items() if not torch.equal(p, before[n])]
    state_changed = [n for n, p in params.items() if not _same(_state_copy(opt)[id(p)], state_before[id(p)])]
    assert 0 < len(updated) < len(params)  # the failure really came part-way
    report = info.value.report
    assert report.failure["phase"] == "optimizer"
    text = str(info.value)
    assert "untouched" not in report.state, report.state
    assert f"{len(updated)} of {len(params)} parameters updated ({', '.join(updated)})" in text
    assert "optimizer state inconsistent: restore the step from a checkpoint; do not retry" in text
    assert text.splitlines()[1].startswith("training state INCONSISTENT")
    (failed,) = report.changes["failed_steps"]
    assert failed["optimizer"] == type(opt).__name__ and failed["parameters"] == len(params)
    assert failed["updated"] == updated and failed["state_changed"] == state_changed
    assert report.changes["consistent"] is False


def test_a_step_that_fails_before_any_write_seen_is_not_called_untouched():
    """No write recorded is no proof: a fused kernel or a C extension writes without version counters."""
    model = _mlp()
    opt = AllOrNothingSGD(model.parameters())
    x = torch.randn(2, 32)
    _step(model, opt, x)
    budget = _budget_inside_the_optimizer_step(model, opt, x)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=budget, plan=False):
            _step(model, opt, x)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    changes = info.value.report.changes
    assert changes["consistent"] is None and changes["failed_steps"][0]["updated"] == []
    text = str(info.value)
    assert "inside AllOrNothingSGD.step() before any write seen (version counters and every operator" in text
    assert "a C extension writing through data_ptr() is seen by neither" in text
    assert "untouched" not in info.value.report.state and "INCONSISTENT" not in text


def test_a_foreach_step_names_every_parameter_it_updated():
    """foreach=True (torch's default on CUDA): its in-place foreach kernels bump no version counter
    under a dispatch mode; the report must still name what the step wrote before it failed."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.01, foreach=True)
    x = torch.randn(2, 32)
    _step(model, opt, x)
    budget = _budget_inside_the_optimizer_step(model, opt, x)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    state_before = _state_copy(opt)
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=budget, plan=False):
            _step(model, opt, x)
    updated = [n for n, p in params.items() if not torch.equal(p, before[n])]
    state_changed = [n for n, p in params.items() if not _same(_state_copy(opt)[id(p)], state_before[id(p)])]
    assert updated and state_changed  # the failure came after the foreach kernels wrote
    assert info.value.report.failure["phase"] == "optimizer"
    (failed,) = info.value.report.changes["failed_steps"]
    assert failed["updated"] == updated and failed["state_changed"] == state_changed
    assert f"{len(updated)} of {len(params)} parameters updated" in str(info.value)
    assert info.value.report.changes["consistent"] is False


def _fail_after_the_kernels(opt, args, kwargs):
    raise llmmem.OutOfMemoryError("simulated: out of memory after the optimizer's kernels ran")


@pytest.mark.parametrize("track", [True, False])
def test_a_fused_step_that_wrote_is_named_when_the_tracker_hears_it(track):
    """torch's fused AdamW bumps no version counter: with the tracker on, its writes are heard from
    the operator's schema; without, the report says it cannot tell."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(2, 32)
    _step(model, opt, x)
    names = [n for n, _ in model.named_parameters()]
    handle = opt.register_step_post_hook(_fail_after_the_kernels)  # runs before the global post hooks
    try:
        with pytest.raises(llmmem.OutOfMemoryError) as info:
            with llmmem.oom_report(model, opt, plan=False, track=track):
                _step(model, opt, x)
    finally:
        handle.remove()
    (failed,) = info.value.report.changes["failed_steps"]
    text = str(info.value)
    assert failed["fused"] and failed["writes_heard"] is track
    if track:
        assert failed["updated"] == names and failed["state_changed"] == names
        assert "a fused kernel writes parameters without their version counters" not in text
        assert info.value.report.changes["consistent"] is False
    else:
        # the parameters' writes are unseen; the step counts' (a foreach add, which bumps) are seen
        assert failed["updated"] == [] and failed["state_changed"] == names
        assert "a fused kernel writes parameters without their version counters: more may be updated" in text
        assert info.value.report.changes["consistent"] is False
    assert "untouched" not in info.value.report.state


def test_a_fused_step_is_never_called_untouched():
    """torch's fused AdamW writes its parameters without bumping their version counters; its first
    step makes the moments one parameter at a time, and fails part-way through that here."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(2, 32)
    twin, twin_opt = _mlp(), None
    twin_opt = torch.optim.AdamW(twin.parameters(), fused=True)
    budget = _budget_inside_the_optimizer_step(twin, twin_opt, x)  # the twin's first step
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=budget, plan=False):
            _step(model, opt, x)
    made = [n for n, p in model.named_parameters() if p in opt.state]
    assert 0 < len(made) < len(list(model.parameters()))
    (failed,) = info.value.report.changes["failed_steps"]
    assert failed["fused"] and failed["state_changed"] == made
    assert "untouched" not in info.value.report.state


def test_a_failure_in_the_backward_leaves_the_parameters_untouched():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 32)
    _step(model, opt, x)
    with MemoryTracker(model, opt) as tracker:
        _step(model, opt, x)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=tracker.phase_peaks()["forward"] + 1, plan=False):
            _step(model, opt, x)
    assert info.value.report.failure["phase"] == "backward"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert info.value.report.changes["consistent"] is True
    assert (
        "no optimizer step began and no parameter was written in place: parameters and optimizer state untouched"
        in (str(info.value))
    )


def test_steps_completed_before_the_failure_are_said_to_be_kept():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 32)
    _step(model, opt, x)
    with MemoryTracker(model, opt) as tracker:
        _step(model, opt, x)
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, opt, budget=tracker.peak_bytes() + 2**16, plan=False):
            _step(model, opt, x)
            _step(model, opt, x)
            torch.empty(2**20)  # 4 MiB: out of memory after two whole steps
    changes = info.value.report.changes
    assert changes["completed_steps"] == {"AdamW": 2} and changes["consistent"] is True
    text = str(info.value)
    assert "2 AdamW.step() completed inside the block before the failure (their updates are kept)" in text
    assert "untouched" not in info.value.report.state


def test_parameters_written_outside_a_step_and_buffers_are_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    with pytest.raises(llmmem.OutOfMemoryError) as info:
        with llmmem.oom_report(model, budget="1MiB", plan=False):
            with torch.no_grad():
                model[0].bias.add_(1)
            model(torch.randn(4, 8))  # BatchNorm's running statistics are written
            torch.empty(2**20)
    changes = info.value.report.changes
    assert changes["changed_outside_steps"] == ["0.bias"] and changes["consistent"] is None
    # the running mean and variance are written by a kernel that bumps no version counter (heard
    # from the tracker's dispatch mode); the count of batches is added to in place
    assert changes["buffers_changed"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    text = str(info.value)
    assert "1 parameter(s) written in place outside any optimizer step (0.bias)" in text
    assert "untouched" not in info.value.report.state


def test_with_nothing_to_watch_the_state_is_unknown_not_untouched():
    with pytest.raises(RuntimeError) as info:
        with llmmem.oom_report():
            torch.empty(2**48, dtype=torch.uint8)  # refused by the CPU allocator
    text = str(info.value)
    assert (
        "whether parameters or optimizer state changed is unknown" in text
        and "untouched" not in info.value.report.state
    )
    assert info.value.report.changes["consistent"] is None


def test_the_step_hooks_are_removed_after_the_block():
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    counts = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    with llmmem.oom_report(model, opt, track=False):
        _step(model, opt, torch.randn(2, 32))
    with pytest.raises(KeyError), llmmem.oom_report(model, opt, track=False):
        raise KeyError("x")
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == counts
