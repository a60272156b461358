"""The planner's inputs and side effects (issue 15, leftovers): profiling leaves the random state
and the gradients as they were (also when it raises), a sample the model cannot be called with is
a clear error naming ``sample``, budgets as percent strings, and a chain that holds a module twice
or blocks sharing a trained weight are refused, naming them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import llmmem
from llmmem.models.gpt import GPT, GPTConfig


def _gpt(layers=4, dropout=0.1):
    torch.manual_seed(0)
    cfg = GPTConfig(layers=layers, hidden=32, heads=2, seq_len=32, vocab_size=64, dropout=dropout)
    return GPT(cfg).train(), torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))


def _set_grads(params, seed=5):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.rand(p.shape, generator=g)
    return [(p.grad, p.grad.clone()) for p in params]


def _grads_as_before(params, before) -> bool:
    return all(p.grad is obj and torch.equal(obj, copy) for p, (obj, copy) in zip(params, before))


def _next_draws():
    return torch.rand(8)


class _FailsWithGrad(nn.Module):
    """Runs without a graph (the chain's first pass), raises once profiling builds one."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        if torch.is_grad_enabled():
            raise RuntimeError("profiling this block fails")
        return self.drop(self.lin(x))


def test_profile_blocks_keeps_the_random_stream_and_the_grads():
    model, idx = _gpt()
    x0 = model.embed(idx).detach()
    params = list(model.blocks.parameters())
    torch.manual_seed(11)
    expected = _next_draws()

    torch.manual_seed(11)
    before = _set_grads(params)
    llmmem.profile_blocks(model.blocks, x0, repeats=1, warmup=0)
    assert torch.equal(_next_draws(), expected), "profile_blocks moved the random stream (dropout in the chain)"
    assert _grads_as_before(params, before)

    # and when profiling raises half-way (after the chain ran and its dropout drew numbers)
    blocks = [model.blocks[0], model.blocks[1], _FailsWithGrad(32)]
    params = [p for b in blocks for p in b.parameters()]
    torch.manual_seed(11)
    before = _set_grads(params)
    with pytest.raises(RuntimeError, match="profiling this block fails"):
        llmmem.profile_blocks(blocks, x0, repeats=1, warmup=0)
    assert torch.equal(_next_draws(), expected)
    assert _grads_as_before(params, before)


def test_auto_checkpoint_on_a_model_keeps_the_grads_untouched():
    # profiling's backward passes must not accumulate into the caller's gradients (in place)
    model, idx = _gpt()
    params = list(model.parameters())
    before = _set_grads(params)
    torch.manual_seed(3)
    expected = _next_draws()
    torch.manual_seed(3)
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=(idx, idx), repeats=1)
    plan.remove()
    assert torch.equal(_next_draws(), expected)
    assert _grads_as_before(params, before)


def test_a_sample_the_model_cannot_take_is_a_clear_error():
    model, idx = _gpt()
    batch = {"idx": idx, "targets": idx}
    with pytest.raises(TypeError) as info:
        llmmem.auto_checkpoint(model, budget=0.5, sample=[batch])  # a list holding the batch dict
    msg = str(info.value)
    assert "sample" in msg and "model(*sample)" in msg and "list" in msg and "dict" in msg, msg
    assert "model(**sample)" in msg and "callable" in msg, msg  # what sample may be
    assert info.value.__cause__ is not None  # chained from the model's own error
    assert all("forward" not in b.__dict__ for b in model.blocks)

    with pytest.raises(TypeError, match=r"model\(\*\*sample\)") as info:
        llmmem.auto_checkpoint(model, budget=0.5, sample={"tokens": idx})
    assert "tokens" in str(info.value) and "Tensor" in str(info.value)
    # other errors keep their type (callers catch an out-of-memory or an index error as such), with a note
    with pytest.raises(RuntimeError) as info:
        llmmem.auto_checkpoint(model, budget=0.5, sample=torch.randn(2, 32))  # floats as token ids
    if hasattr(info.value, "add_note"):
        notes = " ".join(info.value.__notes__)
        assert "model(sample)" in notes and "float32" in notes, notes
    with pytest.raises(IndexError):
        llmmem.auto_checkpoint(model, budget=0.5, sample=(idx + 1000, idx))  # token ids beyond the vocabulary
    assert all("forward" not in b.__dict__ for b in model.blocks)


