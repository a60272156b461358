"""Loads the C core, ``llmmem._C``, without ever failing at import.

If the extension is missing or broken (a source checkout that was not built, a wheel for another
Python), ``native`` is a stand-in whose attributes raise :class:`ImportError` naming the cause and
the fix, so ``import llmmem`` and the pure-Python features (the estimator) keep working.
"""

from __future__ import annotations

_FIX = "reinstall with `pip install .` from the llmmem source tree, then run `python -m llmmem info`"


class _MissingNative:
    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __getattr__(self, name: str):
        raise ImportError(
            f"llmmem: the C core (llmmem._C) could not be loaded, so `{name}` is unavailable: {self._error!r}; {_FIX}"
        ) from self._error

    def __bool__(self) -> bool:
        return False


try:
    from llmmem import _C as native

    load_error: BaseException | None = None
except ImportError as exc:  # never let a broken build break `import llmmem`
    native = _MissingNative(exc)
    load_error = exc


def available() -> bool:
    """True when the C core was loaded."""
    return load_error is None
