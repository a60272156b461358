"""A bounded all-gather of small JSON values over a torch.distributed group.

``torch.distributed.all_gather_object`` waits as long as the process group's timeout (30 minutes
by default) and takes any picklable object. The set-up of llmmem's engines and the reports of a
disagreement between ranks need neither: they exchange host names, segment names, error strings
and call descriptions, and must give up after llmmem's own timeout so that a rank that never comes
is reported in that time, the way a late peer of a running engine is.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from llmmem.errors import StateError


def _device_for(group) -> torch.device:
    """The device the group's backend exchanges tensors on: the CPU unless the group has only NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait_bounded(work, deadline: float, what: str, timeout: float) -> None:
    """Wait for an ``async_op`` handle until ``deadline`` (``time.monotonic()``), then raise.

    Polls (sleeps of at most 2 ms) instead of blocking in C, so that Ctrl-C gets through: Python
    runs signal handlers between bytecodes, not inside a C wait.
    """
    pause = 5e-5
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise StateError(
                f"llmmem.parallel: {what} timed out after {timeout:g} s waiting for the other ranks "
                "(a rank did not make the same call; the timeout is llmmem.parallel.set_timeout / "
                "LLMMEM_TP_TIMEOUT). The process group may be unusable now: its pending exchange "
                "is still queued (and some torch versions wait for it in destroy_process_group)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    work.wait()  # raises the backend's error, if the exchange failed


def all_gather_json(value, group, *, timeout: float, what: str) -> list:
    """Every rank's ``value`` (anything ``json`` encodes), in group-rank order, within ``timeout`` s.

    Collective: every rank of ``group`` must call it. Raises :class:`llmmem.errors.StateError` when
    the exchange does not complete in time. Two all-gathers (lengths, then bytes); tuples come back
    as lists.
    """
    world = dist.get_world_size(group)
    device = _device_for(group)
    data = json.dumps(value).encode()
    deadline = time.monotonic() + timeout
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    wait_bounded(dist.all_gather(sizes, size, group=group, async_op=True), deadline, what, timeout)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    wait_bounded(dist.all_gather(bufs, buf, group=group, async_op=True), deadline, what, timeout)
    return [json.loads(bytes(b[:n].cpu().tolist()).decode()) for b, n in zip(bufs, lengths)]
