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

Other code's weak-reference callbacks run Python too: the ``remove`` of every ``WeakValueDictionary``,
``WeakKeyDictionary`` and ``WeakSet`` (torch's and the standard library's), ``weakref.finalize``.
A signal that lands in one of them is not run there: a helper thread has it run again once the
callback has returned (18% of the interrupts sent to a loop that fills and empties a
``WeakValueDictionary`` were lost without this). The same holds inside a backward pass run by
autograd's engine (the counters' mode and hooks run Python there, which untracked CPU backward does
not): a ``KeyboardInterrupt`` that ended it midway would leave the nodes not yet run, with their saved
tensors and incoming gradients, in the engine's queue for the calling thread until its next backward
(torch does not empty that queue when a backward raises); the signal takes effect once the backward
has returned, as it does without a counter.

While a counter entered on the main thread is open, ``signal.getsignal`` returns the wrapper of
each Python-level handler (``__wrapped__`` is the original); a handler installed meanwhile is not
deferred. Each guard costs two Python calls.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
import weakref

__all__ = ["Guard", "defer_signals", "restore_signals"]


class _Depth(threading.local):
    depth = 0  # guards held by this thread, nested


_here = _Depth()
_pending: list = []  # (handler, signal number, frame) noted while the main thread held a guard
_wrapped: dict = {}  # signal number -> (original handler, wrapper)
_users = 0  # counters open on the main thread: the first wraps, the last restores
_setup = threading.Lock()


def _callback_codes() -> frozenset:
    """The code of the weak-reference callbacks that run Python: the standard containers' (each
    instance makes a closure, all of one code) and torch's, if it is imported."""
    codes = {
        weakref.WeakValueDictionary()._remove.__code__,
        weakref.WeakKeyDictionary()._remove.__code__,
        weakref.WeakSet()._remove.__code__,
        weakref.finalize.__call__.__code__,  # the finalizer's function runs inside it
    }
    weak = sys.modules.get("torch.utils.weak")
    if weak is not None:
        codes.add(weak.WeakIdKeyDictionary()._remove.__code__)
    graph = sys.modules.get("torch.autograd.graph")  # backward() and grad() call the engine through it
    run_backward = getattr(graph, "_engine_run_backward", None)
    if run_backward is not None:
        codes.add(run_backward.__code__)
    return frozenset(codes)


_callbacks: frozenset = frozenset()  # set by defer_signals, read by the handlers


def _in_callback(frame, depth: int = 64) -> bool:
    while frame is not None and depth:
        if frame.f_code in _callbacks:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


class _Again:
    """A thread that has the interpreter run a signal's handler again once the main thread has left
    the weak-reference callback or backward pass the signal landed in (it looks at the main
    thread's frames between short sleeps). Re-arming from the handler itself would run it again at once, inside the
    handler, without end; so would re-arming as soon as this thread runs. The main thread only
    writes a byte to a pipe: no Python lock is taken where the signal landed."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="llmmem-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import _thread

        while True:
            data = os.read(self._read, 64)
            if not data:  # the write end was closed
                os.close(self._read)
                return
            for signum in data:
                self._wait_for_callbacks()
                try:
                    _thread.interrupt_main(signum)
                except TypeError:  # Python 3.9: interrupt_main takes no signal number
                    signal.pthread_kill(self._main, signum)

    def _wait_for_callbacks(self) -> None:
        frames = getattr(sys, "_current_frames", None)  # CPython's; elsewhere, a moment's wait
        if frames is None:
            time.sleep(0.001)
            return
        while _in_callback(frames().get(self._main)):
            time.sleep(0.0002)  # lets the main thread run

    def send(self, signum: int) -> None:
        os.write(self._write, bytes((signum,)))

    def close(self) -> None:
        os.close(self._write)


_again = None  # an _Again while a counter is open on the main thread
# Without a signal number to hand to interrupt_main (Python 3.9) or pthread_kill (Windows), a signal
# cannot be run again later: it is run where it lands, as before.
_CAN_AGAIN = sys.version_info >= (3, 10) or hasattr(signal, "pthread_kill")


def _forget_in_child() -> None:
    """A child forked while a counter is open has no helper thread, and its copy of the pipe's write
    end would keep the parent's thread from seeing the pipe closed."""
    global _again
    again, _again = _again, None
    if again is not None:
        for fd in (again._read, again._write):
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _put_off(signum: int, frame) -> bool:
    """Hands the signal to the helper thread if it landed in a callback or a backward pass."""
    again = _again
    if again is None or not _in_callback(frame):
        return False
    again.send(signum)
    return True


def _deferring(handler):
    @functools.wraps(handler)
    def deferred(signum, frame):
        if _here.depth:
            _pending.append((handler, signum, frame))
            return None
        if _put_off(signum, frame):
            return None
        return handler(signum, frame)

    return deferred


def _deliver() -> None:
    while _pending:
        handler, signum, frame = _pending.pop(0)
        if _put_off(signum, frame):
            continue  # noted inside a callback or a backward pass: run again once it has returned
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
    global _users, _callbacks, _again
    if threading.current_thread() is not threading.main_thread():
        return
    with _setup:
        _users += 1
        if _users > 1:
            return
        _callbacks = _callback_codes()
        _again = _Again() if _CAN_AGAIN else None
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
    global _users, _again
    if threading.current_thread() is not threading.main_thread():
        return
    with _setup:
        _users -= 1
        if _users > 0:
            return
        again, _again = _again, None
        if again is not None:
            again.close()
        for signum, (handler, wrapper) in list(_wrapped.items()):
            if signal.getsignal(signum) is wrapper:
                signal.signal(signum, handler)
        _wrapped.clear()
    if not _here.depth:
        _deliver()
