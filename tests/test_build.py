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
    env = {**os.environ, "LLMMEM_CUDA": "0", "LLMMEM_WERROR": "1"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    built = list((tmp_path / "lib" / "llmmem").glob("_C*.so"))
    assert len(built) == 1
    assert not [s for s in _exported_symbols(str(built[0])) if s.startswith("cuda")]
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('llmmem_cpu_C', {str(built[0])!r})\n"
        "C = importlib.util.module_from_spec(spec); spec.loader.exec_module(C)\n"
        "info = C.build_info()\n"
        "assert info['cuda_built'] is False and info['cuda_archs'] == '', info\n"
        "try:\n"
        "    C.cuda_device_count()\n"
        "except C.NotBuiltError as e:\n"
        "    assert 'without CUDA' in str(e), e\n"
        "    print('ok')\n"
    )
    # PyInit__C is the init symbol whatever the file is called, so load it under another name.
    run = subprocess.run([sys.executable, "-c", code.replace("llmmem_cpu_C", "_C")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.slow
def test_changing_a_build_option_rebuilds_instead_of_reusing_stale_objects(tmp_path):
    # `LLMMEM_CUDA=0 pip install .` after a CUDA build (pip builds in the checkout's build/) must
    # give a CPU-only module: setuptools alone only compares file times, not compile options.
    dirs = ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    for level in ("0", "2"):
        env = {**os.environ, "LLMMEM_CUDA": "0", "LLMMEM_DEBUG": level}
        build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", *dirs], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
        assert build.returncode == 0, build.stdout + build.stderr
    built = next((tmp_path / "lib" / "llmmem").glob("_C*.so"))
    code = ("import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('_C', {str(built)!r})\n"
            "C = importlib.util.module_from_spec(spec); spec.loader.exec_module(C)\n"
            "print(C.build_info()['debug_level'])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "2", run.stdout + run.stderr
