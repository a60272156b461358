"""The C binding of the collectives and the routing knobs, in-process (no ranks spawned)."""

from __future__ import annotations

import os

import pytest
import torch
from support.parallel import shm_name

from llmmem._native import native


def test_shm_world_of_one_is_identity_and_leaves_nothing():
    name = shm_name()
    comm = native.shm_comm_open(name, 0, 1, 0, 1.0)
    try:
        assert not os.path.exists(f"/dev/shm/{name}")  # removed as soon as every rank joined
        assert native.shm_comm_slot_bytes(comm) == 1 << 20
        for dtype, code in ((torch.float32, 0), (torch.float16, 1), (torch.bfloat16, 2)):
            x = torch.randn(3000).to(dtype)
            out = torch.empty_like(x)
            native.shm_all_reduce(comm, x.data_ptr(), out.data_ptr(), x.numel(), code)
            assert torch.equal(out, x)
            native.shm_all_gather(comm, x.data_ptr(), out.data_ptr(), x.numel(), code)
            assert torch.equal(out, x)
            native.shm_reduce_scatter(comm, x.data_ptr(), out.data_ptr(), x.numel(), code)
            assert torch.equal(out, x)
    finally:
        native.shm_comm_close(comm)
    native.shm_comm_close(comm)  # idempotent
    with pytest.raises(ValueError, match="closed"):
        native.shm_all_reduce(comm, 0, 0, 0, 0)


def test_shm_bad_arguments_raise_value_errors():
    from llmmem.errors import InvalidArgumentError, StateError

    with pytest.raises(InvalidArgumentError, match="rank must be in 0..1"):
        native.shm_comm_open(shm_name(), 2, 2, 0, 1.0)
    with pytest.raises(InvalidArgumentError, match="no '/'"):
        native.shm_comm_open("a/b", 0, 1, 0, 1.0)
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        native.shm_comm_open(shm_name(), 0, 1, 0, 0.0)
    with pytest.raises(StateError, match="did not appear"):
        native.shm_comm_open(shm_name(), 1, 2, 0, 0.05)  # rank 0 never creates it
    comm = native.shm_comm_open(shm_name(), 0, 1, 0, 1.0)
    try:
        with pytest.raises(InvalidArgumentError, match="unknown dtype"):
            native.shm_all_reduce(comm, 1, 1, 1, 7)
        with pytest.raises(InvalidArgumentError, match="must not be NULL"):
            native.shm_all_reduce(comm, 0, 0, 4, 0)
        with pytest.raises(TypeError):
            native.shm_all_reduce(comm, "x", 0, 4, 0)
    finally:
        native.shm_comm_close(comm)


def test_cuda_ar_without_gpu_reports_cleanly():
    from llmmem.errors import LlmmemError

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; tests/test_parallel_cuda.py covers the engine")
    with pytest.raises(LlmmemError) as info:
        native.cuda_ar_create(0, 0, 2, 4096, 1.0)
    assert "cuda" in str(info.value).lower() or "built without" in str(info.value)


def test_thresholds_and_timeout_validation():
    from llmmem.parallel import collectives

    before = collectives.get_collective_thresholds()
    try:
        got = collectives.set_collective_thresholds(cpu_shm_max_bytes=4096)
        assert got["cpu_shm_max_bytes"] == 4096 and got["cuda_ipc_max_bytes"] == before["cuda_ipc_max_bytes"]
        with pytest.raises(ValueError, match="cpu_shm_max_bytes"):
            collectives.set_collective_thresholds(cpu_shm_max_bytes=-1)
        with pytest.raises(ValueError, match="cuda_ipc_max_bytes"):
            collectives.set_collective_thresholds(cuda_ipc_max_bytes=1.5)
        with pytest.raises(ValueError, match="seconds"):
            collectives.set_timeout(0)
    finally:
        collectives.set_collective_thresholds(**before)
    os.environ["LLMMEM_TEST_BYTES"] = "12x"
    try:
        with pytest.raises(ValueError, match="LLMMEM_TEST_BYTES"):
            collectives._env_int("LLMMEM_TEST_BYTES", 0)
    finally:
        del os.environ["LLMMEM_TEST_BYTES"]


def test_collective_argument_errors_without_a_group(monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from llmmem.parallel import collectives

    with pytest.raises(ValueError, match="0-dim"):
        collectives._check_dim(torch.tensor(1.0), 0)
    with pytest.raises(ValueError, match="out of range"):
        collectives._check_dim(torch.ones(2, 3), 2)
    assert collectives._check_dim(torch.ones(2, 3), -1) == 1
    # a bad timeout names the variable instead of failing inside float()
    proc = subprocess.run(
        [sys.executable, "-c", "import llmmem.parallel.collectives"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
        env={**os.environ, "LLMMEM_TP_TIMEOUT": "abc"},
    )
    assert proc.returncode != 0 and "LLMMEM_TP_TIMEOUT" in proc.stderr


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("1", True), ("yes", True), ("0", False)])
def test_cuda_ipc_engine_is_opt_in(value, on):
    """The CUDA IPC engine has not run on GPUs yet, so CUDA tensors go to NCCL unless it is asked for;
    the shared-memory engine stays on by default."""
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in ("LLMMEM_TP_CUDA_IPC", "LLMMEM_TP_SHM")}
    if value is not None:
        env["LLMMEM_TP_CUDA_IPC"] = value
    code = "from llmmem.parallel import collectives as c; print(c._engines_on['cuda_ipc'], c._engines_on['shm'])"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir(), env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(on), "True"]
