"""Runs the libFuzzer harness of the binding's argument parsers (tests/fuzz/fuzz_args.c): a fixed
number of inputs from a fixed seed, so every run tries the same inputs in a few seconds.

The harness checks that what a parser accepts agrees with the value it read and that what it
refuses leaves a message and nothing allocated; sanitizers catch memory errors. It needs clang with
libFuzzer; without it the test is skipped. LLMMEM_FUZZ_ARGS_RUNS sets the number of inputs.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fuzz_binding_argument_parsers():
    cc = os.environ.get("FUZZ_CC", "clang")
    if shutil.which(cc) is None or shutil.which("make") is None:
        pytest.skip(f"the parser fuzzer needs {cc} with libFuzzer and make")
    runs = int(os.environ.get("LLMMEM_FUZZ_ARGS_RUNS", "30000"))
    build = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "build/fuzz/fuzz_args", f"FUZZ_CC={cc}"], capture_output=True, text=True
    )
    if build.returncode != 0 and "fuzzer" in build.stderr and "unsupported" in build.stderr:
        pytest.skip(f"{cc} has no libFuzzer: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stdout + build.stderr
    proc = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "fuzz-args", f"FUZZ_ARGS_RUNS={runs}", "FUZZ_ARGS_SECONDS=", f"FUZZ_CC={cc}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"Done {runs} runs" in out and "ERROR" not in out, out[-4000:]
