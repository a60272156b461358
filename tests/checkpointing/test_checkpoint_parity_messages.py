"""llmmem.checkpoint where torch's own checkpoint tests look (issue 25, item 6): the phrases of
torch's errors and warnings, the keyword options of torch 2.5 to 2.15, and
``respect_saved_tensors_hooks``.

torch's test suite, run with llmmem swapped in for ``torch.utils.checkpoint.checkpoint``, matches
the messages with regular expressions; each test here triggers the same situation in a scenario of
its own and matches the same expression, on torch (where the installed torch has the behaviour) and
on llmmem. llmmem's messages are its own, with torch's phrase inside.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc
from support.checkpointing import torch_debug_logs_stay_with_torch

import llmmem

IMPLS = ["torch", "llmmem"]
CHECKPOINT = {"torch": tuc.checkpoint, "llmmem": llmmem.checkpoint}
SEQUENTIAL = {"torch": tuc.checkpoint_sequential, "llmmem": llmmem.checkpoint_sequential}

HAS_GROUPS = hasattr(tuc, "GraphExecGroup")
# torch's recompute-mismatch errors name the torch.compile workarounds from some version on
TORCH_HINTS_COMPILE = "mark_dynamic" in getattr(tuc, "_debug_tip_msg", "")


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


@contextlib.contextmanager
def _all_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


# --------------------------------------------------------------------------------------------
# One saved tensor asked for twice


class _ReadsSavedTwice(torch.autograd.Function):
    """Multiplies by 3; its backward reads ``ctx.saved_tensors`` twice (the second read is the
    misuse checkpointing refuses: each recomputed tensor is handed out once)."""

    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t * 3

    @staticmethod
    def backward(ctx, grad):
        (first,) = ctx.saved_tensors
        (second,) = ctx.saved_tensors
        return grad * 3 + 0 * first * second


UNPACKED_TWICE = "Unpack is being triggered for a tensor that was already unpacked once"


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("nested", [False, True])
def test_a_saved_tensor_read_twice_is_refused_with_torchs_phrase(impl, early_stop, nested):
    ckpt = CHECKPOINT[impl]

    def body(t):
        return _ReadsSavedTwice.apply(t.exp()).sum()

    def fn(t):
        return ckpt(body, t, use_reentrant=False) if nested else body(t)

    with tuc.set_checkpoint_early_stop(early_stop):
        out = ckpt(fn, _leaf(4), use_reentrant=False)
    with pytest.raises(RuntimeError, match=UNPACKED_TWICE) as info:
        out.backward()
    assert isinstance(info.value, tuc.CheckpointError)


@pytest.mark.skipif(not HAS_GROUPS, reason="torch.utils.checkpoint.GraphExecGroup: torch >= 2.10")
def test_overlapping_backward_calls_in_one_group_are_refused_with_torchs_phrase(impl):
    x = _leaf(3)
    y = CHECKPOINT[impl](lambda t: t.cos().exp(), x, use_reentrant=False)
    with tuc.GraphExecGroup():
        torch.autograd.grad(y.sum(), x, retain_graph=True)
        with pytest.raises(RuntimeError, match="Performing two backward calls that overlap"):
            torch.autograd.grad(y.sum(), x)  # the same saved tensors again, in the same group


# --------------------------------------------------------------------------------------------
# A recompute that does not redo the forward


def _second_run_differs(first, later):
    """A function that runs ``first`` the first time and ``later`` every time after."""
    runs = []

    def fn(t):
        runs.append(None)
        return (first if len(runs) == 1 else later)(t)

    return fn


def _saves_three(t):
    return t.cos().exp().cos()


def _saves_two(t):
    return t.cos().exp()


def _saves_two_other_shape(t):
    return t.cos() * torch.ones(3)  # broadcasts (1,) to (3,): what it saves has another shape


def test_fewer_tensors_saved_again_is_refused_with_torchs_phrase(impl):
    out = CHECKPOINT[impl](_second_run_differs(_saves_three, _saves_two), _leaf(1), use_reentrant=False)
    with pytest.raises(RuntimeError, match="A different number of tensors was saved"):
        out.sum().backward()


def test_more_tensors_saved_again_is_refused_with_torchs_phrase(impl):
    with tuc.set_checkpoint_early_stop(False):  # with early stop, the extra tensor is never reached
        out = CHECKPOINT[impl](_second_run_differs(_saves_two, _saves_three), _leaf(1), use_reentrant=False)
    with pytest.raises(RuntimeError, match="trying to save more tensors during recomputation"):
        out.sum().backward()


def test_more_tensors_saved_again_is_fine_with_early_stop(impl):
    x = _leaf(1)
    CHECKPOINT[impl](_second_run_differs(_saves_two, _saves_three), x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, -x.detach().sin() * x.detach().cos().exp())


def test_other_metadata_is_refused_with_torchs_phrases(impl):
    out = CHECKPOINT[impl](_second_run_differs(_saves_two, _saves_two_other_shape), _leaf(1), use_reentrant=False)
    with pytest.raises(RuntimeError, match="tensors have different metadata") as info:
        out.sum().backward()
    assert "Recomputed values for the following tensors have different" in str(info.value)


@pytest.mark.parametrize("how", ["option", "global switch"])
def test_debug_mismatch_says_why_it_shows_the_logs_with_torchs_phrase(impl, how):
    fn = _second_run_differs(_saves_two, _saves_two_other_shape)
    with torch_debug_logs_stay_with_torch():
        if how == "option":
            out = CHECKPOINT[impl](fn, _leaf(1), use_reentrant=False, debug=True)
        else:
            with tuc.set_checkpoint_debug_enabled(True):
                out = CHECKPOINT[impl](fn, _leaf(1), use_reentrant=False, debug=False)
        with pytest.raises(
            RuntimeError, match="You are seeing this error because you passed `debug=True` to checkpoint"
        ):
            out.sum().backward()


def test_the_global_debug_switch_off_wins_over_the_option(impl):
    fn = _second_run_differs(_saves_two, _saves_two_other_shape)
    with tuc.set_checkpoint_debug_enabled(False):
        out = CHECKPOINT[impl](fn, _leaf(1), use_reentrant=False, debug=True)
    with pytest.raises(RuntimeError, match="Recomputed values for the following tensors have different") as info:
        out.sum().backward()
    assert "You are seeing this error" not in str(info.value)


@pytest.mark.parametrize(
    "scenario",
    [
        (_saves_three, _saves_two, True),  # count
        (_saves_two, _saves_three, False),  # more, early stop off
        (_saves_two, _saves_two_other_shape, True),  # metadata
    ],
    ids=["fewer", "more", "metadata"],
)
@pytest.mark.parametrize("impl_", ["torch", "llmmem"] if TORCH_HINTS_COMPILE else ["llmmem"])
def test_recompute_mismatch_names_the_torch_compile_workarounds(impl_, scenario):
    """A checkpointed torch.compile'd block can recompute with another graph than its forward ran
    (pytorch/pytorch#166926); the error names torch's two workarounds."""
    first, later, early_stop = scenario
    with tuc.set_checkpoint_early_stop(early_stop):
        out = CHECKPOINT[impl_](_second_run_differs(first, later), _leaf(1), use_reentrant=False)
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    assert "torch._dynamo.mark_dynamic()" in str(info.value)
    assert "torch._C._dynamo.eval_frame._set_lru_cache(False)" in str(info.value)


# --------------------------------------------------------------------------------------------
# Options of the non-reentrant path only


@pytest.mark.parametrize(
    "option",
    [{"context_fn": lambda: (contextlib.nullcontext(), contextlib.nullcontext())}, {"debug": True}],
    ids=["context_fn", "debug"],
)
def test_non_reentrant_options_with_use_reentrant_true_are_refused_with_torchs_phrase(impl, option):
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        CHECKPOINT[impl](torch.sin, _leaf(3), use_reentrant=True, **option)


def test_respect_saved_tensors_hooks_needs_the_non_reentrant_path():
    for value in (True, False):
        with pytest.raises(ValueError, match="respect_saved_tensors_hooks is only supported when use_reentrant=False"):
            llmmem.checkpoint(torch.sin, _leaf(3), use_reentrant=True, respect_saved_tensors_hooks=value)
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks must be a bool"):
        llmmem.checkpoint(torch.sin, _leaf(3), use_reentrant=False, respect_saved_tensors_hooks="yes")


# --------------------------------------------------------------------------------------------
# use_reentrant omitted

OMITTED = ".*the use_reentrant parameter should be passed explicitly.*"


def _use_reentrant_warnings(caught) -> list:
    return [w for w in caught if "use_reentrant" in str(w.message)]


def test_checkpoint_without_use_reentrant_warns_with_torchs_phrase(impl):
    x = _leaf(2)
    with _all_warnings() as caught:
        CHECKPOINT[impl](torch.sin, x, use_reentrant=False)
    assert _use_reentrant_warnings(caught) == []
    with pytest.warns(UserWarning, match=OMITTED):
        CHECKPOINT[impl](torch.sin, x)


def test_checkpoint_sequential_without_use_reentrant_warns_with_torchs_phrase(impl):
    x = _leaf(3)
    blocks = [nn.Linear(3, 3) for _ in range(4)]
    with _all_warnings() as caught:
        SEQUENTIAL[impl](blocks, 4, x, use_reentrant=False)
    assert _use_reentrant_warnings(caught) == []
    with _all_warnings() as caught:
        SEQUENTIAL[impl](blocks, 4, x)
    omitted = _use_reentrant_warnings(caught)
    assert [w.category for w in omitted] == [UserWarning]  # once per call, not once per segment
    assert "the use_reentrant parameter should be passed explicitly" in str(omitted[0].message)


def test_omitted_use_reentrant_still_runs_the_non_reentrant_region():
    """What llmmem does differs from torch (which goes reentrant), and the warning says so: the
    region supports torch.autograd.grad and inputs with no grad, which the reentrant one does not."""
    x = _leaf(3)
    with pytest.warns(UserWarning, match="use_reentrant=False") as caught:
        y = llmmem.checkpoint(lambda t: t.sin() * 2, x)
    assert "the use_reentrant parameter should be passed explicitly" in str(caught[0].message)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, 2 * x.detach().cos())
    assert caught[0].filename == __file__  # points at the caller


