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
