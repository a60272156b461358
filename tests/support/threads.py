"""Fixtures about torch's intra-op threads (registered for all tests by tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module whose torch ops are tiny: more threads only spin
    against other jobs on shared cores. Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