def test_the_curried_form_warns_when_the_function_runs_and_points_at_the_caller():
    with _all_warnings() as caught:
        wrapped = llmmem.checkpoint(preserve_rng_state=False)(torch.sin)
    assert _use_reentrant_warnings(caught) == []
    with pytest.warns(UserWarning, match=OMITTED) as caught:
        wrapped(_leaf(2))
    assert caught[0].filename == __file__
    with _all_warnings() as caught:
        llmmem.checkpoint(use_reentrant=False)(torch.sin)(_leaf(2))
    assert _use_reentrant_warnings(caught) == []


def test_llmmems_own_callers_pass_use_reentrant():
    """auto_checkpoint's regions, checkpoint_sequential's segments and the planner's modes call
    llmmem.checkpoint themselves: none of those calls may warn on the user's behalf."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(6))
    x = _leaf(8, 16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=OMITTED)
        chain = llmmem.auto_checkpoint(blocks, x, budget=0.6, repeats=1)
        assert chain.plan.regions or set(chain.plan.modes) != {"store-all"}  # it checkpoints something
        chain(x).sum().backward()
        llmmem.checkpoint_sequential(blocks, 2, x, use_reentrant=False).sum().backward()
        from llmmem.checkpointing.modes import run_mode

        for mode in ("selective", "nostore"):
            run_mode(blocks[0], x, mode).sum().backward()


# --------------------------------------------------------------------------------------------
# Every keyword option of torch's checkpoint (2.5 to 2.15) is an option, never the function's


TORCH_OPTIONS = {
    "use_reentrant": False,
    "preserve_rng_state": False,
    "context_fn": tuc.noop_context_fn,
    "determinism_check": "none",
    "debug": False,
    "early_stop": True,
}


def _records_kwargs():
    seen = []

    def fn(t, **kwargs):
        seen.append(sorted(kwargs))
        return t.sin()

    return fn, seen


@pytest.mark.parametrize("option", sorted(TORCH_OPTIONS))
def test_a_torch_option_never_reaches_the_function(impl, option):
    if option == "early_stop" and impl == "torch" and not hasattr(tuc, "GraphExecGroup"):
        pytest.skip("torch < 2.9 has no early_stop option (it hands it to the function)")
    fn, seen = _records_kwargs()
    options = {"use_reentrant": False, option: TORCH_OPTIONS[option]}
    CHECKPOINT[impl](fn, _leaf(3), own=1, **options).sum().backward()
    assert seen and all(kw == ["own"] for kw in seen)


@pytest.mark.parametrize("value", [None, False, True])
def test_respect_saved_tensors_hooks_never_reaches_the_function(value):
    """torch 2.15's option; this torch may not have it, so llmmem alone (the three call forms)."""
    fn, seen = _records_kwargs()
    x = _leaf(3)
    llmmem.checkpoint(fn, x, use_reentrant=False, respect_saved_tensors_hooks=value, own=1).sum().backward()
    llmmem.checkpoint(use_reentrant=False, respect_saved_tensors_hooks=value)(fn)(x, own=2).sum().backward()
    assert seen and all(kw == ["own"] for kw in seen)
    llmmem.checkpoint_sequential([torch.sin, torch.cos], 2, x, use_reentrant=False, respect_saved_tensors_hooks=value)


