"""Runs the libFuzzer harness of the pool's C API (tests/fuzz/fuzz_pool.c) for a bounded time.

The harness checks every invariant after each operation and that no block is handed to another
stream before the event recorded at its free completed; sanitizers catch memory errors. It needs
clang with libFuzzer; without it the test is skipped. LLMMEM_FUZZ_SECONDS sets the time (30 s).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fuzz_pool_c_api():
    cc = os.environ.get("FUZZ_CC", "clang")
    if shutil.which(cc) is None or shutil.which("make") is None:
        pytest.skip(f"the pool fuzzer needs {cc} with libFuzzer and make")
    seconds = int(os.environ.get("LLMMEM_FUZZ_SECONDS", "30"))
    build = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "build/fuzz/fuzz_pool", f"FUZZ_CC={cc}"], capture_output=True, text=True
    )
    if build.returncode != 0 and "fuzzer" in build.stderr and "unsupported" in build.stderr:
        pytest.skip(f"{cc} has no libFuzzer: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stdout + build.stderr
    proc = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "fuzz-pool", f"FUZZ_SECONDS={seconds}", f"FUZZ_CC={cc}"],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Done" in out and "ERROR" not in out, out[-4000:]
