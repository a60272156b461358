"""The "recompute-cheap" mode (llmmem.remat): bitwise gradients, the bytes it frees, what it must
not drop, errors instead of wrong gradients, and no leak when no backward runs."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.models import gpt_block

import llmmem
from llmmem.checkpointing import measure_saved_bytes, recompute_cheap
from llmmem.models.gpt import GPT, GPTConfig


def _step(fn, module, x, seed=7):
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    y = fn(x)
    y.square().sum().backward()
    return [y.detach()] + [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


def _cheap(module, layer_norms=True):
    def run(x):
        with recompute_cheap(module if layer_norms else None):
            return module(x)

    return run


def _saved(fn, module, x):
    with measure_saved_bytes(exclude=list(module.parameters()) + list(module.buffers()) + [x]) as m:
        y = fn(x)
    del y
    return m.bytes


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("layer_norms", [True, False])
def test_gpt_block_bitwise_and_frees_gelu_probabilities_layer_norms(dropout, layer_norms):
    block = gpt_block(dropout)
    x = torch.randn(2, 16, 32, requires_grad=True)
    ref = _step(block, block, x)
    got = _step(_cheap(block, layer_norms), block, x)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    b, s, h = x.shape
    heads = 4
    gelu_out = b * s * 4 * h * 4
    probs = b * heads * s * s * 4 if dropout > 0 else 0  # without dropout the probabilities are the softmax's result
    ln_outs = 2 * b * s * h * 4 if layer_norms else 0  # eps is known only with the module
    assert _saved(block, block, x) - _saved(_cheap(block, layer_norms), block, x) == gelu_out + probs + ln_outs


def test_swiglu_chain_and_silu():
    """silu(gate) * up: the product is rebuilt through SiLU (a chain of two operators)."""
    torch.manual_seed(0)
    gate, up, down = nn.Linear(16, 64), nn.Linear(16, 64), nn.Linear(64, 16)
    mod = nn.ModuleList([gate, up, down])

    def f(x):
        return down(F.silu(gate(x)) * up(x))

    x = torch.randn(8, 16, requires_grad=True)
    ref = _step(f, mod, x)

    def cheap(x):
        with recompute_cheap():
            return f(x)

    got = _step(cheap, mod, x)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # neither silu(gate) (saved by the multiply, rebuilt from gate's output that SiLU keeps) nor the
    # product (saved by `down`, rebuilt through SiLU then the multiply) is kept
    assert _saved(f, mod, x) - _saved(cheap, mod, x) == 2 * 8 * 64 * 4


def test_inplace_change_of_an_operand_raises_not_wrong_gradients():
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with recompute_cheap():
        h = lin1(x)
        g = F.gelu(h)  # GELU keeps h
        y = lin2(g)  # keeps g: dropped, rebuilt from h
    with torch.no_grad():
        h.add_(1.0)  # now rebuilding g would use a different h
    with pytest.raises(llmmem.CheckpointError, match="inplace"):
        y.sum().backward()


def test_forward_without_backward_does_not_leak():
    """A saved output (tanh keeps its result) kept as itself would hold its own grad_fn: a cycle
    through C++ that the garbage collector cannot free."""
    import weakref

    x = torch.randn(64, requires_grad=True)
    with recompute_cheap():
        y = x.tanh()
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None


def test_inplace_change_of_a_kept_tensor_raises():
    x = torch.randn(64, requires_grad=True)
    with recompute_cheap():
        y = x.tanh()
        z = y.sum()
    with torch.no_grad():
        y.mul_(2.0)
    with pytest.raises(RuntimeError, match="inplace"):
        z.backward()


def test_planner_uses_it_and_runs_it():
    """A plan with recompute-cheap blocks: same gradients as the plain chain, held bytes as predicted."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=3, hidden=32, heads=4, seq_len=16, vocab_size=64, dropout=0.1))
    x0 = model.embed(torch.randint(0, 64, (2, 16))).detach()
    prof = llmmem.profile_blocks(model.blocks, x0, repeats=1, warmup=0)
    assert prof.modes == ("store-all", "selective", "recompute-cheap")
    k = prof.modes.index("recompute-cheap")
    assert prof.saved_bytes[0][k] < prof.saved_bytes[0][0]
    # Make recompute-cheap clearly the cheapest way to save memory, then ask for just what it saves.
    # (times set, not measured: one timed repeat without warm-up is mostly first-call set-up)
    prof.fwd_time = [[1.0, 1.0, 1.0] for _ in range(3)]
    prof.bwd_time = [[2.0, 20.0, 2.02] for _ in range(3)]
    prof.fwd_nostore_time = [1.0] * 3
    plain = llmmem.plan_checkpoints(None, budget=1.0, profile=prof)
    # (a little above the exact fit: the DP rounds sizes up to its memory slots)
    budget = plain.predicted_peak_bytes - (prof.saved_bytes[0][0] - prof.saved_bytes[0][k]) + 1024
    plan = llmmem.plan_checkpoints(None, budget=budget, profile=prof, slots=20000)
    assert "recompute-cheap" in plan.modes and not plan.regions
    auto = llmmem.checkpointing.AutoCheckpointed(list(model.blocks), plan)

    def chain(x):
        for b in model.blocks:
            x = b(x)
        return x

    x = x0.clone().requires_grad_()
    ref = _step(chain, model.blocks, x)
    got = _step(auto, model.blocks, x)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    with measure_saved_bytes(exclude=list(model.parameters()) + list(model.buffers())) as m:
        y = auto(x0.clone().requires_grad_())
    del y
    assert abs(m.bytes - plan.predicted_held_bytes) <= 0.1 * plan.predicted_held_bytes


