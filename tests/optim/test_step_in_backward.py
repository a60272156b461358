"""llmmem.optim.step_in_backward: the same update as stepping after backward (bit-identical in
fp32, for llmmem's AdamW of every format and for torch's optimizers), a peak lower by at least
0.9 x the gradients' bytes, schedulers, remove(); and the refusals: clipping by global norm,
gradient accumulation over several backwards, an enabled fp16 GradScaler, DTensor parameters,
reentrant checkpointing where it hides the end of backward or splits a gradient; and a backward
that failed half-way leaves the next one counting normally. The hooks read the optimizer's current
groups and state (a resume's load_state_dict), hold the optimizer weakly (dropping a model and its
optimizer frees them), refuse a second registration, and answer clip_grad_norm_(max_norm=inf)
with the last backward's gradient norm (as transformers' Trainer asks)."""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch

import llmmem
import llmmem.optim as lo
from llmmem.diagnostics.live import LiveBytes
from llmmem.errors import StateError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(seed=0, width=128):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 10),
    )


def _batches(n, seed=1, batch=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _bits(t):
    return t.detach().view(torch.int32) if t.dtype == torch.float32 else t.detach().view(torch.int16)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4", "bf16"])
def test_llmmem_adamw_in_backward_equals_stepping_after(fmt):
    a, b = _model(), _model()
    kw = dict(lr=1e-2, state_dtype=fmt, min_quantized_numel=64, seed=3)
    oa, ob = lo.AdamW(a.parameters(), **kw), lo.AdamW(b.parameters(), **kw)
    handle = lo.step_in_backward(a, oa)
    for batch in _batches(5):
        _loss(a, batch).backward()
        assert all(p.grad is None for p in a.parameters())
        oa.step()  # a loop written for a normal step still runs: nothing left to step
        ob.zero_grad()
        _loss(b, batch).backward()
        ob.step()
    handle.remove()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))


@pytest.mark.parametrize(
    "cls,kw", [(torch.optim.AdamW, dict(lr=1e-2, foreach=False)), (torch.optim.SGD, dict(lr=0.1, momentum=0.9))]
)
def test_torch_optimizers_one_per_parameter(cls, kw):
    a, b = _model(), _model()
    oa, ob = cls(a.parameters(), **kw), cls(b.parameters(), **kw)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.5)
    with lo.step_in_backward(a, oa, scheduler=sa):
        for batch in _batches(5):
            _loss(a, batch).backward()
            ob.zero_grad()
            _loss(b, batch).backward()
            ob.step()
            sb.step()
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"] == kw["lr"] * 0.25
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert len(oa.state_dict()["state"]) == len(list(a.parameters()))  # the state lives in the user's optimizer


def _peak(model, opt, in_backward: bool, steps=3):
    handle = lo.step_in_backward(model, opt) if in_backward else None
    with LiveBytes() as live:
        live.track([model, opt.state])
        for batch in _batches(steps, batch=2):  # fine-tuning-shaped: gradients dwarf activations
            opt.zero_grad(set_to_none=True)
            live.reset_peak()
            base = live.allocated()
            _loss(model, batch).backward()
            if not in_backward:
                opt.step()
            peak = live.max_allocated() - base
    if handle:
        handle.remove()
    return peak


def _deep(seed=0):
    # 16 equal layers, as a transformer's blocks are: a step in backward holds one layer's
    # gradient at a time (the largest tensor's gradient is the least it can hold)
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, 256)] + [torch.nn.Linear(256, 256) for _ in range(15)] + [torch.nn.Linear(256, 10)]
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())][:-1])


def test_peak_is_lower_by_the_gradients():
    a, b = _deep(), _deep()
    grad_bytes = sum(p.numel() * p.element_size() for p in a.parameters())
    normal = _peak(a, lo.AdamW(a.parameters()), False)
    fused = _peak(b, lo.AdamW(b.parameters()), True)
    assert normal - fused >= 0.9 * grad_bytes, (normal, fused, grad_bytes)


def test_clipping_by_global_norm_is_refused():
    m = _model()
    opt = lo.AdamW(m.parameters())
    with lo.step_in_backward(m, opt):
        with pytest.raises(StateError, match="clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        with pytest.raises(StateError, match="unclipped values"):
            torch.nn.utils.clip_grad_value_(m.parameters(), 1.0)
        with pytest.raises(StateError, match="norm_type=2.0"):
            torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"), norm_type=1.0)
        other = torch.nn.Linear(3, 3)  # parameters it does not step may still be clipped
        other(torch.randn(2, 3)).sum().backward()
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
    assert not hasattr(torch.nn.utils.clip_grad_norm_, "_llmmem_guard")  # the guard is gone with the handle
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)


