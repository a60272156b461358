"""MemoryTracker on several threads at once: each tracker labels only what its own thread makes and
saves (saved-tensor hooks and module hooks of one thread never reach another thread's tracker), and
trackers nested on one thread all see what is saved inside the innermost."""

from __future__ import annotations

import threading

import pytest
import torch
from support.diagnostics import saved_by_graph, storage_bytes, tiny_gpt

from llmmem.diagnostics.tracker import MemoryTracker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _step(model, opt, seen: dict, key: str, trackers) -> None:
    """A training step; after its forward, records what the trackers count and what the graph saved."""
    idx = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len))
    logits, loss = model(idx, targets=idx)
    own = set(storage_bytes(model.parameters())) | set(storage_bytes(model.buffers())) | {id(idx.untyped_storage())}
    saved = {k: v for k, v in saved_by_graph(loss).items() if k not in own}
    seen[key] = {"counted": [t.current() for t in trackers], "saved": sum(saved.values())}
    del logits
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def _figures(tracker) -> dict:
    rows = {r["module"]: r for r in tracker.modules()}
    return {"peak": tracker.peak(), "now": tracker.current(), "modules": rows, "steps": tracker.steps}


def _alone(**dims) -> dict:
    model, opt = tiny_gpt(**dims)
    seen: dict = {}
    with MemoryTracker(model, opt, stacks=False) as tracker:
        _step(model, opt, seen, "alone", [tracker])
    return {"figures": _figures(tracker), "params": sum(storage_bytes(model.parameters()).values())}


def test_two_threads_each_label_only_their_own_step():
    """Thread A runs its step while thread B's tracker is open and waiting, then B runs its step while
    A's is open: each tracker's figures equal those of the same step tracked alone. The models differ
    in size, so a tensor or module of the other thread would show in the bytes."""
    dims = {"a": dict(hidden=64, layers=2, dropout=0.0), "b": dict(hidden=32, layers=3, dropout=0.0)}
    alone = {k: _alone(**d) for k, d in dims.items()}
    both_open = threading.Barrier(2, timeout=60)
    a_done = threading.Event()
    results: dict = {}
    errors: list = []

    def run(key: str) -> None:
        try:
            model, opt = tiny_gpt(**dims[key])
            seen: dict = {}
            with MemoryTracker(model, opt, stacks=False) as tracker:
                both_open.wait()
                if key == "b":
                    assert a_done.wait(60)
                _step(model, opt, seen, key, [tracker])
                if key == "a":
                    a_done.set()
                both_open.wait()  # A's tracker stays open during B's step
            results[key] = (_figures(tracker), seen[key])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            both_open.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in dims]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for key in dims:
        figures, seen = results[key]
        counted = seen["counted"][0]
        assert counted["parameters"] == alone[key]["params"], key
        assert counted["activations"] == seen["saved"], key
        assert figures == alone[key]["figures"], key


def test_nested_trackers_on_one_thread_while_another_thread_tracks():
    """On thread A an outer and an inner tracker both count A's step exactly; thread B's tracker,
    open meanwhile, counts none of it, and A's trackers none of B's step."""
    dims = {"a": dict(hidden=64, layers=2, dropout=0.0), "b": dict(hidden=32, layers=3, dropout=0.0)}
    alone = {k: _alone(**d) for k, d in dims.items()}
    step_now = {"a": threading.Event(), "b": threading.Event()}
    finished = threading.Barrier(2, timeout=60)
    results: dict = {}
    errors: list = []

    def run_a() -> None:
        try:
            model, opt = tiny_gpt(**dims["a"])
            seen: dict = {}
            with MemoryTracker(model, opt, stacks=False) as outer:
                with MemoryTracker(model, opt, stacks=False) as inner:
                    assert step_now["a"].wait(60)
                    _step(model, opt, seen, "a", [outer, inner])
                step_now["b"].set()
                finished.wait()  # outer stays open during B's step
            results["a"] = (outer, inner, seen["a"])
        except BaseException as exc:
            errors.append(exc)
            finished.abort()

    def run_b() -> None:
        try:
            model, opt = tiny_gpt(**dims["b"])
            seen: dict = {}
            with MemoryTracker(model, opt, stacks=False) as tracker:
                step_now["a"].set()  # B's tracker is open during A's step
                assert step_now["b"].wait(60)
                _step(model, opt, seen, "b", [tracker])
                finished.wait()
            results["b"] = (tracker, seen["b"])
        except BaseException as exc:
            errors.append(exc)
            finished.abort()

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    outer, inner, seen_a = results["a"]
    assert seen_a["counted"][0] == seen_a["counted"][1]
    assert seen_a["counted"][0]["activations"] == seen_a["saved"]
    assert seen_a["counted"][0]["parameters"] == alone["a"]["params"]
    assert _figures(outer) == alone["a"]["figures"]
    tracker_b, seen_b = results["b"]
    assert seen_b["counted"][0]["activations"] == seen_b["saved"]
    assert _figures(tracker_b) == alone["b"]["figures"]
