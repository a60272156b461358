"""llmmem.checkpoint as a drop-in for torch.utils.checkpoint (issue 14, items 6-10): option
types, patching torch with it, checkpoint_sequential's segments, GraphExecGroup and debug output."""

from __future__ import annotations

import contextlib
import inspect
import os

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc
from support.checkpointing import torch_debug_logs_stay_with_torch

import llmmem

HAS_GROUPS = hasattr(tuc, "GraphExecGroup")


# --- item 6: every bool option is a bool ------------------------------------------------------


@pytest.mark.parametrize("option", ["preserve_rng_state", "debug", "early_stop", "offload", "use_reentrant"])
@pytest.mark.parametrize("value", ["yes", 1, 0.0, [True]])
def test_a_non_bool_option_is_a_type_error_naming_it(option, value):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=rf"checkpoint: {option} must be a bool"):
        llmmem.checkpoint(torch.sin, x, **{option: value})
    with pytest.raises(TypeError, match=option):
        llmmem.checkpoint(**{option: value})  # the curried form checks too
    if option != "use_reentrant":
        with pytest.raises(TypeError, match=option):
            llmmem.checkpoint_sequential([torch.sin, torch.cos], 2, x, **{option: value})


def test_bool_options_take_bools_and_use_reentrant_none():
    np = pytest.importorskip("numpy")
    x = torch.randn(3, requires_grad=True)
    for opts in (
        dict(use_reentrant=None),
        dict(use_reentrant=False, offload=False, debug=False),
        dict(early_stop=np.bool_(False), preserve_rng_state=np.bool_(True)),
    ):
        llmmem.checkpoint(torch.sin, x, **opts).sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach().cos())


# --- item 7: torch.utils.checkpoint.checkpoint = llmmem.checkpoint -----------------------------


@contextlib.contextmanager
def _patched_torch():
    original = tuc.checkpoint
    tuc.checkpoint = llmmem.checkpoint
    try:
        yield
    finally:
        tuc.checkpoint = original


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))


def test_patched_over_torch_the_reentrant_path_reaches_torch():
    model = _mlp()
    x = torch.randn(4, 6, requires_grad=True)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    for run in (
        lambda: tuc.checkpoint(model, x, use_reentrant=True),
        lambda: tuc.checkpoint_sequential(model, 2, x, use_reentrant=True),  # calls tuc.checkpoint
        lambda: tuc.checkpoint(model, x, use_reentrant=False),
    ):
        model.zero_grad()
        x.grad = None
        with _patched_torch():
            run().square().sum().backward()
        got = [p.grad for p in model.parameters()] + [x.grad]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # torch's reentrant errors still come from torch
    with _patched_torch(), pytest.raises(ValueError, match="Unexpected keyword arguments"):
        tuc.checkpoint(lambda t, k: t * k, x, use_reentrant=True, k=2)


def test_reentrant_hand_off_without_torch_s_function(monkeypatch):
    """If torch's checkpoint was already replaced when llmmem was imported, the hand-off goes
    straight to torch's reentrant autograd Function, with torch's argument check."""
    from llmmem.checkpointing import core

    monkeypatch.setattr(core, "_torch_checkpoint", None)
    model = _mlp()
    x = torch.randn(4, 6, requires_grad=True)
    y = llmmem.checkpoint(model, x, use_reentrant=True)
    assert type(y.grad_fn).__name__ == "CheckpointFunctionBackward"
    y.sum().backward()
    assert x.grad is not None
    with pytest.raises(ValueError, match="Unexpected keyword arguments: k"):
        llmmem.checkpoint(lambda t, k: t * k, x, use_reentrant=True, k=2)


# --- item 8: checkpoint_sequential recomputes what torch's recomputes ---------------------------


class _Counted(nn.Module):
    def __init__(self, i: int, calls: list) -> None:
        super().__init__()
        self.i, self.calls = i, calls
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.calls.append(self.i)
        return torch.tanh(self.lin(x))


def _recomputed(run, n: int, segments: int, **kw) -> list:
    """Indices of the functions run during backward (the recomputed ones), in order."""
    calls: list = []
    torch.manual_seed(0)
    fns = nn.Sequential(*[_Counted(i, calls) for i in range(n)])
    x = torch.randn(2, 4, requires_grad=True)
    y = run(fns, segments, x, use_reentrant=False, **kw)
    assert sorted(calls) == list(range(n))  # the forward ran each once
    del calls[:]
    y.sum().backward()
    return calls


@pytest.mark.parametrize("n,segments", [(9, 5), (8, 4), (7, 3), (10, 3), (5, 5), (6, 1), (3, 2)])
def test_checkpoint_sequential_recomputes_torch_s_segments(n, segments):
    want = _recomputed(tuc.checkpoint_sequential, n, segments)
    assert _recomputed(llmmem.checkpoint_sequential, n, segments) == want
    if (n, segments) == (9, 5):
        assert sorted(want) == [0, 1, 2, 3]  # [1, 1, 1, 1, 5]: the last five run once


