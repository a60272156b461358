"""Signals that arrive while a tensor counter updates its books take effect right after.

Python runs a signal's handler on the main thread between two bytecodes, so the ``KeyboardInterrupt``
of Ctrl-C can land anywhere. Inside :class:`~llmmem.diagnostics.live.LiveBytes` or the tracker,
between two updates that belong together, it would leave counts that no longer add up (a storage
freed but still counted); inside a weak reference's callback Python prints it ("Exception
ignored") and drops it. So the counters' callbacks run no Python code at all, and their
bookkeeping runs under a :class:`Guard`: while a guard is held on the main thread, the Python
signal handlers wrapped by :func:`defer_signals` only note the signal, and the exit of the
outermost guard calls them, so the exception (``KeyboardInterrupt``) is raised there, with the books
complete. Guards on other threads defer nothing: Python handles signals on the main thread only.

While a counter entered on the main thread is open, ``signal.getsignal`` returns the wrapper of
each Python-level handler (``__wrapped__`` is the original); a handler installed meanwhile is not
deferred. Each guard costs two Python calls.
"""

from __future__ import annotations

import functools
import signal
import threading

__all__ = ["Guard", "defer_signals", "restore_signals"]


class _Depth(threading.local):
    depth = 0  # guards held by this thread, nested


_here = _Depth()
_pending: list = []  # (handler, signal number, frame) noted while the main thread held a guard
_wrapped: dict = {}  # signal number -> (original handler, wrapper)
_users = 0  # counters open on the main thread: the first wraps, the last restores
_setup = threading.Lock()


def _deferring(handler):
    @functools.wraps(handler)
    def deferred(signum, frame):
        if _here.depth:
            _pending.append((handler, signum, frame))
            return None
        return handler(signum, frame)

    return deferred


def _deliver() -> None:
    while _pending:
        handler, signum, frame = _pending.pop(0)
        handler(signum, frame)  # raises (KeyboardInterrupt): what is left waits for the next exit


class Guard:
    """A re-entrant lock whose holder, on the main thread, sees signals only when it lets go.

    Acquired in ``__enter__`` after the deferral starts, released before it ends, so a signal can
    interrupt neither half-way (a lock held forever) nor inside. ``on_enter``, if given, is called
    once the lock is held (the counter's queued frees); if it raises, the guard is let go."""

    __slots__ = ("_lock", "_on_enter")

    def __init__(self, on_enter=None) -> None:
        self._lock = threading.RLock()
        self._on_enter = on_enter

    def __enter__(self):
        _here.depth += 1  # from here on, a wrapped handler only takes note
        self._lock.acquire()
        if self._on_enter is not None:
            try:
                self._on_enter()
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc) -> bool:
        self._lock.release()
        here = _here
        here.depth -= 1
        if _pending and not here.depth:
            _deliver()
        return False


def defer_signals() -> None:
    """Called as a counter is entered: on the main thread, the first open counter wraps every
    Python-level signal handler so that a guard defers it. Elsewhere it does nothing."""
    global _users
    if threading.current_thread() is not threading.main_thread():
        return
    with _setup:
        _users += 1
        if _users > 1:
            return
        for signum in signal.valid_signals():
            try:
                handler = signal.getsignal(signum)
            except (OSError, ValueError):
                continue
            if callable(handler):  # not SIG_DFL, SIG_IGN or a handler set from C (None)
                wrapper = _deferring(handler)
                signal.signal(signum, wrapper)
                _wrapped[signum] = (handler, wrapper)


def restore_signals() -> None:
    """Called as a counter is left (on the thread it was entered on): the last counter open on the
    main thread puts the original handlers back (not over one set since) and delivers any signal
    still noted."""
    global _users
    if threading.current_thread() is not threading.main_thread():
        return
    with _setup:
        _users -= 1
        if _users > 0:
            return
        for signum, (handler, wrapper) in list(_wrapped.items()):
            if signal.getsignal(signum) is wrapper:
                signal.signal(signum, handler)
        _wrapped.clear()
    if not _here.depth:
        _deliver()
