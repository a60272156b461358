"""The pipelined CPU walk of GradScaler.unscale_ (csrc/python/amp_params.c with
csrc/amp/unscale_pipe.c): from 256 parameters on and with more than one thread, worker threads
unscale the gradients the C walk has read while it reads on. It cannot take back what it did, so
at a gradient that is not the plain case it stops and the general path continues from there. These
tests check that hand-over against torch.amp.GradScaler, the errors raised after it, references,
and interrupts."""

from __future__ import annotations

import sys

import pytest
import torch
from support.amp import ODD_LAYOUTS, assert_same, interrupt_once_on, odd_layout_param, p_with

import llmmem
from llmmem.amp import cpu_unscale as CU

SCALE = 1024.0
N = 300  # above the pipelining threshold (256 parameters)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def plain_grads(seed=0):
    """N gradients of 1..6000 elements (enough bytes for the workers to start), mixed dtypes."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float64]
    return [
        (torch.randn(int(n), generator=gen) * SCALE).to(dtypes[k % 3])
        for k, n in enumerate(torch.randint(1, 6000, (N,), generator=gen))
    ]


def run_both(make_grads, per_scaler=None):
    """torch's and llmmem's unscale_ on equal gradients; returns [(scaler, opt, params)] for both."""
    out = []
    for cls in (torch.amp.GradScaler, llmmem.GradScaler):
        grads = make_grads()
        params = [p_with(g) for g in grads]
        opt = torch.optim.SGD([{"params": params[:100]}, {"params": params[100:]}], lr=0.1)
        s = cls("cpu", init_scale=SCALE)
        s.scale(torch.ones(()))
        s.unscale_(opt)
        out.append((s, opt, params))
    return out


def test_the_walk_hands_over_at_a_strided_gradient_with_two_threads_and_not_with_one(two_threads):
    grads = plain_grads()
    grads[200] = (torch.randn(40, 2) * SCALE).t()  # a strided view: not the plain case
    params = [p_with(g) for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    before = [g.clone() for g in grads]
    torch.set_num_threads(1)
    assert CU.walk(opt.param_groups, False, torch.zeros(()), torch.full((), 2.0)) is None
    assert all(torch.equal(g, b) for g, b in zip(grads, before))  # one thread: nothing done
    torch.set_num_threads(2)
    w = CU.walk(opt.param_groups, False, torch.zeros(()), torch.full((), 2.0))
    assert (w.n_grads, w.resume) == (200, 200) and list(w.slots) == list(range(200))
    assert all(torch.equal(g, (b.double() / 2).to(b.dtype)) for g, b in zip(grads[:200], before[:200]))
    assert all(torch.equal(g, b) for g, b in zip(grads[200:], before[200:]))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", ODD_LAYOUTS)
def test_the_walk_stops_at_a_gradient_of_any_other_layout(two_threads, layout):
    grads = plain_grads()
    params = [p_with(g) for g in grads]
    params[150] = odd_layout_param(layout)
    odd_before = params[150].grad.to_dense()
    before = [g.clone() for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    w = CU.walk(opt.param_groups, False, torch.zeros(()), torch.full((), 2.0))
    assert (w.n_grads, w.resume) == (150, 150) and list(w.slots) == list(range(150))
    assert all(torch.equal(g, (b.double() / 2).to(b.dtype)) for g, b in zip(grads[:150], before[:150]))
    assert torch.equal(params[150].grad.to_dense(), odd_before)
    assert all(torch.equal(g, b) for g, b in zip(grads[151:], before[151:]))


@pytest.mark.parametrize("kind", ["strided", "sparse", "no-grad-then-strided", "subclass"])
def test_hand_over_matches_torch_with_overflows_on_both_sides(two_threads, kind):
    class Sub(torch.Tensor):
        pass

    def make():
        torch.manual_seed(7)  # the same odd gradient for both scalers
        gs = plain_grads(seed=1)
        gs[5].view(-1)[0] = float("inf")  # before the hand-over
        if kind == "strided":
            gs[150] = (torch.randn(30, 4) * SCALE).t()
        elif kind == "sparse":
            gs[150] = (torch.randn(8, 3) * SCALE).to_sparse()
        elif kind == "no-grad-then-strided":
            gs[149] = None
            gs[150] = (torch.randn(30, 4) * SCALE)[:, ::2]
        else:
            gs[150] = (torch.randn(17) * SCALE).as_subclass(Sub)
        if kind != "sparse":
            gs[150][(0,) * gs[150].dim()] = float("nan")  # the hand-over gradient itself
        gs[299].view(-1)[-1] = float("-inf")  # after it
        return gs

    (ts, topt, tparams), (ls, lopt, lparams) = run_both(make)
    for tp, lp in zip(tparams, lparams):
        assert (tp.grad is None) == (lp.grad is None)
        if tp.grad is not None:
            a, b = (lp.grad.to_dense(), tp.grad.to_dense()) if tp.grad.is_sparse else (lp.grad, tp.grad)
            assert_same(a, b)
    lfound = {str(d): float(t) for d, t in ls._per_optimizer_states[id(lopt)]["found_inf_per_device"].items()}
    tfound = {str(d): float(t) for d, t in ts._per_optimizer_states[id(topt)]["found_inf_per_device"].items()}
    assert lfound == tfound == {"cpu": 1.0}
    want = [(0, 5), (1, 199)] + ([(1, 50)] if kind != "sparse" else [])
    assert sorted(ls.overflowed_params(optimizer=lopt)) == sorted(want)


def test_an_fp16_gradient_after_the_hand_over_raises_and_the_step_is_skipped_safely(two_threads):
    grads = plain_grads(seed=2)
    grads[250] = torch.randn(9).half()
    params = [p_with(g) for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    s = llmmem.GradScaler("cpu", init_scale=SCALE)
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients.") as info:
        s.unscale_(opt)
    if sys.version_info >= (3, 11):
        assert any("250 gradients were already unscaled" in n for n in info.value.__notes__)
    # The 250 gradients before it cannot be un-unscaled: the step is recorded as overflowed, so a
    # retry is refused, step() leaves the parameters alone and update() backs off.
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(opt)
    weights = [p.detach().clone() for p in params]
    assert s.step(opt) is None
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    s.update()
    assert s.get_scale() == SCALE / 2
    # the next iteration runs as usual once the fp16 gradient is gone
    params[250].grad = None
    for p in params:
        if p.grad is not None:
            p.grad.fill_(SCALE / 2)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    assert all(torch.equal(p.grad, torch.ones_like(p.grad)) for p in params if p.grad is not None)


def test_no_reference_leaks_when_pipelined(two_threads):
    grads = plain_grads(seed=3)
    params = [p_with(g) for g in grads] + [p_with(None)]
    opt = torch.optim.SGD(params, lr=0.1)
    found, one = torch.zeros(()), torch.ones(())
    before = [sys.getrefcount(x) for x in grads + params]
    for _ in range(20):
        w = CU.walk(opt.param_groups, False, found, one, True)
        assert (w.n_grads, w.resume) == (N, None)
    odd = p_with(torch.randn(4, 4).t())
    opt.param_groups[0]["params"].insert(270, odd)
    for _ in range(20):
        w = CU.walk(opt.param_groups, False, found, one, True)
        assert (w.n_grads, w.resume) == (270, 270)
    del opt.param_groups[0]["params"][270]
    assert [sys.getrefcount(x) for x in grads + params] == before


def test_an_interrupt_during_a_pipelined_walk_propagates_after_the_workers_finish(two_threads):
    grads = plain_grads(seed=4)
    target = grads[280]
    before = [g.clone() for g in grads]

    mode = interrupt_once_on(target)

    opt = torch.optim.SGD([p_with(g) for g in grads], lr=0.1)
    with mode, pytest.raises(KeyboardInterrupt):
        CU.walk(opt.param_groups, False, torch.zeros(()), torch.full((), 2.0))
    assert mode.fired
    # what the walk had read is done (it may have begun), the rest untouched: nothing half-written
    for k, (g, b) in enumerate(zip(grads, before)):
        assert torch.equal(g, (b.double() / 2).to(b.dtype) if k < 280 else b), k


@pytest.mark.parametrize("how", ["same-parameter-twice", "shared-grad"])
def test_a_gradient_listed_twice_is_unscaled_twice_as_torch_does(two_threads, how):
    # Both listings in flight on two threads at once would lose one of the two multiplications:
    # the walk hands over at the second listing, and the general path runs it after the first.
    import warnings

    def make_opt(cls):
        grads = plain_grads(seed=5)
        grads[40] = torch.full((600_000,), SCALE * SCALE)  # big enough to be sliced across workers
        params = [p_with(g) for g in grads]
        if how == "same-parameter-twice":
            plist = params[:260] + [params[40]] + params[260:]
        else:
            twin = p_with(None)
            twin.data = torch.zeros(600_000)
            twin.grad = params[40].grad  # two parameters, one gradient tensor
            plist = params[:260] + [twin] + params[260:]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about a duplicated parameter
            opt = torch.optim.SGD(plist, lr=0.1)
        s = cls("cpu", init_scale=SCALE)
        s.scale(torch.ones(()))
        return s, opt, plist

    _, opt, plist = make_opt(llmmem.GradScaler)
    w = CU.walk(opt.param_groups, False, torch.zeros(()), torch.ones(()), True)
    assert (w.n_grads, w.resume) == (260, 260)
    for _ in range(5):  # a race would show in some runs, not all
        (ts, topt, tparams), (ls, lopt, lparams) = [make_opt(cls) for cls in (torch.amp.GradScaler, llmmem.GradScaler)]
        ts.unscale_(topt)
        ls.unscale_(lopt)
        assert torch.equal(lparams[40].grad, torch.ones(600_000))  # divided twice
        for tp, lp in zip(tparams, lparams):
            assert_same(lp.grad, tp.grad)


def test_an_interrupt_inside_the_pipelined_walk_leaves_the_scaler_safe(two_threads):
    grads = plain_grads(seed=6)
    target = grads[280]

    mode = interrupt_once_on(target)

    params = [p_with(g) for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    s = llmmem.GradScaler("cpu", init_scale=SCALE)
    s.scale(torch.ones(()))
    with mode, pytest.raises(KeyboardInterrupt) as info:
        s.unscale_(opt)
    if sys.version_info >= (3, 11):
        assert any("280 gradients were already unscaled" in n for n in info.value.__notes__)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(opt)  # a retry would divide the first 280 twice
    weights = [p.detach().clone() for p in params]
    assert s.step(opt) is None
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    s.update()
    assert s.get_scale() == SCALE / 2


def test_after_a_failed_hand_over_the_culprits_are_this_steps(two_threads):
    grads = plain_grads(seed=7)
    params = [p_with(g) for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    s = llmmem.GradScaler("cpu", init_scale=SCALE)
    params[3].grad.view(-1)[0] = float("inf")
    s.scale(torch.ones(()))
    s.step(opt)
    s.update()
    assert s.overflowed_params(optimizer=opt) == [(0, 3)]
    params[3].grad.view(-1)[0] = 1.0
    params[7].grad.view(-1)[0] = float("nan")
    opt.param_groups[0]["params"][250] = p_with(torch.randn(9).half())
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        s.unscale_(opt)
    assert s.overflowed_params(optimizer=opt) == [(0, 7)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_signal_handled_just_after_the_c_walk_leaves_the_scaler_safe(monkeypatch, two_threads, threads):
    # A real Ctrl-C during the C walk is raised once it returns; by then every gradient it read is
    # unscaled. The count it wrote before returning tells the scaler to record the step as
    # overflowed, so that a retry cannot unscale them twice.
    torch.set_num_threads(threads)
    real = CU.walk

    def then_interrupt(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    grads = plain_grads(seed=8)
    params = [p_with(g) for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    s = llmmem.GradScaler("cpu", init_scale=SCALE)
    s.scale(torch.ones(()))
    monkeypatch.setattr(CU, "walk", then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        s.unscale_(opt)
    monkeypatch.setattr(CU, "walk", real)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(opt)
    assert s.step(opt) is None
    s.update()
    assert s.get_scale() == SCALE / 2
