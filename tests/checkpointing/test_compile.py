"""Checkpointing under ``torch.compile`` (issue 25, item 1 in part): ``llmmem.checkpoint`` (plain and
selective) around Hugging Face Llama layers and a model planned by ``auto_checkpoint``, compiled
with ``fullgraph=True``: one graph, no graph break, gradients those of the eager model (within
float32 reordering). Under Dynamo a region is torch's checkpoint (a higher-order operator). The
aot_eager backend keeps the test fast; inductor traces the same graph. Skipped without
``transformers``."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from support.planner import assert_grads_close, grads, lm_batch, seeded_step, tiny_llama, transformers_or_skip

import llmmem

transformers_or_skip()
dynamo = pytest.importorskip("torch._dynamo", reason="needs torch.compile")
from torch._dynamo.utils import counters  # noqa: E402

BATCH = dict(lm_batch(batch=2, seq=32), use_cache=False)  # a cache write is a side effect the graph refuses


def _step(model):
    return seeded_step(model, BATCH)


_close = assert_grads_close


@pytest.fixture(autouse=True)
def _fresh():
    dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield
    dynamo.reset()
    # what compiling left in reference cycles (tensors among it) is freed now, not by a collection
    # during a later test's measured step in this process (a T5 plan's budget moved by 64 KiB)
    gc.collect()


def _eager():
    model = tiny_llama("sdpa", layers=4, dropout=0.0)
    return _step(model), grads(model)


@pytest.mark.parametrize("selective", [False, True])
def test_checkpoint_compiles_to_one_graph(selective):
    want_loss, want = _eager()
    model = tiny_llama("sdpa", layers=4, dropout=0.0)
    options = {"context_fn": llmmem.selective_context_fn} if selective else {}
    for layer in model.model.layers:
        own = layer.forward
        layer.forward = lambda *a, _own=own, **k: llmmem.checkpoint(_own, *a, use_reentrant=False, **options, **k)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = _step(compiled)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    _close(grads(model), want)


def test_a_planned_model_compiles_to_one_graph():
    want_loss, want = _eager()
    model = tiny_llama("sdpa", layers=4, dropout=0.0)
    plan = llmmem.auto_checkpoint(model, budget=0.6, sample=BATCH, repeats=0)
    assert plan.regions or any(m != "store-all" for m in plan.modes)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # the second step runs the compiled graph as it is
        loss = _step(compiled)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        _close(grads(model), want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    plan.remove()


def _compile_notes(run) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    return [
        str(w.message) for w in seen if "torch.compile:" in str(w.message) or "and torch.compile" in str(w.message)
    ]


@pytest.fixture
def notes_fresh(monkeypatch):
    # what the process was told already (another test's offload) is not this test's
    from llmmem.checkpointing import compile_notes

    monkeypatch.setattr(compile_notes, "_said", set())
    monkeypatch.setattr(compile_notes, "_watched", [])


def test_offload_under_compile_says_the_inputs_stay_on_the_device(notes_fresh):
    # llmmem's offload hooks cannot run inside a compiled graph: the region is recomputed and its
    # inputs kept where they are, and compiling says so (the traced code itself cannot warn)
    want_loss, want = _eager()
    model = tiny_llama("sdpa", layers=4, dropout=0.0)
    for layer in model.model.layers:
        own = layer.forward
        layer.forward = lambda *a, _own=own, **k: llmmem.checkpoint(_own, *a, use_reentrant=False, offload=True, **k)
    assert _compile_notes(lambda: _step(model)) == []  # eager: offloaded as asked, nothing to say
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    notes = _compile_notes(lambda: _step(compiled))
    assert len(notes) == 1 and "offload=True" in notes[0] and "stay on the device" in notes[0], notes
    assert _compile_notes(lambda: _step(compiled)) == []  # said once
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(_step(compiled), want_loss, rtol=1e-6, atol=0)
    _close(grads(model), want)


@pytest.mark.parametrize("budget", [0.6, 0.4])  # a region of two blocks; a recompute-cheap block (chosen on work)
def test_a_plan_the_compiled_graph_changes_says_how(notes_fresh, budget):
    model = tiny_llama("sdpa", layers=4, dropout=0.0)
    plan = llmmem.auto_checkpoint(model, budget=budget, sample=BATCH, repeats=0)
    changes = plan.runner.compile_changes
    multi = any(e - s > 1 for s, e in plan.regions)
    assert bool(changes) == (multi or "recompute-cheap" in plan.modes or bool(plan.offloaded))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    notes = _compile_notes(lambda: _step(compiled))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert changes, (plan.regions, plan.modes)  # else the test tests nothing
    assert len(notes) == 1 and changes in notes[0] and "may exceed the budget" in notes[0], notes
    assert ("one checkpoint per block" in notes[0]) == multi
    assert ("selective" in notes[0]) == ("recompute-cheap" in plan.modes)
    plan.remove()


def test_the_selective_policy_is_carried_into_the_compiled_graph():
    # Under Dynamo llmmem's selective dispatch modes would run on fake tensors and the partitioner
    # would keep the whole tape (before the fix: as much as no checkpoint). The region's policy is
    # torch's selective contexts instead: the kept bytes are those of torch's selective
    # checkpointing with the same policy, and well below the block's tape.
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from llmmem.checkpointing.calls import BlockCall
    from llmmem.checkpointing.compiled import compiled_saved_bytes
    from llmmem.checkpointing.selective import KEPT_OPERATORS
    from llmmem.models.gpt import GPT, GPTConfig

    block = GPT(GPTConfig(layers=1, hidden=64, heads=4, seq_len=64, dropout=0.0)).blocks[0]
    call = BlockCall((torch.randn(2, 64, 64),), {}, 0)

    def policy(ctx, op, *args, **kwargs):
        kept = getattr(op, "overloadpacket", op) in KEPT_OPERATORS
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

    torch_sac = functools.partial(create_selective_checkpoint_contexts, policy)
    ours = torch.compile(
        lambda h: llmmem.checkpoint(block, h, use_reentrant=False, context_fn=llmmem.selective_context_fn),
        backend="aot_eager",
    )
    theirs = torch.compile(
        lambda h: torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=torch_sac),
        backend="aot_eager",
    )
    tape = compiled_saved_bytes(torch.compile(block, backend="aot_eager"), block, call)
    kept = compiled_saved_bytes(ours, block, call)
    assert kept == compiled_saved_bytes(theirs, block, call)
    assert 0 < kept < 0.6 * tape, (kept, tape)
