"""The build contract: a CPU-only build works, and only llmmem's ABI is exported."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from llmmem import _native

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _exported_symbols(path: str) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def _build(tmp_path, **env) -> pathlib.Path:
    """Builds _C into tmp_path (not the checkout) with these environment settings; returns the module."""
    build = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "tmp"),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    built = list((tmp_path / "lib" / "llmmem").glob("_C*.so"))
    assert len(built) == 1
    return built[0]


def _run_with_module(path: pathlib.Path, body: str) -> subprocess.CompletedProcess:
    """Runs body in a fresh interpreter with the module at path loaded as C. It is loaded as '_C'
    because PyInit__C is its init symbol whatever the file is called."""
    code = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('_C', {str(path)!r})\n"
        "C = importlib.util.module_from_spec(spec); spec.loader.exec_module(C)\n" + body
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_only_the_llmmem_abi_is_exported():
    symbols = _exported_symbols(_native.native.__file__)
    foreign = [s for s in symbols if not (s.startswith("llmmem_") or s == "PyInit__C")]
    # The static CUDA runtime and every internal helper must stay private, so nothing clashes with
    # the libcudart that torch loads into the same process.
    assert foreign == [], foreign[:20]
    assert "llmmem_strerror" in symbols and "llmmem_last_error" in symbols


@pytest.mark.slow
def test_cpu_only_build_imports_and_reports_not_built(tmp_path):
    built = _build(tmp_path, LLMMEM_CUDA="0", LLMMEM_WERROR="1")
    assert not [s for s in _exported_symbols(str(built)) if s.startswith("cuda")]
    run = _run_with_module(
        built,
        (
            "info = C.build_info()\n"
            "assert info['cuda_built'] is False and info['cuda_archs'] == '', info\n"
            "try:\n"
            "    C.cuda_device_count()\n"
            "except C.NotBuiltError as e:\n"
            "    assert 'without CUDA' in str(e), e\n"
            "    print('ok')\n"
        ),
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.slow
def test_changing_a_build_option_rebuilds_instead_of_reusing_stale_objects(tmp_path):
    # `LLMMEM_CUDA=0 pip install .` after a CUDA build (pip builds in the checkout's build/) must
    # give a CPU-only module: setuptools alone only compares file times, not compile options.
    for level in ("0", "2"):
        built = _build(tmp_path, LLMMEM_CUDA="0", LLMMEM_DEBUG=level)
    run = _run_with_module(built, "print(C.build_info()['debug_level'])\n")
    assert run.returncode == 0 and run.stdout.strip() == "2", run.stdout + run.stderr