def test_gradient_accumulation_is_refused():
    m = _model()
    opt = lo.AdamW(m.parameters())
    batches = _batches(4)
    with lo.step_in_backward(m, opt):
        _loss(m, batches[0]).backward()
        _loss(m, batches[1]).backward()
        with pytest.raises(
            StateError, match="2 backward passes(.|\n)*2 partial updates(.|\n)*Restore the last checkpoint"
        ):
            opt.step()
        # once the loop is known to call step(), a second backward without one is stopped before it updates
        _loss(m, batches[2]).backward()
        opt.step()
        _loss(m, batches[3]).backward()
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(StateError, match="second backward(.|\n)*1 partial update since"):
            _loss(m, batches[0]).backward()
        assert all(torch.equal(b, p) for b, p in zip(before, m.parameters()))


@pytest.mark.parametrize("scaler_cls", ["torch", "llmmem"])
def test_an_enabled_fp16_grad_scaler_is_refused(scaler_cls):
    m = _model()
    opt = lo.AdamW(m.parameters())
    make = (
        (lambda **k: torch.amp.GradScaler("cpu", **k))
        if scaler_cls == "torch"
        else (lambda **k: llmmem.GradScaler("cpu", **k))
    )
    with lo.step_in_backward(m, opt):
        loss = _loss(m, _batches(1)[0])
        with pytest.raises(StateError, match="bf16 autocast"):
            make().scale(loss)
        assert make(enabled=False).scale(loss) is loss
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 autocast works
            _loss(m, _batches(1)[0]).backward()
    make().scale(loss)  # and the scaler works again once the handle is gone


def test_bad_input():
    m = _model()
    with pytest.raises(ValueError, match="not in the optimizer"):
        lo.step_in_backward(m, lo.AdamW(list(m.parameters())[:2]))
    with pytest.raises(TypeError, match="optimizer"):
        lo.step_in_backward(m, "adam")
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        lo.step_in_backward(frozen, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_remove_restores_the_normal_step():
    m = _model()
    opt = lo.AdamW(m.parameters())
    h = lo.step_in_backward(m, opt)
    h.remove()
    h.remove()  # twice is fine
    _loss(m, _batches(1)[0]).backward()
    assert all(p.grad is not None for p in m.parameters())


def _blocks(seed=0, n=3, tie=False):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(n)])
    if tie:
        blocks[-1].weight = blocks[0].weight  # one weight used in two segments
    return blocks


def _run_blocks(blocks, x, reentrant):
    from torch.utils.checkpoint import checkpoint

    for b in blocks:
        x = checkpoint(b, x, use_reentrant=reentrant) if reentrant is not None else b(x)
    return x.square().mean()


def test_non_reentrant_checkpointing_counts_one_backward_and_equals_stepping_after():
    a, b = _blocks(), _blocks()
    oa, ob = lo.AdamW(a.parameters(), lr=1e-2, seed=1), lo.AdamW(b.parameters(), lr=1e-2, seed=1)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    x = torch.randn(4, 16)
    with lo.step_in_backward(a, oa, scheduler=sa):
        for _ in range(2):
            _run_blocks(a, x, reentrant=False).backward()
            oa.step()
            ob.zero_grad()
            _run_blocks(b, x, reentrant=None).backward()
            ob.step()
            sb.step()
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"] == 1e-2 * 0.25
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_reentrant_checkpointing_that_hides_the_end_of_backward_is_refused():
    # every parameter inside torch.utils.checkpoint(use_reentrant=True): each segment is a
    # backward of its own, and the end of the whole one (where the scheduler steps) cannot be seen
    a = _blocks()
    oa = lo.AdamW(a.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in a.parameters()]
    with lo.step_in_backward(a, oa, scheduler=sched):
        with pytest.raises(StateError, match="use_reentrant=False"):
            x = torch.randn(4, 16, requires_grad=True)  # (reentrant segments need an input that does)
            _run_blocks(a, x, reentrant=True).backward()
        assert oa.param_groups[0]["lr"] == 1e-2
        assert all(torch.equal(p, q) for p, q in zip(before, a.parameters()))