class _Model(nn.Module):
    def __init__(self, fail_in_block: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.fail_in_block = fail_in_block

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if self.fail_in_block and i == 2:
                raise KeyError("the model's own error")
            x = b(x)
        return x.sum()


def test_errors_after_the_blocks_started_are_the_model_s_own():
    model = _Model(fail_in_block=True)
    with pytest.raises(KeyError, match="the model's own error"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=torch.randn(4, 8))
    # a callable sample is the user's own step: its errors pass through as they are
    model = _Model(fail_in_block=False)

    def step():
        raise ValueError("my step")

    with pytest.raises(ValueError, match="my step"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=step)


def test_budget_as_a_percent_string():
    model, idx = _gpt(dropout=0.0)
    x0 = model.embed(idx).detach()
    prof = llmmem.profile_blocks(model.blocks, x0, repeats=0, warmup=0)
    for text, fraction in (("50%", 0.5), ("12.5 %", 0.125), ("100%", 1.0)):
        try:
            as_fraction = llmmem.plan_checkpoints(None, budget=fraction, profile=prof).budget_bytes
        except llmmem.InfeasibleError as e:
            as_fraction = None
            with pytest.raises(llmmem.InfeasibleError):
                llmmem.plan_checkpoints(None, budget=text, profile=prof)
            assert str(e)
            continue
        assert llmmem.plan_checkpoints(None, budget=text, profile=prof).budget_bytes == as_fraction, text
    for bad in ("0%", "150%", "-5%", "%", "abc%", True, 1.5, 0.0, "lots", -3, None, [1]):
        with pytest.raises((ValueError, TypeError)) as info:
            llmmem.plan_checkpoints(None, budget=bad, profile=prof)
        msg = str(info.value)
        assert "budget" in msg, msg
        for form in ("bytes", "'6GB'", "(0, 1]", "'50%'"):
            assert form in msg, (bad, msg)
    plan = llmmem.auto_checkpoint(model, budget="50%", sample=(idx, idx), repeats=0)
    assert plan.budget_bytes == int(0.5 * plan.no_checkpoint_peak_bytes)
    plan.remove()


def test_parse_budget_is_the_one_reading_of_a_budget():
    from llmmem.checkpointing import parse_budget

    assert parse_budget(0.5) == 0.5 and parse_budget("50%") == 0.5 and parse_budget("12.5 %") == 0.125
    assert parse_budget(4096) == 4096 and parse_budget("1KiB") == 1024
    for bad in (0.0, 1.5, "0%", "150%", "x%", True, "lots"):
        with pytest.raises(ValueError, match="expected bytes") as info:
            parse_budget(bad, "--budget")
        assert str(info.value).startswith("--budget: budget")


def _mlp(d=16):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def test_the_same_module_twice_in_a_chain_is_a_clear_error():
    """Was: profiled and planned as distinct blocks, and the plan's peak then ran 37-55% over its budget
    (the shared weights' gradients held between their uses); or, on a whole model, a plan installed
    on the module twice, whose first step died in a RecursionError."""
    torch.manual_seed(0)
    a, b = _mlp(), _mlp()
    x = torch.randn(4, 16)
    same = r"blocks\[2\] is blocks\[0\], the same Sequential module"
    with pytest.raises(ValueError, match=rf"^profile_blocks: {same}"):
        llmmem.profile_blocks([a, b, a], x, repeats=0)
    with pytest.raises(ValueError, match=rf"^plan_checkpoints: {same}"):
        llmmem.plan_checkpoints([a, b, a], x, budget=0.5, repeats=0)
    with pytest.raises(ValueError, match=rf"^auto_checkpoint: {same}"):
        llmmem.auto_checkpoint(nn.ModuleList([a, b, a]), x, budget=0.5)

    model, idx = _gpt()
    twice = [model.blocks[0], model.blocks[1], model.blocks[1], model.blocks[2]]
    with pytest.raises(ValueError, match=r"^auto_checkpoint: '4 blocks': blocks\[2\] is blocks\[1\]"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=(idx, idx), blocks=twice, repeats=0)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing installed
    model(idx, idx)[1].backward()

    class Looped(nn.Module):  # one block run three times (shared weights), found as the chain
        def __init__(self):
            super().__init__()
            self.block = _mlp()
            self.layers = nn.ModuleList([self.block] * 3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    with pytest.raises(ValueError, match=r"^auto_checkpoint: 'layers': blocks\[1\] is blocks\[0\]"):
        llmmem.auto_checkpoint(Looped(), budget=0.5, sample=x, repeats=0)


def test_blocks_sharing_a_trained_weight_are_named_and_frozen_ones_are_fine():
    torch.manual_seed(0)
    blocks = [_mlp() for _ in range(3)]
    blocks[2][0].weight = blocks[0][0].weight
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"blocks\[0\] and blocks\[2\] share a parameter that trains \('0.weight'"):
        llmmem.plan_checkpoints(blocks, x, budget=0.5, repeats=0)
    blocks[0][0].weight.requires_grad_(False)  # a frozen shared weight gets no gradient to hold
    plan = llmmem.plan_checkpoints(blocks, x, budget=0.7, repeats=0)
    assert plan.n_blocks == 3
