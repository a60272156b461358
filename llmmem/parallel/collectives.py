"""The three collectives the tensor-parallel layers need, routed to the fastest working engine.

``all_reduce_`` (sum, in place), ``all_gather`` and ``reduce_scatter`` (along any dimension) go to:

- llmmem's shared-memory collectives (``csrc/parallel/shm_*.c``) for CPU tensors when every rank of
  the group is on this host and the message is at most ``cpu_shm_max_bytes``;
- llmmem's CUDA IPC all-reduce (``csrc/parallel/cuda_allreduce.cu``) for small CUDA all-reduces when
  every rank is on this node and peer buffers could be opened (``cuda_ipc_max_bytes``). **Opt-in**
  (``LLMMEM_TP_CUDA_IPC=1``): it has not yet been validated on GPUs, so by default CUDA tensors go
  to NCCL;
- torch.distributed (NCCL / gloo) otherwise. That path always works and is the fallback: if our
  engine cannot be set up (no /dev/shm, ranks on several hosts, IPC refused) a warning is issued
  once per group and torch.distributed is used from then on.

Every rank must take the same route for the same call, so the choice depends only on things that
are equal across ranks (size, dtype, device, thresholds, and the outcome of a collective set-up).
Keep the ``LLMMEM_TP_*`` environment variables equal on all ranks; they are read when this module
is imported.

Thresholds (bytes of the message one rank contributes) can be set with
:func:`set_collective_thresholds` or the environment variables ``LLMMEM_TP_SHM_MAX_BYTES`` and
``LLMMEM_TP_CUDA_IPC_MAX_BYTES``; ``LLMMEM_TP_SHM=0`` turns the shared-memory engine off and
``LLMMEM_TP_CUDA_IPC=1`` turns the CUDA IPC engine on.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)

# Defaults from benchmarks/bench_parallel_comm.py: on CPU our shared-memory path beat gloo at every size we
# measured (4 KiB .. 64 MiB), so it is used for everything; on CUDA the one-shot kernel is meant for
# latency-bound messages, NCCL's bandwidth-optimal rings win above a few hundred KiB.
_DEFAULT_SHM_MAX = 1 << 62
_DEFAULT_CUDA_IPC_MAX = 512 * 1024


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"llmmem: environment variable {name} must be an integer number of bytes, got {raw!r}"
        ) from None
    if value < 0:
        raise ValueError(f"llmmem: environment variable {name} must be >= 0, got {value}")
    return value


def _env_on(name: str, default: bool = True) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.lower() not in ("0", "false", "no", "off")


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"llmmem: environment variable {name} must be a positive number of seconds, got {raw!r}")
    return value


_thresholds = {
    "cpu_shm_max_bytes": _env_int("LLMMEM_TP_SHM_MAX_BYTES", _DEFAULT_SHM_MAX),
    "cuda_ipc_max_bytes": _env_int("LLMMEM_TP_CUDA_IPC_MAX_BYTES", _DEFAULT_CUDA_IPC_MAX),
}
_timeout_s = _env_seconds("LLMMEM_TP_TIMEOUT", 300.0)
# Read once, like the thresholds: the routing runs on every collective of every layer, and an
# environment lookup costs microseconds there (as much as a 64 KiB shared-memory all-reduce).
# The CUDA IPC engine is opt-in (LLMMEM_TP_CUDA_IPC=1) until it has run on GPUs: its kernels compile
# and its logic is reviewed, but neither its correctness on hardware nor the size below which it beats
# NCCL has been measured, and an unmeasured threshold is a guess. NCCL serves CUDA tensors meanwhile.
_engines_on = {"shm": _env_on("LLMMEM_TP_SHM"), "cuda_ipc": _env_on("LLMMEM_TP_CUDA_IPC", default=False)}

# group -> engine object, or None when set-up failed (then torch.distributed is used).
_shm_comms: dict = {}
_cuda_comms: dict = {}
# group -> its size (a group's size never changes; dist.get_world_size costs ~2 us per call).
_group_sizes: dict = {}


def _size_of(group) -> int:
    key = group if group is not None else dist.group.WORLD
    size = _group_sizes.get(key)
    if size is None:
        size = _group_sizes[key] = dist.get_world_size(key)
    return size


def set_collective_thresholds(*, cpu_shm_max_bytes: int | None = None, cuda_ipc_max_bytes: int | None = None) -> dict:
    """Override the largest message (bytes per rank) sent through llmmem's own engines.

    ``0`` sends everything to torch.distributed. Must be called with the same values on every rank.
    Returns the thresholds now in force.
    """
    for name, value in (("cpu_shm_max_bytes", cpu_shm_max_bytes), ("cuda_ipc_max_bytes", cuda_ipc_max_bytes)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"set_collective_thresholds: {name} must be an int >= 0, got {value!r}")
        _thresholds[name] = value
    return dict(_thresholds)


def get_collective_thresholds() -> dict:
    return dict(_thresholds)


def set_timeout(seconds: float) -> None:
    """Seconds llmmem's own collectives wait for a peer before raising (default 300, env LLMMEM_TP_TIMEOUT).

    Applies to engines set up after the call and to those already set up.
    """
    global _timeout_s
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
        raise ValueError(f"set_timeout: seconds must be a positive number, got {seconds!r}")
    _timeout_s = float(seconds)
    for comm in list(_shm_comms.values()) + list(_cuda_comms.values()):
        if comm is not None:
            comm.set_timeout(_timeout_s)


def close_all() -> None:
    """Release every engine (shared segments, IPC mappings). Later calls set them up again."""
    for table in (_shm_comms, _cuda_comms):
        for comm in table.values():
            if comm is not None:
                comm.close()
        table.clear()
    _group_sizes.clear()


def _warn_fallback(what: str, exc: BaseException) -> None:
    warnings.warn(
        f"llmmem.parallel: {what} unavailable, using torch.distributed instead: {exc}", RuntimeWarning, stacklevel=4
    )


def _shm_for(dtype: torch.dtype, nbytes: int, group):
    """The shared-memory engine for a CPU tensor of this dtype and size, or None to use
    torch.distributed. Takes what the caller already read off the tensor (see all_reduce_)."""
    if dtype not in _SUPPORTED or nbytes > _thresholds["cpu_shm_max_bytes"] or not _engines_on["shm"]:
        return None
    key = group if group is not None else dist.group.WORLD
    if key not in _shm_comms:
        from llmmem.parallel import shm

        try:
            _shm_comms[key] = shm.ShmCommunicator.setup(key, timeout=_timeout_s)
        except shm.SetupError as exc:
            _warn_fallback("shared-memory collectives", exc)
            _shm_comms[key] = None
    return _shm_comms[key]


def _cuda_for(tensor: torch.Tensor, group):
    """The CUDA IPC all-reduce engine for this call, or None to use torch.distributed."""
    # (the engine is opt-in: when it is off, that is the first and only test)
    if not _engines_on["cuda_ipc"] or not tensor.is_cuda or tensor.dtype not in _SUPPORTED:
        return None
    nbytes = tensor.nbytes
    if nbytes > _thresholds["cuda_ipc_max_bytes"]:
        return None
    if torch.cuda.is_current_stream_capturing():
        return None  # the IPC kernel's epochs are host-side: a replayed graph would reuse a stale one
    key = group if group is not None else dist.group.WORLD
    if key not in _cuda_comms:
        from llmmem.parallel import cuda_ipc

        try:
            _cuda_comms[key] = cuda_ipc.CudaIpcCommunicator.setup(
                key, tensor.device, timeout=_timeout_s, max_bytes=_thresholds["cuda_ipc_max_bytes"]
            )
        except cuda_ipc.SetupError as exc:
            _warn_fallback("CUDA IPC all-reduce", exc)
            _cuda_comms[key] = None
    comm = _cuda_comms[key]
    if comm is not None and nbytes > comm.max_bytes:
        return None
    return comm


def all_reduce_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place; returns it."""
    if _size_of(group) == 1:
        return tensor
    if tensor.is_contiguous():
        # Each tensor accessor is read once, and the engine is not asked to check again: checking
        # twice costs microseconds on every collective of every layer.
        if tensor.is_cpu:
            dtype = tensor.dtype
            comm = _shm_for(dtype, tensor.nbytes, group)
            if comm is not None:
                comm.all_reduce_checked_(tensor, dtype)
                return tensor
        else:
            comm = _cuda_for(tensor, group)
            if comm is not None:
                comm.all_reduce_(tensor)
                return tensor
    dist.all_reduce(tensor, group=group)
    return tensor


