"""Helpers of the tensor-parallel tests run in the pytest process (not those run by ranks, whose
files are loaded by path without this folder on sys.path)."""

from __future__ import annotations

import uuid


def shm_name() -> str:
    """A shared-memory name no other test (or test run) uses."""
    return f"llmmem-tp-test-{uuid.uuid4().hex}"
