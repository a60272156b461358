"""MemoryTracker on several threads at once: each tracker labels only what its own thread makes and
saves (saved-tensor hooks and module hooks of one thread never reach another thread's tracker),
trackers nested on one thread all see what is saved inside the innermost and may be left in any
order, and ``oom_report`` on a step that several threads run tracks each thread apart. Whatever the
order or the thread, nothing is left behind (global hooks, dispatch modes, saved-tensor hooks)."""

from __future__ import annotations

import threading

import pytest
import torch
from support.diagnostics import NOTHING_LEFT, hooks_left, saved_by_graph, storage_bytes, tiny_gpt
from torch.utils._python_dispatch import TorchDispatchMode

import llmmem
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


def _fixed_step(model, opt) -> None:
    """A training step on fixed token ids: the same operators every time."""
    idx = torch.arange(2 * model.cfg.seq_len).reshape(2, -1) % model.cfg.vocab_size
    logits, loss = model(idx, targets=idx)
    del logits
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_oom_report_on_a_step_that_two_threads_run_at_once():
    """The decorated step is entered on A, then on B; A returns while B is in its forward, then B
    runs its backward: both return their result (B's used to raise torch's INTERNAL ASSERT from the
    saved-tensor hooks A's exit had popped on the wrong thread), each thread had its own tracker, and
    nothing is left on either thread or in the process afterwards."""
    model, opt = tiny_gpt(dropout=0.0)
    both_inside, a_returned = threading.Barrier(2, timeout=60), threading.Event()
    results, errors, trackers, left = {}, [], {}, {}
    report = llmmem.oom_report(model=model)

    @report
    def step(name: str) -> str:
        both_inside.wait()
        idx = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len))
        logits, loss = model(idx, targets=idx)
        if name == "b":
            assert a_returned.wait(60)
            loss.backward()
        return name

    def run(name: str) -> None:
        try:
            results[name] = step(name)
            trackers[name] = report.tracker
            if name == "a":
                a_returned.set()
            left[name] = {k: v for k, v in hooks_left().items() if k in ("dispatch_modes", "saved_tensors_hooks")}
        except BaseException as exc:
            errors.append(exc)
            both_inside.abort()
            a_returned.set()

    threads = [threading.Thread(target=run, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {"a": "a", "b": "b"}
    assert trackers["a"] is not trackers["b"] and trackers["a"] is not report.tracker
    assert trackers["a"].steps == trackers["b"].steps == 1
    assert left == {n: {"dispatch_modes": 0, "saved_tensors_hooks": False} for n in "ab"}
    assert hooks_left() == NOTHING_LEFT


def test_trackers_left_out_of_order_on_one_thread():
    """Outer entered, inner entered, outer left first: the outer stops counting at once and the
    inner counts the step exactly as a tracker alone does (it used to lose its saved-tensor hooks and
    its counting mode to the outer's exit, which took the top of each stack); nothing is left."""
    model, opt = tiny_gpt(dropout=0.0)
    _fixed_step(model, opt)  # the optimizer state exists: both runs start from the same state
    with MemoryTracker(model, opt, stacks=False) as alone:
        _fixed_step(model, opt)
    outer, inner = MemoryTracker(model, opt, stacks=False), MemoryTracker(model, opt, stacks=False)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    events = outer.events
    _fixed_step(model, opt)
    inner.__exit__(None, None, None)
    assert outer.events == events
    assert _figures(inner) == _figures(alone)
    assert hooks_left() == NOTHING_LEFT


def test_a_tracker_left_before_hooks_and_modes_entered_inside_it():
    """A user's saved-tensor hooks and dispatch mode entered inside a tracker keep working when the
    tracker is left first, and leave nothing when they are left."""
    model, opt = tiny_gpt(dropout=0.0)
    packed, ops = [], []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    tracker = MemoryTracker(model, opt, stacks=False)
    tracker.__enter__()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)
    hooks.__enter__()
    mode = Ops()
    mode.__enter__()
    tracker.__exit__(None, None, None)
    events = tracker.events
    _fixed_step(model, opt)
    assert packed and ops
    assert tracker.events == events
    mode.__exit__(None, None, None)
    hooks.__exit__(None, None, None)
    assert hooks_left() == NOTHING_LEFT


def test_a_tracker_left_on_another_thread_says_so_and_stays_whole():
    """Leaving a tracker on a thread that did not enter it raises a RuntimeError naming both threads
    and changes nothing (it used to half-clean up and hit torch's INTERNAL ASSERT); it still counts
    on its own thread, and leaving it there leaves nothing."""
    model, opt = tiny_gpt(dropout=0.0)
    tracker = MemoryTracker(model, opt, stacks=False)
    tracker.__enter__()
    raised = []

    def leave() -> None:
        try:
            tracker.__exit__(None, None, None)
        except RuntimeError as exc:
            raised.append(str(exc))

    other = threading.Thread(target=leave)
    other.start()
    other.join(60)
    assert len(raised) == 1 and "entered on thread" in raised[0] and "still active" in raised[0]
    _fixed_step(model, opt)
    tracker.__exit__(None, None, None)
    assert tracker.steps == 1 and tracker.current()["gradients"] == 0 and tracker.current()["optimizer_state"] > 0
    assert hooks_left() == NOTHING_LEFT


def test_a_tracker_whose_hooks_other_code_took_off_still_cleans_up_all_else():
    """If other code pops the tracker's saved-tensor hooks, leaving it says so, after removing
    everything else it set (its cleanup used to stop at the first failure)."""
    tracker = MemoryTracker()
    tracker.__enter__()
    torch._C._autograd._pop_saved_tensors_default_hooks()
    with pytest.raises(RuntimeError, match="taken off by other code"):
        tracker.__exit__(None, None, None)
    assert hooks_left() == NOTHING_LEFT
