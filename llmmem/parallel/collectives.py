"""The three collectives the tensor-parallel layers need, routed to the fastest working engine.

``all_reduce_`` (sum, in place), ``all_reduce`` (the same into a new tensor), ``all_gather`` and
``reduce_scatter`` (along any dimension) go to:

- llmmem's shared-memory collectives (``csrc/parallel/shm_*.c``) for CPU tensors when every rank of
  the group is on this host and the message is at most ``cpu_shm_max_bytes``;
- llmmem's CUDA IPC all-reduce (``csrc/parallel/cuda_allreduce.cu``) for small CUDA all-reduces when
  every rank is on this node and peer buffers could be opened (``cuda_ipc_max_bytes``). **Opt-in**
  (``LLMMEM_TP_CUDA_IPC=1``): it has not yet been validated on GPUs, so by default CUDA tensors go
  to NCCL;
- torch.distributed (NCCL / gloo) otherwise. That path always works and is the fallback: if our
  engine cannot be set up (no /dev/shm, ranks on several hosts, IPC refused) a warning is issued
  once per group and torch.distributed is used from then on.

Every rank must take the same route for the same call, or ranks would wait for each other in two
different places until a timeout. On the CPU the route cannot depend on the layout (a
non-contiguous tensor is copied through the engine), and a rank leaves the engine for
torch.distributed only after every rank has said, through the engine, that it makes the same call
(see ``_agree_on_fallback``); a rank whose dtype or element count differs from the others' makes
every rank raise :class:`llmmem.errors.InvalidArgumentError` with each rank's view, after one
barrier. The set-up of an engine, on a group's first collective, gives up after the engines'
timeout (:func:`set_timeout`) like their collectives do. Keep the ``LLMMEM_TP_*`` environment
variables and thresholds equal on all ranks; they are read when this module is imported.

Engines are cached per group without holding the group: a group destroyed with
``torch.distributed.destroy_process_group`` and dropped closes its engine when it is collected; one
destroyed but still referenced is released at the next engine set-up or by
:func:`release_destroyed_groups`.

Thresholds (bytes of the message one rank contributes) can be set with
:func:`set_collective_thresholds` or the environment variables ``LLMMEM_TP_SHM_MAX_BYTES`` and
``LLMMEM_TP_CUDA_IPC_MAX_BYTES``; ``LLMMEM_TP_SHM=0`` turns the shared-memory engine off and
``LLMMEM_TP_CUDA_IPC=1`` turns the CUDA IPC engine on.
"""

from __future__ import annotations

import os
import re
import warnings
import weakref

import torch
import torch.distributed as dist

from llmmem.errors import InvalidArgumentError, StateError
from llmmem.parallel.exchange import all_gather_json

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

# id(group) -> engine object, or None when set-up failed (then torch.distributed is used).
_shm_comms: dict = {}
_cuda_comms: dict = {}
# id(group) -> its size (a group's size never changes; dist.get_world_size costs ~2 us per call).
_group_sizes: dict = {}
# id(group) -> a finalizer that drops the group's entries and closes its engines when the group is
# garbage-collected. The tables hold no group: a group the user destroyed and dropped goes, with its
# shared segments (an id is not reused before its finalizer has run). A destroyed group still
# referenced somewhere is released by release_destroyed_groups().
_watched: dict = {}
_MISSING = object()


def _watch(group) -> int:
    key = id(group)
    if key not in _watched:
        fin = weakref.finalize(group, _release, key)
        fin.atexit = False  # at exit the process's mappings go anyway
        _watched[key] = fin
    return key


def _release(key: int) -> None:
    """Drop the entries of the group with id ``key`` and close its engines (local, not collective)."""
    fin = _watched.pop(key, None)
    if fin is not None:
        fin.detach()
    _group_sizes.pop(key, None)
    for table in (_shm_comms, _cuda_comms):
        comm = table.pop(key, None)
        if comm is not None:
            comm.close()