def test_checkpoint_sequential_even_split_on_request():
    # 9 in 5 evenly: [2, 2, 2, 2, 1], the first four segments recomputed
    assert sorted(_recomputed(llmmem.checkpoint_sequential, 9, 5, split="even")) == list(range(8))
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="split must be 'torch' or 'even'"):
        llmmem.checkpoint_sequential([torch.sin], 1, x, split="balanced")


# --- item 9: torch.utils.checkpoint.GraphExecGroup ---------------------------------------------


def _two_branches(calls: list):
    def fn(a, b):
        calls.append(1)
        return a.sin(), b.cos()  # sin saves a, cos saves b: two disjoint backward paths

    return fn


@pytest.mark.skipif(not HAS_GROUPS, reason="torch.utils.checkpoint.GraphExecGroup needs torch >= 2.10")
@pytest.mark.parametrize("impl", ["torch", "llmmem"])
def test_graph_exec_group_recomputes_once_for_two_grad_calls(impl):
    ckpt = llmmem.checkpoint if impl == "llmmem" else tuc.checkpoint
    runs = {}
    for grouped in (False, True):
        calls: list = []
        a = torch.randn(5, requires_grad=True)
        b = torch.randn(5, requires_grad=True)
        p, q = ckpt(_two_branches(calls), a, b, use_reentrant=False)
        ctx = tuc.GraphExecGroup() if grouped else contextlib.nullcontext()
        with ctx:
            (ga,) = torch.autograd.grad(p.sum(), a)
            (gb,) = torch.autograd.grad(q.sum(), b)
        torch.testing.assert_close(ga, a.detach().cos())
        torch.testing.assert_close(gb, -b.detach().sin())
        runs[grouped] = len(calls)
    assert runs == {False: 3, True: 2}  # forward + one recompute per grad call / per group


@pytest.mark.skipif(not HAS_GROUPS, reason="torch.utils.checkpoint.GraphExecGroup needs torch >= 2.10")
@pytest.mark.parametrize("impl", ["torch", "llmmem"])
def test_graph_exec_group_refuses_overlapping_backward_calls(impl):
    ckpt, error = (llmmem.checkpoint, llmmem.CheckpointError) if impl == "llmmem" else (tuc.checkpoint, None)
    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    p, _ = ckpt(_two_branches([]), a, b, use_reentrant=False)
    with tuc.GraphExecGroup():
        torch.autograd.grad(p.sum(), a, retain_graph=True)
        with pytest.raises(tuc.CheckpointError, match="GraphExecGroup") as info:
            torch.autograd.grad(p.sum(), a)  # needs the saved `a` again
    if error is not None:
        assert isinstance(info.value, error) and "non-overlapping" in str(info.value)
    # outside a group the same two calls are fine (each recomputes)
    p, _ = ckpt(_two_branches([]), a, b, use_reentrant=False)
    torch.autograd.grad(p.sum(), a, retain_graph=True)
    torch.autograd.grad(p.sum(), a)


# --- item 10: debug=True shows where each operator ran -----------------------------------------


def _changes_on_recompute():
    calls = []

    def fn(t):
        calls.append(1)
        y = t.sin()
        if len(calls) > 1:
            y = y.sum(0, keepdim=True)  # the recompute does something else
        return y.exp()

    return fn


@pytest.mark.parametrize("impl", ["torch", "llmmem"])
def test_debug_prints_each_operator_with_its_stack(impl):
    ckpt = llmmem.checkpoint if impl == "llmmem" else tuc.checkpoint
    x = torch.randn(3, requires_grad=True)
    with torch_debug_logs_stay_with_torch():
        out = ckpt(_changes_on_recompute(), x, use_reentrant=False, debug=True)
        with pytest.raises(tuc.CheckpointError) as info:
            out.sum().backward()
    text = str(info.value)
    here = os.path.basename(__file__)
    # the operators of both runs, and for each the line of this file that called it
    for op in ("aten.sin.default", "aten.exp.default", "aten.sum.dim_IntList"):
        assert op in text, op
    lines = text.splitlines()
    op_lines = [i for i, line in enumerate(lines) if "aten.sum.dim_IntList" in line]
    following = "\n".join(lines[op_lines[0] : op_lines[0] + 40])
    assert here in following and ("in fn" in following or ":fn" in following), following
    assert text.count(here) >= 4  # forward sin, exp; recompute sin, sum, exp: each with a frame here


def test_debug_stack_names_the_calling_line():
    x = torch.randn(3, requires_grad=True)
    out = llmmem.checkpoint(_changes_on_recompute(), x, debug=True)
    with pytest.raises(llmmem.CheckpointError) as info:
        out.sum().backward()
    text = str(info.value)
    source, first = inspect.getsourcelines(_changes_on_recompute)
    sum_line = first + next(i for i, line in enumerate(source) if "y.sum(0" in line)
    assert f"{__file__}:{sum_line} in fn" in text
    assert "float32[3] = aten.sin.default" in text and "float32[1] = aten.sum.dim_IntList" in text
    # without debug the error says how to get this
    out = llmmem.checkpoint(_changes_on_recompute(), x)
    with pytest.raises(llmmem.CheckpointError, match="pass debug=True"):
        out.sum().backward()
