"""`python -m llmmem info`: truthful about the build and the machine it runs on."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import torch

from llmmem import _native
from llmmem.__main__ import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    # `python -m` puts the working directory first on sys.path: run outside the checkout so the
    # installed llmmem (with its built core) is the one found, as it is for a user.
    return subprocess.run(
        [sys.executable, "-m", "llmmem", *args], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir()
    )


def test_info_reports_build_and_runtime_truthfully():
    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    build = _native.native.build_info()
    assert f"llmmem {_native.native.version()}" in out
    assert f"torch          {torch.__version__}" in out
    if build["cuda_built"]:
        assert build["cuda_archs"] in out
    else:
        assert "CPU-only build" in out
    assert f"torch CUDA     {'yes' if torch.cuda.is_available() else 'no'}" in out
    nccl = torch.distributed.is_nccl_available()
    gloo = torch.distributed.is_gloo_available()
    assert f"NCCL {'yes' if nccl else 'no'}, gloo {'yes' if gloo else 'no'}" in out
    if not torch.cuda.is_available():
        assert "[ ] CUDA kernels" in out
    assert "[x] memory estimator" in out
    assert "CPU unscale    " in out


def test_info_json_is_parseable_and_matches():
    proc = _cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["native"]["loaded"] is True
    assert data["torch"]["version"] == torch.__version__
    assert data["torch"]["cuda_available"] == torch.cuda.is_available()
    # the threaded CPU unscale runs on the OpenMP team wherever one is loaded where llmmem finds it
    # (GOMP_parallel among the process's global symbols) with 2 threads or more (what torch set up
    # in that process: recorded there)
    import ctypes

    team = hasattr(ctypes.CDLL(None), "GOMP_parallel") and data["torch"]["num_threads"] >= 2
    assert data["native"]["scaler_cpu_workers"] == ("openmp" if team else "own")
    names = [f["name"] for f in data["features"]]
    assert "memory estimator" in names and "GradScaler" in names


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out