def _registered(group) -> bool:
    """Whether torch.distributed still knows ``group`` (destroy_process_group forgets it)."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def release_destroyed_groups() -> int:
    """Close the engines of groups that ``torch.distributed.destroy_process_group`` has destroyed
    but that are still referenced (a dropped group releases its engines when it is collected).
    Local: no other rank is involved. Runs by itself when a group sets up an engine; returns how
    many groups were released."""
    dead = []
    for key, fin in list(_watched.items()):
        alive = fin.peek()
        if alive is None or not _registered(alive[0]):
            dead.append(key)
    for key in dead:
        _release(key)
    return len(dead)


def _size_of(group) -> int:
    key = group if group is not None else dist.group.WORLD
    size = _group_sizes.get(id(key))
    if size is None:
        size = _group_sizes[_watch(key)] = dist.get_world_size(key)
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


def close_group(group) -> None:
    """Release the engines of one group (local: no other rank is involved). A later collective on
    the group sets them up again, collectively."""
    _release(id(group if group is not None else dist.group.WORLD))


def close_all() -> None:
    """Release every engine (shared segments, IPC mappings). Later calls set them up again."""
    for key in set(_watched) | set(_shm_comms) | set(_cuda_comms) | set(_group_sizes):
        _release(key)


def _warn_fallback(what: str, exc: BaseException) -> None:
    warnings.warn(
        f"llmmem.parallel: {what} unavailable, using torch.distributed instead: {exc}", RuntimeWarning, stacklevel=4
    )


def _shm_engine(group):
    """The shared-memory engine of ``group`` (set up on the group's first CPU collective), or None.

    The set-up is collective and happens on the first CPU collective whatever its dtype, size or
    layout, so that every rank sets up at the same call. It gives up after the engine's timeout.
    """
    key = group if group is not None else dist.group.WORLD
    comm = _shm_comms.get(id(key), _MISSING)
    if comm is not _MISSING:
        return comm
    if not _engines_on["shm"] or _thresholds["cpu_shm_max_bytes"] == 0:
        return None  # not cached: the switches are read here, and must be equal on all ranks
    from llmmem.parallel import shm

    release_destroyed_groups()
    try:
        comm = shm.ShmCommunicator.setup(key, timeout=_timeout_s)
    except shm.SetupError as exc:
        _warn_fallback("shared-memory collectives", exc)
        comm = None
    _shm_comms[_watch(key)] = comm
    return comm


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
    comm = _cuda_comms.get(id(key), _MISSING)
    if comm is _MISSING:
        from llmmem.parallel import cuda_ipc

        release_destroyed_groups()
        try:
            comm = cuda_ipc.CudaIpcCommunicator.setup(
                key, tensor.device, timeout=_timeout_s, max_bytes=_thresholds["cuda_ipc_max_bytes"]
            )
        except cuda_ipc.SetupError as exc:
            _warn_fallback("CUDA IPC all-reduce", exc)
            comm = None
        _cuda_comms[_watch(key)] = comm
    if comm is not None and nbytes > comm.max_bytes:
        return None
    return comm


# --- agreeing on the route -------------------------------------------------------------------
# A CPU collective on a group with the shared-memory engine takes one of two routes: the engine
# (a supported dtype, at most cpu_shm_max_bytes) or torch.distributed. The route depends on this
# rank's tensor, and ranks whose tensors differ would wait for each other in two different places
# until a timeout (30 minutes for gloo). So a rank takes torch.distributed only after every rank has
# said, through the engine, that it does too: an empty all-gather, which no engine call matches
# (all_gather with no elements never takes the engine; see _gather_route), then an all-gather of
# every rank's description of its call. Any difference -- a rank on the engine, another dtype or
# element count -- raises on every rank, with every rank's view, after one barrier. Engine calls
# need no extra step: the engine compares every rank's (collective, dtype, count) at its first barrier.

_OPS = ("all_reduce_", "all_gather", "reduce_scatter")
# dtypes as small codes, for the call descriptions exchanged through the engine; others are 255
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_MAGIC = 0x6C6C6D6D  # "llmm": a description, not a peer's data
_ROUTE_SHM, _ROUTE_DTYPE, _ROUTE_SIZE = 0, 1, 2


def _route_reason(dtype: torch.dtype, nbytes: int) -> int:
    if dtype not in _SUPPORTED:
        return _ROUTE_DTYPE
    if nbytes > _thresholds["cpu_shm_max_bytes"]:
        return _ROUTE_SIZE
    return _ROUTE_SHM


def _describe(op: str, dtype_name: str, numel: int, nbytes: int, contiguous: bool, reason: int) -> str:
    layout = "" if contiguous else ", not contiguous"
    if reason == _ROUTE_SHM:
        route = "shared memory"
    elif reason == _ROUTE_DTYPE:
        route = f"torch.distributed: the shared-memory engine does not serve {dtype_name}"
    else:
        route = f"torch.distributed: {nbytes} bytes > cpu_shm_max_bytes {_thresholds['cpu_shm_max_bytes']}"
    return f"{op} of {numel} {dtype_name} elements ({nbytes} bytes{layout}) -> {route}"


def _view(op: str, tensor: torch.Tensor, nbytes: int) -> str:
    """This rank's call as the error message shows it (``nbytes``: the size routed on)."""
    dtype_name = str(tensor.dtype).replace("torch.", "")
    return _describe(
        op, dtype_name, tensor.numel(), nbytes, tensor.is_contiguous(), _route_reason(tensor.dtype, nbytes)
    )


def _disagreement(op: str, views: list) -> InvalidArgumentError:
    lines = "; ".join(f"rank {r}: {v}" for r, v in enumerate(views))
    return InvalidArgumentError(
        f"llmmem.parallel.{op}: ranks disagree on the call (every rank must pass a tensor of the same "
        f"dtype and number of elements): {lines}"
    )


# what the C engine says of a call on a communicator that an earlier failure broke
_BROKEN = "is broken by an earlier failure"
_C_PREFIX = re.compile(r"^llmmem: [^:]*: \w+\.c:\d+: ")


def _broken_engine(comm, op: str, exc: BaseException) -> BaseException:
    """A peer that exited, a timeout or an interrupt breaks the engine for good (the ranks are no
    longer at the same collective). The first failure is kept; a later call on the engine raises
    a StateError that names it and says how to go on, instead of the engine's bare refusal."""
    if not isinstance(exc, StateError):
        return exc
    if _BROKEN not in str(exc):
        if comm.failure is None:
            comm.failure = _C_PREFIX.sub("", str(exc))
        return exc
    return StateError(
        f"llmmem.parallel.{op}: the group's shared-memory engine is broken by an earlier failure "
        f"({comm.failure or 'not recorded'}); no collective can run on it. Once every rank is back, call "
        "llmmem.parallel.collectives.close_group(group) (or llmmem.parallel.destroy()) on every rank: the next "
        "collective sets up a new engine"
    )


def _group_gone(op: str, group, exc: BaseException) -> None:
    """Raise a StateError naming the cause when ``exc`` came from a call on a process group that no
    longer exists (destroyed, or torch.distributed shut down); return when the group is alive.
    Checked only once a call has failed: the check costs microseconds, a collective's own time."""
    if not dist.is_available() or not dist.is_initialized():
        why = (
            "torch.distributed is not initialized (init_process_group was not called, or destroy_process_group() "
            "destroyed every group)"
        )
    elif group is not None and not _registered(group):
        why = (
            "its process group was destroyed (torch.distributed.destroy_process_group) or is not a group of "
            "torch.distributed; create one with torch.distributed.new_group on every rank"
        )
    else:
        return
    raise StateError(f"llmmem.parallel.{op}: {why}") from exc


def _engine_failed(comm, key, op: str, view: str, exc: BaseException) -> BaseException:
    """The exception to raise for an engine call that failed with ``exc``. A disagreement between
    ranks was seen by every rank at the same barrier, so all of them exchange their views here
    (bounded by the engine's timeout) and raise the same message; the broken engine is dropped, so
    the next CPU collective sets up a fresh one on every rank."""
    if not (isinstance(exc, InvalidArgumentError) and "ranks disagree" in str(exc)):
        # a local argument error, or a peer that failed or timed out: as the engine said, the
        # first time; later calls on the broken engine name that first failure
        return _broken_engine(comm, op, exc)
    comm.close()
    _shm_comms.pop(id(key), None)
    try:
        views = all_gather_json(view, key, timeout=_timeout_s, what=f"the report of a disagreement in {op}")
    except Exception as report_exc:
        return InvalidArgumentError(f"{exc} (the ranks' views could not be exchanged: {report_exc})")
    return _disagreement(op, views)


def _agree_on_fallback(comm, key, op: str, tensor: torch.Tensor, nbytes: int) -> None:
    """Returns when every rank of the group makes this same call through torch.distributed; raises
    InvalidArgumentError on every rank otherwise (see the comment above)."""
    view = _view(op, tensor, nbytes)
    none = torch.empty(0)
    try:
        comm.all_gather_into(none, none)  # every rank is here, not in an engine call
    except Exception as exc:
        raise _engine_failed(comm, key, op, view, exc) from None
    numel = tensor.numel()
    mine = torch.tensor(
        [
            _MAGIC,
            _OPS.index(op),
            _DTYPE_CODE.get(tensor.dtype, 255),
            numel & 0x7FFFFFFF,
            numel >> 31,
            nbytes & 0x7FFFFFFF,
            nbytes >> 31,
            int(tensor.is_contiguous()),
            _route_reason(tensor.dtype, nbytes),
        ],
        dtype=torch.int32,
    )
    world = comm.world_size
    every = torch.empty(world * mine.numel(), dtype=torch.int32)
    comm.all_gather_into(every.view(torch.float32), mine.view(torch.float32))  # copies bits, sums nothing
    rows = every.view(world, -1).tolist()
    if all(row[:5] == rows[0][:5] for row in rows):
        return
    views = []
    for magic, o, d, n0, n1, b0, b1, contiguous, reason in rows:
        if magic != _MAGIC:
            views.append("a call that is not a collective of llmmem.parallel")
            continue
        dtype_name = str(_DTYPES[d]).replace("torch.", "") if d < len(_DTYPES) else "another dtype"
        views.append(_describe(_OPS[o], dtype_name, n0 | (n1 << 31), b0 | (b1 << 31), bool(contiguous), reason))
    raise _disagreement(op, views)


# Dynamo must never trace into the engines (their set-up, their caches): it recompiled at each call
# until its recompile limit sent the whole model back to eager. Under torch.compile the collectives
# are custom operators instead (see the end of this module); one called there directly, such as the
# in-place all_reduce_, runs eagerly between graphs.
_eager_under_compile = torch.compiler.disable(
    recursive=True, reason="llmmem's collectives run eagerly between graphs (llmmem.parallel.collectives)"
)


@_eager_under_compile
def all_reduce_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place; returns it.

    Every rank must pass a tensor of the same dtype and number of elements; a CPU call that breaks
    this raises :class:`llmmem.errors.InvalidArgumentError` on every rank, naming each rank's call.
    """
    try:
        if _size_of(group) == 1:
            return tensor
        if tensor.is_cpu:
            key = group if group is not None else dist.group.WORLD
            comm = _shm_comms.get(id(key), _MISSING)
            if comm is _MISSING:
                comm = _shm_engine(key)
            if comm is not None:
                # Each tensor accessor is read once, and the engine is not asked to check again: checking
                # twice costs microseconds on every collective of every layer.
                dtype = tensor.dtype
                nbytes = tensor.nbytes
                if dtype in _SUPPORTED and nbytes <= _thresholds["cpu_shm_max_bytes"]:
                    contiguous = tensor.is_contiguous()
                    buf = tensor if contiguous else tensor.contiguous()  # the route must not depend on layout
                    try:
                        comm.all_reduce_checked_(buf, dtype)
                    except Exception as exc:
                        raise _engine_failed(
                            comm, key, "all_reduce_", _view("all_reduce_", tensor, nbytes), exc
                        ) from None
                    if not contiguous:
                        with torch.no_grad():
                            tensor.copy_(buf)
                    return tensor
                _agree_on_fallback(comm, key, "all_reduce_", tensor, nbytes)
        elif tensor.is_contiguous():
            comm = _cuda_for(tensor, group)
            if comm is not None:
                comm.all_reduce_(tensor)
                return tensor
        dist.all_reduce(tensor, group=group)
        return tensor
    except (ValueError, RuntimeError) as exc:
        _group_gone("all_reduce_", group, exc)  # a destroyed group: say so, not torch's "not registered"
        raise


def _check_dim(tensor: torch.Tensor, dim: int) -> int:
    if tensor.dim() == 0:
        raise ValueError("llmmem.parallel: a 0-dim tensor has no dimension to gather or scatter along")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"llmmem.parallel: dim {dim} is out of range for a tensor of {tensor.dim()} dimensions")
    return dim % tensor.dim()


def _gather_route(stacked: torch.Tensor, tensor: torch.Tensor, group) -> bool:
    """All-gathers ``tensor`` into ``stacked`` through the shared-memory engine and returns True, or
    returns False when every rank agrees to use torch.distributed (see all_reduce_)."""
    if not tensor.is_cpu:
        return False
    key = group if group is not None else dist.group.WORLD
    comm = _shm_engine(key)
    if comm is None:
        return False
    nbytes = tensor.nbytes
    # an empty all-gather is never an engine call: it is how ranks agree on torch.distributed
    if tensor.dtype in _SUPPORTED and 0 < nbytes <= _thresholds["cpu_shm_max_bytes"]:
        try:
            comm.all_gather_into(stacked, tensor)
        except Exception as exc:
            raise _engine_failed(comm, key, "all_gather", _view("all_gather", tensor, nbytes), exc) from None
        return True
    _agree_on_fallback(comm, key, "all_gather", tensor, nbytes)
    return False


def _scatter_route(out: torch.Tensor, src: torch.Tensor, group) -> bool:
    """reduce_scatter's counterpart of _gather_route (routed on the size of ``out``)."""
    if not out.is_cpu:
        return False
    key = group if group is not None else dist.group.WORLD
    comm = _shm_engine(key)
    if comm is None:
        return False
    nbytes = out.nbytes
    if out.dtype in _SUPPORTED and nbytes <= _thresholds["cpu_shm_max_bytes"]:
        try:
            comm.reduce_scatter_into(out, src)
        except Exception as exc:
            raise _engine_failed(comm, key, "reduce_scatter", _view("reduce_scatter", src, nbytes), exc) from None
        return True
    _agree_on_fallback(comm, key, "reduce_scatter", src, nbytes)
    return False


@_eager_under_compile
def _all_gather(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    try:
        dim = _check_dim(tensor, dim)  # at one rank too: a call that is wrong is wrong at any size
        w = _size_of(group)
        if w == 1:
            return tensor
        tensor = tensor.detach()  # data movement, not an autograd op (llmmem.parallel.mappings is)
        tensor = tensor.contiguous()
        stacked = torch.empty(
            (w * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        if not _gather_route(stacked, tensor, group):
            dist.all_gather_into_tensor(stacked, tensor, group=group)
        if dim == 0:
            return stacked
        # rank-major blocks of dim 0 -> concatenation along `dim`
        return torch.cat(stacked.chunk(w, dim=0), dim=dim)
    except (ValueError, RuntimeError) as exc:
        _group_gone("all_gather", group, exc)  # a destroyed group: say so, not torch's "not registered"
        raise


@_eager_under_compile
def _reduce_scatter(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    try:
        dim = _check_dim(tensor, dim)
        w = _size_of(group)
        if w == 1:
            return tensor
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
        if not _scatter_route(out, src, group):
            dist.reduce_scatter_tensor(out, src, group=group)
        # src stacks the chunks along dim 0, each chunk keeping its shape, so `out` is already this
        # rank's chunk of `tensor` along `dim`.
        return out
    except (ValueError, RuntimeError) as exc:
        _group_gone("reduce_scatter", group, exc)  # a destroyed group: say so, not torch's "not registered"
        raise


# ---- the collectives a compiled graph carries --------------------------------------------------
# Under torch.compile the out-of-place collectives below are custom operators (torch.library):
# Dynamo puts one opaque node in the graph (no graph break, fullgraph=True holds) and the engines
# above run when the graph does, in the graph's order, which is the same on every rank. A group
# travels as its name (an operator takes no ProcessGroup). Called eagerly they are plain calls:
# the dispatcher's cost is paid only where a graph needs the operator.


def _group_name(op: str, group) -> str:
    if not dist.is_initialized():  # as the eager call says it
        raise StateError(
            f"llmmem.parallel.{op}: torch.distributed is not initialized (init_process_group was not called, "
            "or destroy_process_group() destroyed every group)"
        )
    return (group if group is not None else dist.group.WORLD).group_name


def _group_of(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# Each runs a collective whose host-side engines a captured CUDA graph could not replay.
_UNCAPTURABLE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("llmmem::tp_all_reduce", mutates_args=(), tags=_UNCAPTURABLE)
def _all_reduce_op(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return all_reduce_(tensor.contiguous().clone(), _group_of(group_name))


@_all_reduce_op.register_fake
def _(tensor, group_name):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmmem::tp_all_gather", mutates_args=(), tags=_UNCAPTURABLE)
def _all_gather_op(tensor: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    out = _all_gather(tensor, dim, _group_of(group_name))
    # an operator's output never aliases its input, and has the fake's (contiguous) strides
    return out.clone(memory_format=torch.contiguous_format) if out is tensor else out


@_all_gather_op.register_fake
def _(tensor, dim, group_name):
    shape = list(tensor.shape)
    shape[dim] *= dist.get_world_size(_group_of(group_name))
    return tensor.new_empty(shape)


@torch.library.custom_op("llmmem::tp_reduce_scatter", mutates_args=(), tags=_UNCAPTURABLE)
def _reduce_scatter_op(tensor: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    out = _reduce_scatter(tensor, dim, _group_of(group_name))
    return out.clone(memory_format=torch.contiguous_format) if out is tensor else out


@_reduce_scatter_op.register_fake
def _(tensor, dim, group_name):
    shape = list(tensor.shape)
    world = dist.get_world_size(_group_of(group_name))
    if shape[dim] % world:
        raise ValueError(
            f"reduce_scatter: dimension {dim} of size {shape[dim]} is not divisible by the group size {world}"
        )
    shape[dim] //= world
    return tensor.new_empty(shape)


def all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``tensor`` over the group, in a new tensor (``tensor`` is left as it is), detached
    as the other two: data movement, not an autograd op (llmmem.parallel.mappings is)."""
    if torch.compiler.is_compiling():
        return torch.ops.llmmem.tp_all_reduce(tensor.detach(), _group_name("all_reduce", group))
    return all_reduce_(tensor.detach().contiguous().clone(), group)


def all_gather(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``tensor`` (all the same shape), in rank order."""
    if torch.compiler.is_compiling():
        # detached, as the eager call's result: data movement, not an autograd op (mappings.py is)
        return torch.ops.llmmem.tp_all_gather(
            tensor.detach(), _check_dim(tensor, dim), _group_name("all_gather", group)
        )
    return _all_gather(tensor, dim, group)


def reduce_scatter(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's block (``dim`` split evenly, in rank order) of the sum over the group."""
    if torch.compiler.is_compiling():
        return torch.ops.llmmem.tp_reduce_scatter(
            tensor.detach(), _check_dim(tensor, dim), _group_name("reduce_scatter", group)
        )
    return _reduce_scatter(tensor, dim, group)
