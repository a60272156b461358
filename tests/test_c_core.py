"""Builds the C unit tests (tests/c/test_*.c) under AddressSanitizer + UBSan and runs each one
(the plain C ones a second time built with clang, where it is installed, and the vector loops'
ones at -O3).

Each C test program ends with the line "N passed, N failed"; a program passes when it exits 0,
reports no failure, and its sanitizers stay silent.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
C_TESTS = sorted(p.stem for p in (ROOT / "tests" / "c").glob("test_*.c"))
# C++ harnesses of CUDA code run without a GPU (a simulated driver); they need the CUDA headers,
# found where the Makefile looks (CUDA_INC, else $CUDA_HOME/include, else /usr/local/cuda/include).
_CUDA_INC = pathlib.Path(
    os.environ.get("CUDA_INC") or os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "include")
)
if (_CUDA_INC / "cuda.h").exists():
    C_TESTS += sorted(p.stem for p in (ROOT / "tests" / "c").glob("test_*.cc"))
# The plain C tests again, built with clang where it is on PATH (the Makefile looks the same way):
# its UBSan checks more than gcc's.
if shutil.which("clang"):
    C_TESTS += sorted(
        "clang/" + p.stem for p in (ROOT / "tests" / "c").glob("test_*.c") if not p.stem.endswith("_openmp")
    )
# Tests of vector loops, again built at -O3 (the Makefile's CTEST_O3): only there is the code vectorised.
C_TESTS += ["O3/test_optim", "O3/test_head"]


@pytest.fixture(scope="module")
def built():
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.fail("building the C tests needs `make` and a C compiler (cc)")
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    proc = subprocess.run(["make", "-s", "-j", jobs, "-C", str(ROOT), "c-tests"], capture_output=True, text=True)
    assert proc.returncode == 0, f"building the C tests failed:\n{proc.stdout}\n{proc.stderr}"
    return ROOT / "build" / "ctests"


@pytest.mark.parametrize("name", C_TESTS)
def test_c_program(built, name):
    proc = subprocess.run([str(built / name)], capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    print(out)
    closing = re.findall(r"^(\d+) passed, (\d+) failed$", proc.stdout, re.MULTILINE)
    assert closing, f"{name} printed no closing 'N passed, N failed' line:\n{out}"
    passed, failed = map(int, closing[-1])
    assert proc.returncode == 0 and failed == 0, f"{name}: exit {proc.returncode}, {failed} failed:\n{out}"
    assert passed > 0
    assert "runtime error" not in out and "AddressSanitizer" not in out, out
