"""Entering and leaving a dispatch mode or saved-tensor hooks in any order, on several threads.

torch keeps both on stacks local to a thread and its context managers pop the top: two of them
left out of order swap (the one left keeps running, the one still open stops). :func:`exit_mode`
and :func:`pop_saved_tensors_hooks` remove the given entry wherever it is on the calling thread's
stack and put back what was above it.

torch also records "a dispatch mode is active" in process-wide flags (read by ``torch.compile``)
that each mode saves on entry and restores on exit: modes of different threads left in
interleaved order leave them set for good. :func:`enter_mode` / :func:`exit_mode` count the modes
entered through them in the whole process and put the flags back as they were before the first
one when the last one leaves.
"""

from __future__ import annotations

import threading

import torch
import torch.utils._python_dispatch as _dispatch

__all__ = ["enter_mode", "exit_mode", "push_saved_tensors_hooks", "pop_saved_tensors_hooks"]

# torch's flags, and the per-mode lists in which TorchDispatchMode.__enter__ saves their values
# (the names of the torch releases that have them; each is optional).
_FLAGS = (
    ("_is_in_torch_dispatch_mode", "old_dispatch_mode_flags"),
    ("_is_in_non_infra_torch_dispatch_mode", "old_non_infra_dispatch_mode_flags"),
    (
        "_is_in_any_mode_without_ignore_compile_internals",
        "old_without_ignore_compile_internals_dispatch_mode_flags",
    ),
)
_flags_lock = threading.Lock()
_open = 0  # modes entered with enter_mode and not left, all threads
_before: dict = {}  # flag name -> its value before the first of them


def _read_flags() -> dict:
    return {name: getattr(_dispatch, name) for name, _ in _FLAGS if hasattr(_dispatch, name)}


def _write_flags(values: dict) -> None:
    for name, value in values.items():
        setattr(_dispatch, name, value)
    setter = getattr(_dispatch, "set_is_in_mode_without_ignore_compile_internals", None)
    key = "_is_in_any_mode_without_ignore_compile_internals"
    if setter is not None and key in values:
        setter(values[key])


def enter_mode(mode) -> None:
    """``mode.__enter__`` as torch does it, counted (see the module docstring)."""
    global _open
    with _flags_lock:
        if _open == 0:
            _before.clear()
            _before.update(_read_flags())
        _open += 1
    try:
        torch.utils._python_dispatch.TorchDispatchMode.__enter__(mode)
    except BaseException:
        with _flags_lock:
            _open -= 1
        raise


def exit_mode(mode) -> None:
    """Removes ``mode`` (entered with :func:`enter_mode` on this thread) from this thread's
    dispatch-mode stack, wherever it is, and sets torch's flags as if every mode had been left in
    order. Raises ``RuntimeError`` (changing nothing) when ``mode`` is not on this thread's stack."""
    global _open
    stack = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    if not any(m is mode for m in stack):
        raise RuntimeError(
            f"{type(mode).__name__}: not active on this thread (a dispatch mode lives on the thread it was entered on)"
        )
    above = []
    while True:
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_dispatch_stack(other)
    for _, saved in _FLAGS:
        values = getattr(mode, saved, None)
        if values:
            values.pop()
    with _flags_lock:
        _open -= 1
        # With another counted mode open anywhere a mode is active; with none, the flags go back to
        # what they were before the first.
        after = _before if _open == 0 else dict.fromkeys(_read_flags(), True)
        if above:  # still active above: the one just above restores these when it leaves
            nearest = above[-1]
            for name, saved in _FLAGS:
                values = getattr(nearest, saved, None)
                if values and name in after:
                    values[-1] = after[name]
        else:
            _write_flags(after)


def push_saved_tensors_hooks(pack, unpack) -> None:
    """``saved_tensors_hooks(pack, unpack).__enter__()``; leave with :func:`pop_saved_tensors_hooks`."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks(pack) -> None:
    """Removes the saved-tensor hooks whose pack hook is ``pack`` from this thread's stack, wherever
    they are; the hooks above stay, in order. Raises ``RuntimeError`` (changing nothing) when they
    are not on this thread's stack."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    pop, push = (
        torch._C._autograd._pop_saved_tensors_default_hooks,
        torch._C._autograd._push_saved_tensors_default_hooks,
    )
    if top is None:  # a torch that cannot show its stack: only the top can be taken off
        pop()
        return
    above = []
    try:
        while True:
            pair = top(True)
            if pair is None:
                raise RuntimeError(
                    "saved-tensor hooks: not active on this thread (they live on the thread that set them)"
                )
            pop()
            if pair[0] is pack:
                return
            above.append(pair)
    finally:
        for hooks in reversed(above):
            push(*hooks)
