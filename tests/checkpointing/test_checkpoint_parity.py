"""Parity of llmmem's checkpoint API with torch.utils.checkpoint, scenario by scenario.

Each scenario is one function that takes an API (torch's or llmmem's: ``checkpoint``,
``checkpoint_sequential``, ``CheckpointError``) and returns what it observed: outputs, gradients,
how often the checkpointed function ran, and so on. It runs once per API from the same seed, and
the two runs must agree on

* the results: tensors bitwise (CPU), everything else by ``==``;
* the error: both raise, llmmem's error is an instance of torch's error's type, and the scenario's
  key words are in both messages (the wording is llmmem's own);
* the warnings: the same categories, and the scenario's key words in both.

Where llmmem differs on purpose the difference is listed in ``DOCUMENTED`` and asserted as such,
so that a change on either side shows up. Every scenario passes ``use_reentrant`` explicitly,
except the one that checks the default.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc
from support.checkpointing import torch_debug_logs_stay_with_torch

import llmmem


@dataclass(frozen=True)
class Api:
    name: str
    checkpoint: Callable
    checkpoint_sequential: Callable
    CheckpointError: type


TORCH = Api("torch", tuc.checkpoint, tuc.checkpoint_sequential, tuc.CheckpointError)
LLMMEM = Api("llmmem", llmmem.checkpoint, llmmem.checkpoint_sequential, llmmem.CheckpointError)


@dataclass
class Scenario:
    run: Callable  # (api) -> observations
    error_words: tuple = ()  # key words of the error both raise (None raised: empty)
    warning_words: tuple = ()  # key words of the warnings both issue
    needs: Callable = lambda: True  # skip when False (a torch feature this version lacks)
    reason: str = ""


@dataclass
class Outcome:
    observed: object = None
    error: BaseException | None = None
    warnings: list = field(default_factory=list)


def _observe(scenario: Scenario, api: Api) -> Outcome:
    out = Outcome()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, torch_debug_logs_stay_with_torch():
        warnings.simplefilter("always")
        try:
            out.observed = scenario.run(api)
        except Exception as exc:  # the scenario's error is part of what is compared
            out.error = exc
    # torch's own deprecation notices (e.g. of an internal it calls) are not behaviour
    out.warnings = [w for w in caught if not issubclass(w.category, (DeprecationWarning, FutureWarning))]
    return out


def _same(a, b, where="result") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (where, (a.float() - b.float()).abs().max())
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, (where, a, b)


def _compare(scenario: Scenario, theirs: Outcome, ours: Outcome) -> None:
    if theirs.error is not None:
        assert ours.error is not None, f"torch raised {theirs.error!r}; llmmem did not"
        assert isinstance(ours.error, type(theirs.error)), (type(theirs.error), type(ours.error), str(ours.error))
        for word in scenario.error_words:
            assert word.lower() in str(theirs.error).lower(), ("torch", word, str(theirs.error))
            assert word.lower() in str(ours.error).lower(), ("llmmem", word, str(ours.error))
    else:
        assert ours.error is None, f"llmmem raised {ours.error!r}; torch did not"
        _same(theirs.observed, ours.observed)
    assert sorted(w.category.__name__ for w in theirs.warnings) == sorted(
        w.category.__name__ for w in ours.warnings
    ), (
        [str(w.message) for w in theirs.warnings],
        [str(w.message) for w in ours.warnings],
    )
    for word in scenario.warning_words:
        for side, outcome in (("torch", theirs), ("llmmem", ours)):
            assert any(word.lower() in str(w.message).lower() for w in outcome.warnings), (side, word)


# --------------------------------------------------------------------------------------------
# Helpers the scenarios share


def _mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(dropout), nn.Linear(16, 8), nn.Tanh())


def _grads(module: nn.Module, *tensors) -> list:
    return [p.grad for p in module.parameters()] + [t.grad for t in tensors]


def _x(*shape, grad=True):
    return torch.randn(*shape, requires_grad=grad)


class _Counter:
    """A function that counts its runs (the forward, then each recompute)."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.runs = fn, 0

    def __call__(self, *args, **kwargs):
        self.runs += 1
        return self.fn(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Scenarios


def plain(api):
    m, x = _mlp(), _x(4, 8)
    f = _Counter(m)
    y = api.checkpoint(f, x, use_reentrant=False)
    y.square().sum().backward()
    return y.detach(), _grads(m, x), f.runs


def kwargs_and_nested_inputs(api):
    lin = nn.Linear(8, 8)
    x, b = _x(3, 8), _x(8)

    def fn(inputs, *, scale, bias=None, tag="t"):
        h = lin(inputs["x"]) * scale + bias
        return {"out": h.relu(), "tag": tag, "parts": [h.sum(), inputs["pair"][1] * 2]}

    out = api.checkpoint(fn, {"x": x, "pair": (1, b)}, use_reentrant=False, scale=0.5, bias=b, tag="k")
    (out["out"].sum() + out["parts"][0] + out["parts"][1].sum()).backward()
    return out["tag"], out["out"].detach(), _grads(lin, x, b)


def non_tensor_outputs(api):
    x = _x(5)
    out = api.checkpoint(lambda t: (t.exp(), 3, "s", None, (t.sin(), 2.5)), x, use_reentrant=False)
    (out[0].sum() + out[4][0].sum()).backward()
    return out[1:4], out[4][1], x.grad


def nested(api):
    m1, m2 = _mlp(), nn.Linear(8, 8)
    x = _x(4, 8)
    inner = _Counter(m2)

    def outer(t):
        return api.checkpoint(inner, m1(t), use_reentrant=False).sin()

    y = api.checkpoint(outer, x, use_reentrant=False)
    y.sum().backward()
    return y.detach(), _grads(m1, x) + _grads(m2), inner.runs


def rng_dropout(api):
    m, x = _mlp(dropout=0.5), _x(16, 8)
    y = api.checkpoint(m, x, use_reentrant=False)
    y.sum().backward()
    return y.detach(), _grads(m, x), torch.rand(3)  # the RNG moved on by the forward only


def rng_not_preserved(api):
    m, x = _mlp(dropout=0.5), _x(16, 8)
    y = api.checkpoint(m, x, use_reentrant=False, preserve_rng_state=False)
    y.sum().backward()
    return y.detach(), _grads(m, x)  # a recompute with other masks: the same on both sides


def autocast_bf16(api):
    m, x = _mlp(), _x(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = api.checkpoint(m, x, use_reentrant=False)
    y.float().sum().backward()  # backward outside autocast: the recompute must replay it
    return y.dtype, y.detach(), _grads(m, x)


def _early_stop(api, early_stop):
    after_last_save = []

    def fn(t):
        y = t.exp()  # the last tensor saved for backward
        after_last_save.append(1)
        return y * 2

    x = _x(4)
    # early_stop=None: the option is not passed (torch < 2.9 would hand it to the function)
    options = {} if early_stop is None else {"early_stop": early_stop}
    api.checkpoint(fn, x, use_reentrant=False, **options).sum().backward()
    return x.grad, len(after_last_save)


early_stop_on = functools.partial(_early_stop, early_stop=True)
early_stop_off = functools.partial(_early_stop, early_stop=False)


def early_stop_global_switch(api):
    with tuc.set_checkpoint_early_stop(False):
        return _early_stop(api, None)


def _changes_when_run_again(change: str):
    runs = []

    def fn(t):
        runs.append(1)
        if len(runs) > 1 and change == "shape":
            t = t[:2]
        y = t.exp()
        if len(runs) > 1 and change == "count":
            return y.sum()  # saves one tensor fewer
        return y.sin().sum()

    return fn


def determinism_shape(api):
    api.checkpoint(_changes_when_run_again("shape"), _x(4, 3), use_reentrant=False).backward()


def determinism_count(api):
    with tuc.set_checkpoint_early_stop(False):  # the whole recompute runs, and saves one tensor fewer
        api.checkpoint(_changes_when_run_again("count"), _x(4, 3), use_reentrant=False).backward()


def determinism_none(api):
    x = _x(4, 3)
    api.checkpoint(_changes_when_run_again("shape"), x, use_reentrant=False, determinism_check="none").backward()
    return x.grad


def determinism_check_bad_value(api):
    api.checkpoint(torch.sin, _x(3), use_reentrant=False, determinism_check="sometimes")


def selective_policy(api):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(str(op))
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    w1, w2, x = _x(8, 8), _x(8, 8), _x(4, 8)

    def fn(t):
        return torch.mm(torch.mm(t, w1).sin(), w2).cos()

    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    api.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    return [w1.grad, w2.grad, x.grad], seen


def context_fn_entered(api):
    entered = []

    @contextlib.contextmanager
    def note(what):
        entered.append(what)
        yield

    def ctx_fn():
        return note("forward"), note("recompute")

    x = _x(3)
    api.checkpoint(torch.sin, x, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    return entered, x.grad


def retain_graph_twice(api):
    m, x = _mlp(), _x(4, 8)
    f = _Counter(m)
    y = api.checkpoint(f, x, use_reentrant=False).sum()
    y.backward(retain_graph=True)
    y.backward()
    return _grads(m, x), f.runs


def autograd_grad_and_inputs(api):
    m, x = _mlp(), _x(4, 8)
    y = api.checkpoint(m, x, use_reentrant=False).sum()
    (gx,) = torch.autograd.grad(y, x, retain_graph=True)
    y.backward(inputs=[x])
    return gx, x.grad, [p.grad for p in m.parameters()]


def backward_inside_the_function(api):
    w = _x(3)

    def fn(t):
        with torch.enable_grad():
            inner = (t * w).sum()
            (g,) = torch.autograd.grad(inner, t, create_graph=True)
        return g * t

    x = _x(3)
    api.checkpoint(fn, x, use_reentrant=False).sum().backward()
    return x.grad, w.grad


def unpack_twice(api):
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * 2

        @staticmethod
        def backward(ctx, g):
            ctx.saved_tensors  # read once ...
            (t,) = ctx.saved_tensors  # ... and again
            return g * 2

    api.checkpoint(lambda t: ReadsTwice.apply(t.sin()), _x(3), use_reentrant=False).sum().backward()


def reentrant(api):
    m, x = _mlp(dropout=0.25), _x(4, 8)
    y = api.checkpoint(m, x, use_reentrant=True)
    y.sum().backward()
    return y.detach(), _grads(m, x)


def reentrant_no_input_needs_grad(api):
    m = _mlp()
    x = _x(4, 8, grad=False)
    y = api.checkpoint(m, x, use_reentrant=True)
    return y.requires_grad


def reentrant_with_autograd_grad(api):
    m, x = _mlp(), _x(4, 8)
    y = api.checkpoint(m, x, use_reentrant=True).sum()
    torch.autograd.grad(y, x)


def reentrant_kwargs(api):
    api.checkpoint(lambda t, s: t * s, _x(3), use_reentrant=True, s=2.0)


def reentrant_context_fn(api):
    api.checkpoint(torch.sin, _x(3), use_reentrant=True, context_fn=lambda: (contextlib.nullcontext(),) * 2)


def debug_with_context_fn(api):
    api.checkpoint(
        torch.sin, _x(3), use_reentrant=False, debug=True, context_fn=lambda: (contextlib.nullcontext(),) * 2
    )


def grad_disabled(api):
    f = _Counter(torch.sin)
    with torch.no_grad():
        y = api.checkpoint(f, _x(3), use_reentrant=False)
    return y.requires_grad, f.runs


def _sequential(api, n, segments, use_reentrant):
    runs = []

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i, self.lin = i, nn.Linear(6, 6)

        def forward(self, t):
            runs.append(self.i)
            return torch.tanh(self.lin(t))

    torch.manual_seed(2)
    seq = nn.Sequential(*[Block(i) for i in range(n)])
    x = _x(3, 6)
    y = api.checkpoint_sequential(seq, segments, x, use_reentrant=use_reentrant)
    forward_runs = list(runs)
    y.sum().backward()
    return y.detach(), _grads(seq, x), forward_runs, runs[len(forward_runs) :]


sequential_9_in_5 = functools.partial(_sequential, n=9, segments=5, use_reentrant=False)
sequential_8_in_3 = functools.partial(_sequential, n=8, segments=3, use_reentrant=False)
sequential_reentrant = functools.partial(_sequential, n=7, segments=2, use_reentrant=True)


def sequential_unknown_kwarg(api):
    api.checkpoint_sequential([torch.sin, torch.cos], 2, _x(3), use_reentrant=False, foo=1)


def _has_early_stop_option() -> bool:
    return "early_stop" in inspect.signature(tuc.checkpoint).parameters


def _has_groups() -> bool:
    return hasattr(tuc, "GraphExecGroup")


def graph_exec_group(api):
    f = _Counter(lambda a, b: (a.sin(), b.cos()))
    a, b = _x(5), _x(5)
    p, q = api.checkpoint(f, a, b, use_reentrant=False)
    with tuc.GraphExecGroup():
        (ga,) = torch.autograd.grad(p.sum(), a)
        (gb,) = torch.autograd.grad(q.sum(), b)
    return ga, gb, f.runs


def graph_exec_group_overlap(api):
    a, b = _x(5), _x(5)
    p, _ = api.checkpoint(lambda u, v: (u.sin(), v.cos()), a, b, use_reentrant=False)
    with tuc.GraphExecGroup():
        torch.autograd.grad(p.sum(), a, retain_graph=True)
        torch.autograd.grad(p.sum(), a)


def debug_on_mismatch(api):
    api.checkpoint(_changes_when_run_again("shape"), _x(4, 3), use_reentrant=False, debug=True).backward()


def debug_global_switch(api):
    with tuc.set_checkpoint_debug_enabled(True):
        api.checkpoint(_changes_when_run_again("shape"), _x(4, 3), use_reentrant=False).backward()


def gpt_block(api):
    from llmmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(3)
    block = GPT(GPTConfig(layers=1, hidden=32, heads=4, seq_len=16, vocab_size=64, dropout=0.1)).blocks[0]
    x = _x(2, 16, 32)
    y = api.checkpoint(block, x, use_reentrant=False)
    y.square().sum().backward()
    return y.detach(), _grads(block, x)


NO_EARLY_STOP = "this torch's checkpoint has no early_stop option (set_checkpoint_early_stop only)"

SCENARIOS = {
    "plain": Scenario(plain),
    "kwargs and nested inputs": Scenario(kwargs_and_nested_inputs),
    "non-tensor outputs": Scenario(non_tensor_outputs),
    "nested": Scenario(nested),
    "rng dropout": Scenario(rng_dropout),
    "rng not preserved": Scenario(rng_not_preserved),
    "autocast bf16": Scenario(autocast_bf16),
    # torch before 2.9 has no early_stop option: it hands early_stop= to the function
    "early stop on": Scenario(early_stop_on, needs=_has_early_stop_option, reason=NO_EARLY_STOP),
    "early stop off": Scenario(early_stop_off, needs=_has_early_stop_option, reason=NO_EARLY_STOP),
    "early stop global switch": Scenario(early_stop_global_switch),
    "determinism: shape": Scenario(determinism_shape, error_words=("recomput", "forward")),
    "determinism: count": Scenario(determinism_count, error_words=("different number", "recomput")),
    "determinism: none": Scenario(determinism_none),
    "determinism: bad value": Scenario(determinism_check_bad_value, error_words=("determinism_check",)),
    "selective policy": Scenario(selective_policy),
    "context_fn": Scenario(context_fn_entered),
    "retain_graph": Scenario(retain_graph_twice),
    "autograd.grad and inputs=": Scenario(autograd_grad_and_inputs),
    "backward inside": Scenario(backward_inside_the_function),
    "unpack twice": Scenario(unpack_twice, error_words=("unpack", "once")),
    "reentrant": Scenario(reentrant),
    "reentrant, no input needs grad": Scenario(reentrant_no_input_needs_grad, warning_words=("requires_grad",)),
    "reentrant with autograd.grad": Scenario(reentrant_with_autograd_grad, error_words=(".grad()",)),
    "reentrant kwargs": Scenario(reentrant_kwargs, error_words=("Unexpected keyword arguments",)),
    "reentrant context_fn": Scenario(reentrant_context_fn, error_words=("context_fn", "use_reentrant=False")),
    "debug with context_fn": Scenario(debug_with_context_fn, error_words=("debug", "context_fn")),
    "grad disabled": Scenario(grad_disabled),
    "sequential 9 in 5": Scenario(sequential_9_in_5),
    "sequential 8 in 3": Scenario(sequential_8_in_3),
    "sequential reentrant": Scenario(sequential_reentrant),
    "sequential unknown kwarg": Scenario(sequential_unknown_kwarg, error_words=("foo",)),
    "GraphExecGroup": Scenario(graph_exec_group, needs=_has_groups, reason="GraphExecGroup: torch >= 2.10"),
    "GraphExecGroup overlap": Scenario(
        graph_exec_group_overlap,
        error_words=("GraphExecGroup", "unpack"),
        needs=_has_groups,
        reason="GraphExecGroup: torch >= 2.10",
    ),
    "debug on mismatch": Scenario(debug_on_mismatch, error_words=("aten.exp.default", "aten.slice", "recompute")),
    "debug global switch": Scenario(debug_global_switch, error_words=("aten.exp.default", "recompute")),
    "GPT block": Scenario(gpt_block),
}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models: bitwise comparisons do not depend on it, and other jobs share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_as_torch(name):
    scenario = SCENARIOS[name]
    if not scenario.needs():
        pytest.skip(scenario.reason)
    _compare(scenario, _observe(scenario, TORCH), _observe(scenario, LLMMEM))


# --------------------------------------------------------------------------------------------
# Where llmmem differs on purpose


def default_use_reentrant(api):
    m, x = _mlp(), _x(4, 8)
    y = api.checkpoint(m, x)  # no use_reentrant
    y.sum().backward()
    return y.detach(), _grads(m, x), type(y.grad_fn).__name__


def test_documented_difference_default_use_reentrant():
    """``use_reentrant`` omitted: both warn that it should be passed explicitly (the same
    category and key phrase); torch then takes the reentrant path, llmmem the non-reentrant one
    (the path torch recommends). The gradients are the same."""
    scenario = Scenario(default_use_reentrant)
    theirs, ours = _observe(scenario, TORCH), _observe(scenario, LLMMEM)
    assert theirs.error is None and ours.error is None
    for outcome in (theirs, ours):
        assert [w.category for w in outcome.warnings] == [UserWarning]
        assert "the use_reentrant parameter should be passed explicitly" in str(outcome.warnings[0].message)
    assert "use_reentrant=False" in str(ours.warnings[0].message)  # and says what llmmem does instead
    _same(theirs.observed[:2], ours.observed[:2])
    assert theirs.observed[2] == "CheckpointFunctionBackward" and ours.observed[2] != theirs.observed[2]


def test_documented_difference_option_types():
    """torch tests the truth of any object given for a bool option; llmmem wants a bool."""
    x = _x(3)
    tuc.checkpoint(torch.sin, x, use_reentrant=False, preserve_rng_state="no").sum().backward()
    with pytest.raises(TypeError, match="preserve_rng_state"):
        llmmem.checkpoint(torch.sin, x, use_reentrant=False, preserve_rng_state="no")
