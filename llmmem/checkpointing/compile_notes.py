"""Warnings for checkpoint options that a ``torch.compile``'d model does not carry out as asked.

Traced code cannot warn: a ``warnings.warn`` in a region Dynamo traces breaks the graph
(``fullgraph=True`` refuses it), and Dynamo's reorderable logging functions are dropped when they
are called from an inlined function, as a checkpointed block always is (torch 2.11). So the
warning is given when Dynamo starts a compilation (its start callback) while something that
compiles otherwise is installed: a model planned by ``auto_checkpoint`` whose plan the graph cannot
carry as made, or a region checkpointed with ``offload=True``. Each is named once, by a message
that says what the compiled code does instead, if it runs that model.

Watching imports ``torch._dynamo`` (about 0.9 s), so only the calls that choose such an option
do it, eagerly, before the model is compiled in the documented order (checkpointing, then compile).
"""

from __future__ import annotations

import threading
import warnings
import weakref

__all__ = ["watch"]

_lock = threading.Lock()
_watched: list[tuple[weakref.ref | None, str]] = []  # (the object, or None for the process; message)
_said: set[str] = set()  # the owner-less messages given already


def watch(message: str, owner=None) -> None:
    """Warn ``message`` at the next compilation that starts while ``owner`` lives (without an
    owner: at the next one, once per process and message)."""
    with _lock:
        if owner is None and message in _said:
            return
        if any(m == message and (ref() if ref is not None else None) is owner for ref, m in _watched):
            return
        _watched.append((None if owner is None else weakref.ref(owner), message))
        from torch._dynamo.callback import callback_handler

        # looked for each time: torch._dynamo.reset() clears the callbacks
        if _on_compile_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_compile_start)


def _on_compile_start(_args) -> None:
    with _lock:
        due = [m for ref, m in _watched if ref is None or ref() is not None]
        _said.update(m for ref, m in _watched if ref is None)
        _watched.clear()  # each is said once; a dead owner's is dropped
    for message in dict.fromkeys(due):
        warnings.warn(message, UserWarning, stacklevel=2)