def test_a_parameter_whose_gradient_arrives_in_two_parts_is_refused():
    # a tied weight in two reentrant segments: its accumulate hook fires once per segment, so it
    # would be stepped twice on partial gradients; the head outside sees the end of backward
    torch.manual_seed(0)
    a = _blocks(tie=True)
    head = torch.nn.Linear(16, 1)
    params = list(dict.fromkeys(list(a.parameters()) + list(head.parameters())))
    oa = lo.AdamW(params, lr=1e-2)
    with lo.step_in_backward(params, oa):
        with pytest.raises(StateError, match="twice in one backward"):
            from torch.utils.checkpoint import checkpoint

            x = torch.randn(4, 16, requires_grad=True)  # (reentrant segments need an input that does)
            for b in a:
                x = checkpoint(b, x, use_reentrant=True)
            head(x).sum().backward()


def test_an_error_in_one_backward_does_not_stop_the_next_from_counting():
    m = _model()
    opt = lo.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batches = _batches(2)
    with lo.step_in_backward(m, opt, scheduler=sched):
        opt.param_groups[0]["lr"] = float("nan")  # refused by the step inside backward
        with pytest.raises(ValueError, match="lr"):
            _loss(m, batches[0]).backward()
        opt.param_groups[0]["lr"] = 1e-2
        m.zero_grad(set_to_none=True)
        _loss(m, batches[1]).backward()
        assert opt.param_groups[0]["lr"] == 1e-2 * 0.5  # the scheduler stepped at its end
        opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


OPTIMIZERS = {
    "llmmem-fp32": lambda ps: lo.AdamW(ps, lr=1e-2, seed=3),
    "llmmem-int8": lambda ps: lo.AdamW(ps, lr=1e-2, state_dtype="int8", min_quantized_numel=64, seed=3),
    "torch-adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_resume_registered_before_load_state_dict_steps_with_the_loaded_groups(kind):
    # a resumed run: new model, optimizer and scheduler, step_in_backward registered, then the
    # saved states loaded (which replaces the optimizer's param_groups and state), the lr set by
    # hand and the scheduler stepping on: bit-identical to an uninterrupted run stepping after
    make = OPTIMIZERS[kind]
    batches = _batches(6)

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    ref = _model()
    ro = make(ref.parameters())
    rs = sched(ro)
    a = _model()
    oa = make(a.parameters())
    sa = sched(oa)
    handle = lo.step_in_backward(a, oa, scheduler=sa)
    for i, batch in enumerate(batches):
        if i == 3:  # save, drop, resume
            saved = _roundtrip({"model": a.state_dict(), "opt": oa.state_dict(), "sched": sa.state_dict()})
            handle.remove()
            a = _model(seed=7)
            oa = make(a.parameters())
            sa = sched(oa)
            handle = lo.step_in_backward(a, oa, scheduler=sa)
            a.load_state_dict(saved["model"])
            oa.load_state_dict(saved["opt"])
            sa.load_state_dict(saved["sched"])
            for opt in (oa, ro):
                opt.param_groups[0]["lr"] *= 3.0  # a hand-set lr, over the scheduler's
        _loss(a, batch).backward()
        ro.zero_grad()
        _loss(ref, batch).backward()
        ro.step()
        rs.step()
    handle.remove()
    assert oa.param_groups[0]["lr"] == ro.param_groups[0]["lr"]
    for pa, pb in zip(a.parameters(), ref.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))


@pytest.mark.parametrize("kind", ["llmmem-fp32", "torch-adamw"])
def test_lr_zero_after_load_state_dict_moves_nothing(kind):
    m = _model()
    opt = OPTIMIZERS[kind](m.parameters())
    with lo.step_in_backward(m, opt):
        opt.load_state_dict(opt.state_dict())
        for g in opt.param_groups:
            g["lr"] = 0.0
        before = [p.detach().clone() for p in m.parameters()]
        _loss(m, _batches(1)[0]).backward()
    assert all(torch.equal(b, p) for b, p in zip(before, m.parameters()))


