"""SIGTERM and SIGINT in ``python -m llmmem compare``'s orchestrator: either one becomes
:class:`Interrupted` in the main thread, once, so that the run unwinds through its clean-up (worker
process groups ended, the temporary folder removed) and keeps the rows it has written.

``timeout``, CI runners and ``docker stop`` send SIGTERM, whose default action ends the process at
once and runs no clean-up; Ctrl-C sends SIGINT. Signals after the first are ignored: the clean-up
is bounded (a few seconds), and a second Ctrl-C must not abandon it half-way. No torch here.
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["Interrupted", "Interrupts"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """The run was interrupted by ``signum`` (SIGTERM or SIGINT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class Interrupts:
    """Installs the handlers (in the main thread only; elsewhere it does nothing) and says whether a
    signal came. :meth:`held` delays the exception over a few lines that must not be cut (a process
    started but not yet recorded, a results file half written)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._held = 0
        self._raised = False
        self._previous: dict = {}

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    def _handler(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if self._held or self._raised:
            return
        self._raised = True
        raise Interrupted(signum)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = {s: signal.signal(s, self._handler) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    @contextlib.contextmanager
    def held(self):
        """The body runs to its end; a signal that came meanwhile is raised after it (main thread).
        Other threads are never interrupted by a signal, so for them this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self.signum is not None and not self._raised:
            self._raised = True
            raise Interrupted(self.signum)
