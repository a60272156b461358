"""The exception classes of llmmem.

They are created by the C core so that its status codes map to them directly; without the core
(a broken build) equivalent pure-Python classes stand in, so user code can always catch them.
Each is a :class:`LlmmemError` (a ``RuntimeError``) and, where it fits, also the builtin a user
would catch: ``InvalidArgumentError`` and ``InfeasibleError`` are ``ValueError``,
``OutOfMemoryError`` is a ``MemoryError``, ``NotBuiltError`` is a ``NotImplementedError``.
"""

from __future__ import annotations

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
]

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
else:

    class LlmmemError(RuntimeError):
        """Base class of the errors raised by llmmem's C core."""

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