# --------------------------------------------------------------------------------------------
# respect_saved_tensors_hooks: what a selective policy keeps, and the caller's hooks


class _Hooks:
    """Saved-tensor hooks that box what they pack (a copy, as an offloader's would be) and count."""

    def __init__(self) -> None:
        self.packed, self.unpacked = [], 0

    def pack(self, t):
        self.packed.append(tuple(t.shape))
        return ("boxed", t.detach().clone())

    def unpack(self, box):
        self.unpacked += 1
        return box[1]

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _torch_policy():
    return functools.partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])


POLICIES = {"torch's contexts": _torch_policy, "selective_context_fn": lambda: llmmem.selective_context_fn}


def _two_matmuls():
    torch.manual_seed(0)
    w1, w2 = _leaf(8, 6), _leaf(6, 5)

    def fn(t):
        return torch.mm(torch.mm(t, w1).sin(), w2).cos()

    return fn, (w1, w2)


def _run_under_hooks(respect, policy, hooks):
    fn, weights = _two_matmuls()
    x = _leaf(4, 8)
    extra = {} if respect == "omitted" else {"respect_saved_tensors_hooks": respect}
    with _all_warnings() as caught:
        with hooks():
            y = llmmem.checkpoint(fn, x, use_reentrant=False, context_fn=policy(), **extra)
        packed_in_forward = list(hooks.packed)
        y.sum().backward()
    expected = torch.autograd.grad(fn(x).sum(), (x, *weights))
    return packed_in_forward, caught, [x.grad, *(w.grad for w in weights)], expected


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_respect_true_hands_the_kept_tensors_to_the_callers_hooks(policy):
    hooks = _Hooks()
    packed, caught, grads, expected = _run_under_hooks(True, POLICIES[policy], hooks)
    # the region's input (as always), then the two matmul outputs the policy keeps
    assert packed == [(4, 8), (4, 6), (4, 5)]
    assert hooks.unpacked == 3  # each came back through the unpack hook for the recompute
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("respect", [False, "omitted"])
def test_respect_false_or_omitted_keeps_them_out_of_the_hooks(policy, respect):
    hooks = _Hooks()
    packed, caught, grads, expected = _run_under_hooks(respect, POLICIES[policy], hooks)
    assert packed == [(4, 8)]  # the region's input only
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    if respect is False:
        assert future == []
    else:  # not chosen, and hooks are active: says so, as torch does
        assert len(future) == 1 and "respect_saved_tensors_hooks=True" in str(future[0].message)
        assert future[0].filename == __file__
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("respect", [None, True])
def test_respect_is_quiet_and_changes_nothing_without_a_policy_or_without_hooks(respect):
    hooks = _Hooks()
    x = _leaf(4, 8)
    with _all_warnings() as caught:
        with hooks():
            y = llmmem.checkpoint(lambda t: t.sin().exp(), x, use_reentrant=False, respect_saved_tensors_hooks=respect)
        y.sum().backward()
        fn, _ = _two_matmuls()
        llmmem.checkpoint(
            fn, x, use_reentrant=False, context_fn=_torch_policy(), respect_saved_tensors_hooks=respect
        ).sum().backward()
    assert hooks.packed == [(4, 8)]  # a plain region keeps its input only, whatever the option
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_nested_selective_region_sees_the_hooks_around_the_outermost_call(policy):
    """Inside an enclosing checkpoint, the innermost hooks are the enclosing region's own: the
    caller's hooks are those around the outer call."""
    hooks = _Hooks()
    fn, _ = _two_matmuls()
    x = _leaf(4, 8)

    def outer(t):
        inner = llmmem.checkpoint(
            fn, t.tanh(), use_reentrant=False, context_fn=POLICIES[policy](), respect_saved_tensors_hooks=True
        )
        return inner * 2

    with hooks():
        y = llmmem.checkpoint(outer, x, use_reentrant=False)
    assert (4, 6) in hooks.packed and (4, 5) in hooks.packed
    y.sum().backward()
    expected = torch.autograd.grad((fn(x.tanh()) * 2).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_kept_tensor_changed_in_place_is_still_caught_through_the_hooks(policy):
    """Hooks that keep the tensor itself (no copy) see an in-place change after the policy kept
    it; the recompute refuses it as it does without hooks."""
    torch.manual_seed(0)
    w = _leaf(8, 6)

    def fn(t):
        return torch.mm(t, w).mul_(2).sin()

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = llmmem.checkpoint(
            fn, _leaf(4, 8), use_reentrant=False, context_fn=POLICIES[policy](), respect_saved_tensors_hooks=True
        )
    with pytest.raises(RuntimeError, match="mutated|modified in place"):
        y.sum().backward()