def _check_dim(tensor: torch.Tensor, dim: int) -> int:
    if tensor.dim() == 0:
        raise ValueError("llmmem.parallel: a 0-dim tensor has no dimension to gather or scatter along")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"llmmem.parallel: dim {dim} is out of range for a tensor of {tensor.dim()} dimensions")
    return dim % tensor.dim()


def all_gather(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``tensor`` (all the same shape), in rank order."""
    w = _size_of(group)
    if w == 1:
        return tensor
    dim = _check_dim(tensor, dim)
    tensor = tensor.detach()  # data movement, not an autograd op (llmmem.parallel.mappings is)
    tensor = tensor.contiguous()
    stacked = torch.empty((w * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    comm = _shm_for(tensor.dtype, tensor.nbytes, group) if tensor.is_cpu else None
    if comm is not None:
        comm.all_gather_into(stacked, tensor)
    else:
        dist.all_gather_into_tensor(stacked, tensor, group=group)
    if dim == 0:
        return stacked
    # rank-major blocks of dim 0 -> concatenation along `dim`
    return torch.cat(stacked.chunk(w, dim=0), dim=dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's block (``dim`` split evenly, in rank order) of the sum over the group."""
    w = _size_of(group)
    if w == 1:
        return tensor
    dim = _check_dim(tensor, dim)
    tensor = tensor.detach()  # data movement, not an autograd op (llmmem.parallel.mappings is)
    if tensor.shape[dim] % w != 0:
        raise ValueError(
            f"reduce_scatter: dimension {dim} of size {tensor.shape[dim]} is not divisible by the group size {w}"
        )
    if dim == 0:
        src = tensor.contiguous()
    else:
        src = torch.cat([c.contiguous() for c in tensor.chunk(w, dim=dim)], dim=0)
    rows = src.shape[0] // w
    out = torch.empty((rows,) + tuple(src.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    comm = _shm_for(out.dtype, out.nbytes, group) if out.is_cpu else None
    if comm is not None:
        comm.reduce_scatter_into(out, src)
    else:
        dist.reduce_scatter_tensor(out, src, group=group)
    # src stacks the chunks along dim 0, each chunk keeping its shape, so `out` is already this
    # rank's chunk of `tensor` along `dim`.
    return out
