"""llmmem.checkpoint against torch's non-reentrant checkpoint: one suite run over both.

Every case compares the checkpointed run with a plain (not checkpointed) run of the same function
from the same seed, bitwise on CPU, and the two implementations must agree with each other too.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc
from support.models import gpt_block

import llmmem
from llmmem.models.gpt import GPT, GPTConfig

# torch < 2.9 has no early_stop option (set_checkpoint_early_stop only): it would pass it to the function
_TORCH_HAS_EARLY_STOP = "early_stop" in inspect.signature(tuc.checkpoint).parameters


def _torch_ckpt(fn, *args, **kwargs):
    kwargs.setdefault("use_reentrant", False)
    kwargs.pop("offload", None)  # torch has no offload option; its result must match anyway
    if not _TORCH_HAS_EARLY_STOP and "early_stop" in kwargs:
        with tuc.set_checkpoint_early_stop(kwargs.pop("early_stop")):
            return tuc.checkpoint(fn, *args, **kwargs)
    return tuc.checkpoint(fn, *args, **kwargs)


def _llmmem_ckpt(fn, *args, **kwargs):
    # use_reentrant explicit on both sides: omitted, each warns (test_checkpoint_parity.py checks that)
    kwargs.setdefault("use_reentrant", False)
    return llmmem.checkpoint(fn, *args, **kwargs)


IMPLS = {
    "torch": (_torch_ckpt, tuc.CheckpointError),
    "llmmem": (_llmmem_ckpt, llmmem.CheckpointError),
}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def _grads(module, *tensors):
    return [p.grad.clone() for p in module.parameters()] + [t.grad.clone() for t in tensors]


def _run(fn, module, x, seed=123):
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    y = fn(x)
    y.square().sum().backward()
    return y.detach(), _grads(module, x)


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.equal(u, v), (u - v).abs().max()


def test_gpt_block_with_dropout_bitwise(impl):
    ckpt, _ = impl
    block = gpt_block(dropout=0.2)
    x = torch.randn(2, 16, 32, requires_grad=True)
    y_ref, g_ref = _run(block, block, x)
    y, g = _run(lambda t: ckpt(block, t), block, x)
    assert torch.equal(y, y_ref)
    _assert_bitwise(g, g_ref)


def test_both_implementations_agree_on_sdpagpt_block():
    block = gpt_block(dropout=0.1, attention="sdpa")
    x = torch.randn(2, 16, 32, requires_grad=True)
    results = [_run(lambda t, c=c: c(block, t), block, x) for c, _ in IMPLS.values()]
    assert torch.equal(results[0][0], results[1][0])
    _assert_bitwise(results[0][1], results[1][1])


def test_kwargs(impl):
    ckpt, _ = impl
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)

    def fn(a, *, shift, scale=1.0):
        return torch.tanh(lin(a) * scale + shift)

    y_ref = fn(x, shift=bias, scale=2.0)
    g_ref = torch.autograd.grad(y_ref.sum(), [x, bias, lin.weight])
    y = ckpt(fn, x, shift=bias, scale=2.0)
    g = torch.autograd.grad(y.sum(), [x, bias, lin.weight])
    assert torch.equal(y, y_ref)
    _assert_bitwise(g, g_ref)


def test_tensors_in_containers_and_non_tensor_outputs(impl):
    ckpt, _ = impl
    w = torch.randn(6, 6, requires_grad=True)

    def fn(pair, table):
        a, b = pair
        out = torch.sigmoid(a @ w) * table["scale"] + b.exp()
        return {"out": out, "note": "ok", "n": 3, "parts": [out.sin(), None]}

    a = torch.randn(3, 6, requires_grad=True)
    b = torch.randn(3, 6, requires_grad=True)
    s = torch.randn(6, requires_grad=True)
    ref = fn((a, b), {"scale": s})
    g_ref = torch.autograd.grad((ref["out"].sum() + ref["parts"][0].sum()), [a, b, s, w])
    got = ckpt(fn, (a, b), {"scale": s})
    assert got["note"] == "ok" and got["n"] == 3 and got["parts"][1] is None
    g = torch.autograd.grad((got["out"].sum() + got["parts"][0].sum()), [a, b, s, w])
    _assert_bitwise(g, g_ref)


def test_inputs_without_requires_grad(impl):
    ckpt, _ = impl
    block = gpt_block(dropout=0.1)
    x = torch.randn(2, 16, 32)  # e.g. a frozen embedding's output
    torch.manual_seed(5)
    block(x).sum().backward()
    g_ref = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    ckpt(block, x).sum().backward()
    _assert_bitwise([p.grad for p in block.parameters()], g_ref)


def test_cpu_autocast_bf16(impl):
    ckpt, _ = impl
    block = gpt_block(dropout=0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def run(fn):
        block.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        return _grads(block, x)

    def fn(t):  # ends in a Linear, so the output is bf16 under autocast
        return block.mlp.fc(block(t))

    _assert_bitwise(run(lambda t: ckpt(fn, t)), run(fn))


def test_nested_checkpoints(impl):
    ckpt, _ = impl
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(4))

    def inner(t, lo, hi):
        for layer in layers[lo:hi]:
            t = layer(t)
        return t

    def outer(t):
        t = ckpt(inner, t, 0, 2)
        t = ckpt(lambda u: ckpt(inner, u, 2, 3), t)
        return inner(t, 3, 4)

    x = torch.randn(8, 16, requires_grad=True)
    mod = nn.Module()
    mod.layers = layers
    y_ref, g_ref = _run(lambda t: inner(t, 0, 4), mod, x)
    y, g = _run(lambda t: ckpt(outer, t), mod, x)
    assert torch.equal(y, y_ref)
    _assert_bitwise(g, g_ref)


def test_autograd_grad_and_backward_inputs(impl):
    ckpt, _ = impl
    block = gpt_block(dropout=0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    ref = torch.autograd.grad(block(x).sum(), [x])[0]
    got = torch.autograd.grad(ckpt(block, x).sum(), [x])[0]
    assert torch.equal(got, ref)
    w = block.mlp.fc.weight
    ckpt(block, x).sum().backward(inputs=[w])
    assert x.grad is None and w.grad is not None
    g_w = w.grad.clone()
    w.grad = None
    block(x).sum().backward(inputs=[w])
    assert torch.equal(g_w, w.grad)


def test_retain_graph_recomputes_for_each_backward(impl):
    ckpt, _ = impl
    lin = nn.Linear(5, 5)
    x = torch.randn(3, 5, requires_grad=True)
    y = ckpt(lambda t: lin(t).relu().exp(), x)
    g1 = torch.autograd.grad(y.sum(), [x], retain_graph=True)[0]
    g2 = torch.autograd.grad(y.sum(), [x])[0]
    assert torch.equal(g1, g2)


def test_early_stop_off_gives_same_grads(impl):
    ckpt, _ = impl
    block = gpt_block(dropout=0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    _, g_ref = _run(lambda t: ckpt(block, t), block, x)
    _, g = _run(lambda t: ckpt(block, t, early_stop=False), block, x)
    _assert_bitwise(g, g_ref)


def test_recompute_saving_different_shapes_raises(impl):
    ckpt, error = impl
    calls = []

    def changes_shape(t):
        calls.append(1)
        return (t if len(calls) == 1 else t[:2]).exp().sum()

    x = torch.randn(4, 3, requires_grad=True)
    out = ckpt(changes_shape, x)
    with pytest.raises(error, match="(?i)metadata|shape"):
        out.backward()


def test_recompute_saving_fewer_tensors_raises(impl):
    ckpt, error = impl
    calls = []

    def fewer(t):
        calls.append(1)
        if len(calls) == 1:
            return t.exp().exp().sum()
        return t.exp().sum()

    x = torch.randn(4, requires_grad=True)
    out = ckpt(fewer, x)
    with pytest.raises(error, match="(?i)number of tensors|fewer"):
        out.backward()


def test_determinism_check_none_skips_the_check(impl):
    ckpt, _ = impl
    calls = []

    def shape_changes(t):
        calls.append(1)
        return (t if len(calls) == 1 else t * 1.0).exp().sum()

    x = torch.randn(4, requires_grad=True)
    ckpt(shape_changes, x, determinism_check="none").backward()
    assert torch.allclose(x.grad, x.exp())


def test_checkpoint_error_message_is_useful():
    x = torch.randn(4, 3, requires_grad=True)
    calls = []

    def fn(t):
        calls.append(1)
        return (t if len(calls) == 1 else t[:2]).exp().sum()

    out = llmmem.checkpoint(fn, x, debug=True)
    with pytest.raises(llmmem.CheckpointError) as info:
        out.backward()
    text = str(info.value)
    assert "shape=[4, 3]" in text and "shape=[2, 3]" in text
    assert "forward: " in text and "recompute: " in text and "aten.exp" in text
    assert isinstance(info.value, tuc.CheckpointError) and isinstance(info.value, llmmem.LlmmemError)


def test_curried_form_and_method():
    lin = nn.Linear(4, 4)

    @llmmem.checkpoint(use_reentrant=False, determinism_check="default")
    def fn(t, *, early_stop):  # a user kwarg named like an option reaches the function
        return lin(t).tanh() * (2.0 if early_stop else 1.0)

    x = torch.randn(3, 4, requires_grad=True)
    fn(x, early_stop=True).sum().backward()
    g = x.grad.clone()
    x.grad = None
    (lin(x).tanh() * 2.0).sum().backward()
    assert torch.equal(g, x.grad)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @llmmem.checkpoint()
        def forward(self, t):
            return self.lin(t).relu()

    m = M()
    m(x).sum().backward()
    assert m.lin.weight.grad is not None


def test_options_are_validated():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="determinism_check"):
        llmmem.checkpoint(torch.sin, x, determinism_check="strict")
    with pytest.raises(TypeError, match="callable"):
        llmmem.checkpoint(3, x)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        llmmem.checkpoint(torch.sin, x, use_reentrant=True, offload=True)
    with pytest.raises(ValueError, match="debug"):
        llmmem.checkpoint(torch.sin, x, debug=True, context_fn=lambda: (None, None))
    with pytest.raises(TypeError, match="options"):
        llmmem.checkpoint(None, x)


def test_use_reentrant_true_delegates_to_torch():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    llmmem.checkpoint(lambda t: lin(t).sin(), x, use_reentrant=True).sum().backward()
    g = x.grad.clone()
    x.grad = None
    lin(x).sin().sum().backward()
    assert torch.equal(g, x.grad)
    with pytest.raises(ValueError, match="Unexpected keyword"):
        llmmem.checkpoint(lambda t, k: t, x, use_reentrant=True, k=1)


def test_no_grad_just_runs():
    with torch.no_grad():
        y = llmmem.checkpoint(torch.exp, torch.zeros(3))
    assert torch.equal(y, torch.ones(3))


def test_offload_gives_identical_grads(impl):
    ckpt, _ = impl
    block = gpt_block(dropout=0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    _, g_ref = _run(block, block, x)
    _, g = _run(lambda t: ckpt(block, t, offload=True), block, x)
    _assert_bitwise(g, g_ref)


@pytest.mark.cuda
def test_offload_cuda_identical_grads_and_inputs_leave_the_device():
    torch.manual_seed(0)
    blocks = GPT(GPTConfig(layers=3, hidden=64, heads=4, seq_len=32, vocab_size=64, dropout=0.1)).blocks.cuda()
    x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)

    def run(**opts):
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(3)
        t = x
        for b in blocks:
            t = llmmem.checkpoint(b, t, **opts)
        t.square().sum().backward()
        return [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]

    _assert_bitwise(run(offload=True), run())


def test_saves_only_the_inputs():
    """What a checkpointed block leaves saved for backward (seen from outside) is its input."""
    block = gpt_block(dropout=0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        llmmem.checkpoint(block, x)
    assert sum(seen.values()) == x.numel() * x.element_size()


def test_checkpoint_sequential_matches_plain():
    from llmmem.checkpointing.sequential import _even_split, _torch_split

    assert [e - s for s, e in _even_split(9, 5)] == [2, 2, 2, 2, 1]
    assert [e - s for s, e in _even_split(8, 4)] == [2, 2, 2, 2]
    assert [e - s for s, e in _torch_split(9, 5)] == [1, 1, 1, 1, 5]
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.1)) for _ in range(7)])
    x = torch.randn(4, 8, requires_grad=True)
    y_ref, g_ref = _run(seq, seq, x)
    for split in ("torch", "even"):
        y, g = _run(lambda t: llmmem.checkpoint_sequential(seq, 3, t, split=split), seq, x)
        assert torch.equal(y, y_ref)
        _assert_bitwise(g, g_ref)
    for bad in (0, 8, "two", 1.5):
        with pytest.raises(ValueError, match="segments"):
            llmmem.checkpoint_sequential(seq, bad, x)
    with pytest.raises(ValueError, match="unexpected keyword"):
        llmmem.checkpoint_sequential(seq, 2, x, foo=1)
    # the blocks of a model usually live in an nn.ModuleList, which torch's version accepts too
    y_list, g_list = _run(lambda t: llmmem.checkpoint_sequential(nn.ModuleList(seq), 3, t), seq, x)
    assert torch.equal(y_list, y_ref)
    _assert_bitwise(g_list, g_ref)
    with pytest.raises(TypeError, match="functions must be"):
        llmmem.checkpoint_sequential({"a": seq}, 2, x)


def test_checkpoint_sequential_saves_segment_inputs_only():
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    x = torch.randn(4, 8, requires_grad=True)
    counted = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: counted.append(t) or t, lambda t: t):
        llmmem.checkpoint_sequential(seq, 3, x)
    # segments [0,2) [2,4) checkpointed (their inputs saved), last [4,6) runs plainly: each Linear
    # saves its input (weights are saved too), each Tanh its output.
    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        nn.Sequential(*list(seq)[4:])(torch.randn(4, 8, requires_grad=True))
    assert len(counted) == 2 + len(plain)


def test_feature_status_reports():
    from llmmem import checkpointing, diagnostics

    usable, detail = checkpointing.feature_status()
    assert usable is True and "planner" in detail
    assert "activation checkpointing" in diagnostics.info()
    assert callable(llmmem.checkpoint) and llmmem.checkpoint is checkpointing.checkpoint


def test_functools_partial_targets_work(impl):
    ckpt, _ = impl
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    y = ckpt(functools.partial(torch.nn.functional.linear, weight=lin.weight, bias=lin.bias), x)
    y.sum().backward()
    assert lin.weight.grad is not None


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_skips_work_after_the_last_saved_tensor(impl, early_stop):
    ckpt, _ = impl
    after_last_save = []

    def fn(t):
        y = t.exp()  # exp saves its output: the region's last saved tensor
        after_last_save.append(1)
        return y * 2.0

    x = torch.randn(5, requires_grad=True)
    ckpt(fn, x, early_stop=early_stop).sum().backward()
    assert torch.equal(x.grad, 2.0 * x.exp())
    assert len(after_last_save) == (1 if early_stop else 2)


def test_backward_inside_the_checkpointed_function(impl):
    ckpt, _ = impl

    def fn(t):
        y = t.sin()
        (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
        return (g * y).exp()

    x = torch.randn(5, requires_grad=True)
    fn(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    ckpt(fn, x).sum().backward()
    assert torch.equal(x.grad, ref)


def test_selective_context_fn_keeps_matmul_outputs_and_matches_grads():
    """Selective recompute: bitwise gradients, and it keeps less than store-all but more than
    the input alone (the Linear outputs)."""
    from llmmem.checkpointing import measure_saved_bytes

    block = gpt_block(dropout=0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    _, g_ref = _run(block, block, x)
    _, g = _run(lambda t: llmmem.checkpoint(block, t, context_fn=llmmem.selective_context_fn), block, x)
    _assert_bitwise(g, g_ref)
    params = list(block.parameters()) + list(block.buffers())
    with measure_saved_bytes(exclude=params) as full:
        block(x)
    with measure_saved_bytes(exclude=params) as sel:
        llmmem.checkpoint(block, x, context_fn=llmmem.selective_context_fn)
    # input + qkv (3h) + attention proj (h) + fc (4h) + mlp proj (h) outputs, float32
    b, s, h = x.shape
    assert sel.bytes == b * s * h * 4 * (1 + 3 + 1 + 4 + 1)
    assert sel.bytes < full.bytes


def test_selective_context_fn_refuses_a_kept_output_changed_in_place():
    """A kept matmul output changed in place after the policy kept it would come back changed in
    the recompute (and be changed again: wrong gradients); the recompute refuses it instead."""
    torch.manual_seed(0)
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    y = llmmem.checkpoint(
        lambda t: torch.mm(t, w).mul_(2).sin(), x, use_reentrant=False, context_fn=llmmem.selective_context_fn
    )
    with pytest.raises(llmmem.CheckpointError, match="modified in place"):
        y.sum().backward()


def test_regions_are_freed_after_backward_without_gc(monkeypatch):
    """No reference cycles: a region (and the inputs it holds) dies with its graph."""
    import gc
    import weakref

    from llmmem.checkpointing import core

    alive = []
    original = core._Region.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        alive.append(weakref.ref(self))

    monkeypatch.setattr(core._Region, "__init__", tracking_init)
    block = gpt_block(dropout=0.1)
    gc.disable()
    try:
        for _ in range(5):
            x = torch.randn(2, 16, 32, requires_grad=True)
            llmmem.checkpoint(lambda t: llmmem.checkpoint(block, t), x).sum().backward()
        assert len(alive) >= 10 and all(r() is None for r in alive)
    finally:
        gc.enable()


def test_torch_global_early_stop_switch_is_honoured(impl):
    ckpt, _ = impl
    after_last_save = []

    def fn(t):
        y = t.exp()
        after_last_save.append(1)
        return y * 2.0

    x = torch.randn(3, requires_grad=True)
    with tuc.set_checkpoint_early_stop(False):
        out = ckpt(fn, x)
    out.sum().backward()
    assert len(after_last_save) == 2
