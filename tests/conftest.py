"""Shared pytest set-up: seeded tests, CUDA tests that skip cleanly without a GPU, and this folder
on sys.path so test files import the shared helpers of tests/support/ (``from support.x import
...``). Only this folder: the repository root stays off sys.path, so the tests still import the
installed llmmem."""

from __future__ import annotations

import os
import random
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)

from support.cuda import cuda_usable  # noqa: E402  (needs the line above)
from support.threads import one_torch_thread  # noqa: E402, F401  (a fixture, for usefixtures in any test module)


def pytest_collection_modifyitems(config, items):
    if cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is usable here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same seeds, so a failure reproduces."""
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:
        pass
    yield