@pytest.mark.parametrize("kind", ["llmmem-int8", "torch-adamw"])
@pytest.mark.parametrize("kept", ["nothing", "the handle", "a scheduler"])
def test_dropping_the_model_and_optimizer_frees_them_without_remove(kind, kept):
    def run():
        m = _model()
        opt = OPTIMIZERS[kind](m.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1) if kept == "a scheduler" else None
        handle = lo.step_in_backward(m, opt, scheduler=sched)  # never removed
        _loss(m, _batches(1)[0]).backward()
        tensors = [t for t in opt.state[m[0].weight].values() if torch.is_tensor(t)]
        refs = [weakref.ref(x) for x in [m, opt, m[0].weight, *tensors]]
        return refs, handle if kept == "the handle" else None

    refs, handle = run()
    gc.collect()  # (with a scheduler: the optimizer, its handle and the scheduler hold each other)
    assert all(r() is None for r in refs)
    if handle is not None:
        assert handle.optimizer is None and not handle.active
    if not any(h.active for h in lo.in_backward._active):  # (no other test's handle left active)
        assert not hasattr(torch.nn.utils.clip_grad_norm_, "_llmmem_guard")  # the guards went with the last one


def test_a_collected_optimizer_is_said_once_and_a_new_registration_replaces_it():
    m = _model()
    lo.step_in_backward(m, lo.AdamW(m.parameters(), lr=1e-2))  # nothing keeps this optimizer
    gc.collect()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(StateError, match="no longer exists(.|\n)*Keep a reference to the optimizer"):
        _loss(m, _batches(1)[0]).backward()
    assert all(torch.equal(b, p) for b, p in zip(before, m.parameters()))
    m.zero_grad(set_to_none=True)
    _loss(m, _batches(1)[0]).backward()  # the hooks are gone: a plain backward
    assert all(p.grad is not None for p in m.parameters())
    # a new registration on a model whose earlier optimizer was collected before any backward
    lo.step_in_backward(m, lo.AdamW(m.parameters()))
    gc.collect()
    opt = lo.AdamW(m.parameters(), lr=1e-2)
    with lo.step_in_backward(m, opt):
        m.zero_grad(set_to_none=True)
        _loss(m, _batches(1)[0]).backward()
    assert all(p.grad is None for p in m.parameters()) and len(opt.state) == len(before)


def test_a_second_registration_on_the_same_parameters_is_refused():
    m = _model()
    opt = lo.AdamW(m.parameters())
    first = lo.step_in_backward(m, opt)
    for other in (opt, torch.optim.SGD(m.parameters(), lr=0.1)):
        with pytest.raises(
            StateError,
            match=f"already stepped in backward by <StepInBackward of AdamW over 6 parameters, active, at {id(first):#x}>",
        ):
            lo.step_in_backward(m[0], other)
    first.remove()
    with lo.step_in_backward(m, opt):  # once removed, a new one is fine
        _loss(m, _batches(1)[0]).backward()


def test_clip_grad_norm_inf_returns_the_last_backwards_norm_and_clips_nothing():
    a, b = _model(), _model()
    oa, ob = lo.AdamW(a.parameters(), lr=1e-2, seed=3), lo.AdamW(b.parameters(), lr=1e-2, seed=3)
    extra = torch.nn.Parameter(torch.ones(5))  # a parameter not stepped in backward, with a gradient
    with lo.step_in_backward(a, oa):
        assert float(torch.nn.utils.clip_grad_norm_(a.parameters(), float("inf"))) == 0.0  # no backward yet
        for batch in _batches(3):
            _loss(a, batch).backward()
            ob.zero_grad()
            _loss(b, batch).backward()
            want = torch.nn.utils.clip_grad_norm_(b.parameters(), float("inf"))  # b: torch's own
            got = torch.nn.utils.clip_grad_norm_(a.parameters(), float("inf"))
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            ob.step()
        extra.grad = torch.full((5,), 2.0)
        both = torch.nn.utils.clip_grad_norm_([*a.parameters(), extra], float("inf"))
        torch.testing.assert_close(both, torch.sqrt(want.double() ** 2 + 20.0).float(), rtol=1e-6, atol=0)
        with pytest.raises(RuntimeError, match="non-finite"):
            a[0].weight.data[0, 0] = float("nan")
            _loss(a, _batches(1)[0]).backward()
            torch.nn.utils.clip_grad_norm_(a.parameters(), float("inf"), error_if_nonfinite=True)


def test_a_sparse_gradient_is_stepped_and_counted_in_the_norm():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    before = emb.weight.detach().clone()
    with lo.step_in_backward(emb, opt):
        emb(torch.tensor([1, 2, 2])).sum().backward()  # row 2 twice: its gradient is 2
        norm = torch.nn.utils.clip_grad_norm_(emb.parameters(), float("inf"))
    torch.testing.assert_close(norm, torch.tensor(20.0).sqrt(), rtol=1e-6, atol=0)
    torch.testing.assert_close(emb.weight[2], before[2] - 0.2)
    assert torch.equal(emb.weight[0], before[0])
