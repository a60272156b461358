"""Which torch.distributed process group the tensor-parallel layers talk over.

Resolution order for every layer and mapping: an explicit ``process_group=`` argument, else the
tensor-parallel group built by :func:`init`, else the default (world) group. If torch.distributed
was never initialised, the caller gets a ``RuntimeError`` that says what to call, never a hang.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_TP_GROUP = None  # this rank's tensor-parallel group, set by init()
_DP_GROUP = None  # this rank's data-parallel group (same TP rank in every TP group)
# (default process group, tensor_parallel_size) of the groups above: an init() that asks for the
# same again returns them instead of creating new groups (each would get its own engines)
_BUILT_FOR = None

_NO_GROUP_MSG = (
    "llmmem.parallel: torch.distributed is not initialised. Launch with `torchrun` and call "
    "`torch.distributed.init_process_group()` (or `llmmem.parallel.init(tensor_parallel_size=...)`) "
    "before building tensor-parallel layers, or pass process_group= explicitly"
)


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(
    tensor_parallel_size: int | None = None,
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | float | None = None,
):
    """Initialise torch.distributed if needed and build the tensor-parallel groups (TP x DP).

    Ranks ``[k*t, (k+1)*t)`` form tensor-parallel group ``k`` (consecutive ranks share a node under
    torchrun, so the TP collectives stay inside it); ranks with the same index in every TP group
    form a data-parallel group. ``tensor_parallel_size`` defaults to the world size.

    Under ``torchrun`` the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) is used; if a
    process group already exists it is reused. Every rank must call this (it creates groups
    collectively). Returns this rank's tensor-parallel group. Calling it again with the same size
    returns the same groups; with another size, the earlier groups' llmmem engines (shared segments)
    are freed and new groups are built.

    :param timeout: seconds (or a timedelta) for the process group and for llmmem's own collectives.
    """
    global _TP_GROUP, _DP_GROUP, _BUILT_FOR
    if not dist.is_available():
        raise RuntimeError("llmmem.parallel.init: this torch build has no torch.distributed")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"llmmem.parallel.init: timeout must be a positive number of seconds, got {timeout!r}")
        timeout = datetime.timedelta(seconds=float(timeout))
    if not dist.is_initialized():
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            raise RuntimeError(_NO_GROUP_MSG + " (no RANK/WORLD_SIZE in the environment: run under torchrun)")
        kwargs = {"backend": backend or _default_backend()}
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(**kwargs)
    if timeout is not None:
        from llmmem.parallel import collectives

        collectives.set_timeout(timeout.total_seconds())
    world = dist.get_world_size()
    t = world if tensor_parallel_size is None else tensor_parallel_size
    if not isinstance(t, int) or isinstance(t, bool) or t <= 0:
        raise ValueError(f"llmmem.parallel.init: tensor_parallel_size must be a positive int, got {t!r}")
    if world % t != 0:
        raise ValueError(f"llmmem.parallel.init: tensor_parallel_size ({t}) must divide the world size ({world})")
    built_for = (dist.group.WORLD, t)
    if _TP_GROUP is not None and _BUILT_FOR is not None and _BUILT_FOR[0] is built_for[0] and _BUILT_FOR[1] == t:
        return _TP_GROUP  # the same groups again: every rank takes this branch (same arguments)
    _release_groups()  # the groups of an earlier init() with another size: free their engines
    rank = dist.get_rank()
    # new_group is collective: every rank creates every group, in the same order.
    for k in range(world // t):
        ranks = list(range(k * t, (k + 1) * t))
        g = dist.new_group(ranks)
        if rank in ranks:
            _TP_GROUP = g
    for i in range(t):
        ranks = list(range(i, world, t))
        g = dist.new_group(ranks)
        if rank in ranks:
            _DP_GROUP = g
    _BUILT_FOR = built_for
    return _TP_GROUP


def _release_groups() -> None:
    """Free llmmem's engines of init()'s groups and forget the groups (the process groups stay)."""
    global _TP_GROUP, _DP_GROUP, _BUILT_FOR
    from llmmem.parallel import collectives

    for g in (_TP_GROUP, _DP_GROUP):
        if g is not None:
            collectives.close_group(g)
    _TP_GROUP = _DP_GROUP = _BUILT_FOR = None


def destroy() -> None:
    """Forget the groups of :func:`init` and llmmem's communicators (the process group stays)."""
    from llmmem.parallel import collectives

    _release_groups()
    collectives.close_all()


def get_tensor_parallel_group(process_group=None):
    """The group a layer uses: ``process_group`` if given, else :func:`init`'s, else the world group."""
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(_NO_GROUP_MSG)
    return _TP_GROUP if _TP_GROUP is not None else dist.group.WORLD


def get_data_parallel_group():
    """The data-parallel group built by :func:`init` (``None`` before it)."""
    return _DP_GROUP
