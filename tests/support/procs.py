"""Running Python code in a fresh interpreter, for tests that may crash, hang or must start clean."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap


def run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` (dedented) with ``python -c`` and returns the finished process (text output).

    It runs outside the checkout: ``-c`` puts the working directory first on sys.path, and the
    child must import the llmmem the tests import (installed, or found through PYTHONPATH), not a
    source folder that may hold no built core. ``env`` adds to this process's environment.
    """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=tempfile.gettempdir(),
    )


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent, process group, start time in clock ticks) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, start time)`` of every living descendant of ``pid`` (a /proc scan, Linux). The start
    time tells a process from a later one given the same id."""
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] != "Z":
                children.setdefault(st[1], []).append((int(name), st[3]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def still_running(procs: list[tuple[int, int]]) -> list[int]:
    """The ids of ``procs`` (from :func:`descendants`) still running: neither gone nor zombies."""
    out = []
    for pid, start in procs:
        st = _stat(pid)
        if st is not None and st[3] == start and st[0] != "Z":
            out.append(pid)
    return out