def test_cpu_autocast_bf16_bitwise():
    """Under autocast the rebuilt operators see the operands the forward saw (already cast) and
    run with autocast off: the same results."""
    block = gpt_block(0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def plain(t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return block(t).float()

    def cheap(t):
        with torch.autocast("cpu", dtype=torch.bfloat16), recompute_cheap(block):
            return block(t).float()

    ref = _step(plain, block, x)
    got = _step(cheap, block, x)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert _saved(cheap, block, x) < _saved(plain, block, x)


def test_layer_norm_called_with_a_module_weight_and_another_eps():
    """eps is read from the module whose weight the LayerNorm node saved; a functional call with that
    weight and another eps (a subclass's forward, or code that shares the weight) must not be rebuilt
    with the module's eps: that gave silently wrong gradients."""
    torch.manual_seed(0)
    ln, lin = nn.LayerNorm(8), nn.Linear(8, 8)

    class Custom(nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, 0.5)

    custom = Custom(8)
    shared = nn.LayerNorm(8, eps=0.25)  # tied to ln's parameters, another eps
    shared.weight, shared.bias = ln.weight, ln.bias
    x = torch.randn(4, 3, 8, requires_grad=True)
    for f, mod in (
        (lambda t: lin(F.layer_norm(t, (8,), ln.weight, ln.bias, eps=1.0)), nn.ModuleList([ln, lin])),
        (lambda t: lin(custom(t)), nn.ModuleList([custom, lin])),
        (lambda t: lin(ln(t)) + lin(shared(t)), nn.ModuleList([ln, lin, shared])),
    ):
        ref = _step(f, mod, x)
        got = _step(_cheap_fn(f, mod), mod, x)
        for a, b in zip(ref, got):
            assert torch.equal(a, b)


def _cheap_fn(f, module):
    def run(x):
        with recompute_cheap(module):
            return f(x)

    return run


def test_tensor_changed_under_no_grad_before_it_is_saved_is_kept():
    """A GELU output changed in place under no_grad keeps its grad_fn (only its version moves): the
    matmul saves the changed values, so rebuilding GELU's output would give other gradients."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
    mod = nn.ModuleList([lin1, lin2])

    def f(x):
        g = F.gelu(lin1(x))
        with torch.no_grad():
            g.clamp_(max=0.1)
        return lin2(g)

    x = torch.randn(4, 8, requires_grad=True)
    ref = _step(f, mod, x)
    got = _step(_cheap_fn(f, None), mod, x)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["retain_graph", "partial_grad"])
def test_graph_is_freed_after_a_backward_that_keeps_it(how):
    """The memo of rebuilt outputs must not hold the nodes it rebuilt: node -> next node -> saved
    handle -> memo -> node is a cycle through C++ that the garbage collector cannot see, so a
    graph kept by retain_graph (or not fully run by autograd.grad) was never freed."""
    from llmmem.checkpointing import remat

    block = gpt_block(0.1)
    gc.collect()
    before = sum(type(o) is remat._Memo for o in gc.get_objects())
    x = torch.randn(2, 16, 32, requires_grad=True)
    with recompute_cheap(block):
        y = block(x)
    if how == "retain_graph":
        y.sum().backward(retain_graph=True)
    else:
        torch.autograd.grad(y.sum(), [block.mlp.proj.weight])
    del y, x
    gc.collect()
    assert sum(type(o) is remat._Memo for o in gc.get_objects()) == before


def test_layer_norm_rebuild_with_another_eps_raises():
    """The last guard: a LayerNorm rebuilt with an eps other than the forward's raises."""
    from llmmem.checkpointing import remat

    x = torch.randn(4, 8, requires_grad=True)
    y = F.layer_norm(x, (8,), eps=1e-5)
    operands = remat._layer_norm_operands(y.grad_fn)
    assert torch.equal(remat._layer_norm(operands, 1e-5), y.detach())
    with pytest.raises(RuntimeError, match="eps"):
        remat._layer_norm(operands, 1e-3)


def test_operand_changed_under_no_grad_before_the_multiply_is_not_rebuilt_from_its_maker():
    """gelu(h) * mask: the multiply keeps only the mask, so its other operand would be rebuilt from
    GELU; a change of that operand under no_grad before the multiply is seen by nothing autograd
    keeps (no version to check), and the rebuild gave the values before it: such a product is kept."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
    mod = nn.ModuleList([lin1, lin2])
    mask = (torch.rand(4, 16) > 0.5).float()

    def f(x):
        a = F.gelu(lin1(x))
        with torch.no_grad():
            a.mul_(2.0)
        return lin2(a * mask)

    x = torch.randn(4, 8, requires_grad=True)
    ref = _step(f, mod, x)
    got = _step(_cheap_fn(f, None), mod, x)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_hook_clock_times_hooks_and_rebuilds_without_changing_gradients():
    """remat.hook_clock: the pack and unpack hooks' seconds and, within the unpacks, the rebuilding
    operators' (the planner prices the mode's Python as the difference); gradients stay bitwise."""
    from llmmem.checkpointing import remat

    torch.manual_seed(0)
    block = gpt_block(dropout=0.1)
    x = torch.randn(2, 8, 32, requires_grad=True)
    ref = _step(_cheap(block), block, x)
    with remat.hook_clock() as clock:
        got = _step(_cheap(block), block, x)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        before = list(clock)
        with remat.hook_clock() as inner:  # the innermost clock takes what runs inside it
            _step(_cheap(block), block, x)
        assert list(clock) == before
    pack, unpack, operators = clock
    assert pack > 0 and unpack > 0 and operators > 0
    assert operators <= unpack  # the rebuilds run inside the unpacks
    assert inner[0] > 0 and inner[2] > 0
    after = list(clock)
    _step(_cheap(block), block, x)  # outside any clock: nothing is timed
    assert list(clock) == after and remat._clock() is None


def test_hook_clock_counts_a_rebuilt_operand_of_a_rebuild_once():
    """A LayerNorm of a product: rebuilding the LayerNorm's output first rebuilds its input (the
    product, itself dropped). Its operands are fetched before the rebuild is timed, so the operators'
    seconds stay inside the unpacks' (they were counted twice)."""
    from llmmem.checkpointing import remat

    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(512), nn.Linear(512, 8))
    a = torch.randn(256, 512, requires_grad=True)
    b = torch.randn(256, 512, requires_grad=True)
    with remat.hook_clock() as clock:
        with recompute_cheap(block):
            y = block(a * b)
        y.sum().backward()
    assert 0 < clock[2] <= clock[1]


def test_hook_clock_ignores_other_threads():
    import threading

    from llmmem.checkpointing import remat

    block = gpt_block(dropout=0.0)
    x = torch.randn(2, 8, 32, requires_grad=True)
    with remat.hook_clock() as clock:
        worker = threading.Thread(target=_step, args=(_cheap(block), block, x))
        worker.start()
        worker.join()
    assert clock == [0.0, 0.0, 0.0]
