"""The exception classes of llmmem.

They are created by the C core so that its status codes map to them directly; without the core
(a broken build) equivalent pure-Python classes stand in, so user code can always catch them.
Each is a :class:`LlmmemError` (a ``RuntimeError``) and, where it fits, also the builtin a user
would catch: ``InvalidArgumentError`` and ``InfeasibleError`` are ``ValueError``,
``OutOfMemoryError`` is a ``MemoryError``, ``NotBuiltError`` is a ``NotImplementedError``.

Made with several arguments, as tooling that rebuilds exceptions does (``type(exc)(message,
detail)``), one reads as the message and then the rest in parentheses (:func:`arguments_text`), not
as the repr of a tuple.
"""

from __future__ import annotations

import os
import sys

from llmmem._native import available, native

__all__ = [
    "LlmmemError",
    "InvalidArgumentError",
    "OutOfMemoryError",
    "CudaError",
    "NoDeviceError",
    "NotBuiltError",
    "InfeasibleError",
    "StateError",
    "InternalError",
    "user_frame",
    "user_stacklevel",
    "arguments_text",
]


def arguments_text(exc: BaseException) -> str:
    """``str`` of an exception made with any arguments: the first, then the others in parentheses
    (``OutOfMemoryError("out of memory", 4096)`` reads ``out of memory (4096)``); with none or one,
    what Python prints."""
    args = exc.args
    if len(args) < 2:
        return BaseException.__str__(exc)
    return f"{args[0]} ({', '.join(str(a) for a in args[1:])})"


if available():
    LlmmemError = native.LlmmemError
    InvalidArgumentError = native.InvalidArgumentError
    OutOfMemoryError = native.OutOfMemoryError
    CudaError = native.CudaError
    NoDeviceError = native.NoDeviceError
    NotBuiltError = native.NotBuiltError
    InfeasibleError = native.InfeasibleError
    StateError = native.StateError
    InternalError = native.InternalError
    LlmmemError.__str__ = arguments_text  # the C core makes the classes; their text is set here, for both
else:

    class LlmmemError(RuntimeError):
        """Base class of the errors raised by llmmem's C core."""

        __str__ = arguments_text

    class InvalidArgumentError(LlmmemError, ValueError):
        """An argument is out of range or inconsistent."""

    class OutOfMemoryError(LlmmemError, MemoryError):
        """Host or device memory could not be obtained."""

    class CudaError(LlmmemError):
        """A CUDA runtime call failed."""

    class NoDeviceError(LlmmemError):
        """No CUDA driver or GPU is available."""

    class NotBuiltError(LlmmemError, NotImplementedError):
        """The capability was not compiled into this build of llmmem."""

    class InfeasibleError(LlmmemError, ValueError):
        """The request cannot be met."""

    class StateError(LlmmemError):
        """A call was made in the wrong order or on a closed object."""

    class InternalError(LlmmemError):
        """A broken invariant inside llmmem; please report it."""


def user_frame():
    """The first frame outside llmmem and torch above this function's caller (``None`` on a
    thread with no such frame, e.g. autograd's device threads): where a warning about the user's
    code should point."""
    return _outside(sys._getframe(2))[0]


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that points at the
    first frame outside llmmem and torch: the user's line, or the library (a model's own loop) that
    called a module llmmem wraps, whichever public entry point led there."""
    return 2 + _outside(sys._getframe(2))[1]  # from the caller of the function that warns


def _outside(frame) -> tuple:
    """``(the first frame from frame outward outside llmmem and torch, frames skipped to it)``."""
    inside = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    torch = sys.modules.get("torch")  # only when loaded: importing llmmem never imports torch
    if torch is not None and getattr(torch, "__file__", None):
        inside.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    skipped = 0
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(tuple(inside)):
        frame, skipped = frame.f_back, skipped + 1
    return frame, skipped
