"""Offload of a checkpointed region's inputs to pinned host memory, copied on a side stream and
prefetched during backward (``checkpoint(..., offload=True)``)."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from llmmem.checkpointing.observers import notify_kept

__all__ = ["HostCopies", "offload_without_prefetch"]


class HostCopies:
    """saved_tensors_hooks for one region's inputs: device tensors go to pinned host memory through a
    side stream; in backward they come back, and the region saved just before this one (in forward
    order, same thread) is prefetched so that its copy overlaps this region's recompute."""

    _local = threading.local()

    def __init__(self) -> None:
        self.entries: list = []  # what pack returned, in save order
        self.prefetched: dict[int, torch.Tensor] = {}
        self.fetched = False
        if getattr(self._local, "no_prefetch", False):
            # The planner's offloaded regions (llmmem.checkpointing.plan): the plan's memory model has each
            # input back on the device only while its own region runs backward, so these regions
            # neither prefetch nor get prefetched.
            self.previous = None
        else:
            self.previous = getattr(self._local, "last", None)
            self._local.last = weakref.ref(self)

    @staticmethod
    def _side_stream(device: torch.device):
        streams = HostCopies._local.__dict__.setdefault("streams", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)
        return streams[device]

    def pack(self, t: torch.Tensor):
        # These hooks hide the inputs from any outer saved_tensors_hooks, so tell the byte
        # observers (llmmem.checkpointing.meters.measure_saved_bytes) what is kept, on the memory it is kept in.
        if t.device.type != "cuda":
            notify_kept(t)
            return t  # already in host memory: nothing to move
        side = self._side_stream(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        t.record_stream(side)  # the allocator must not reuse t's memory before the copy ends
        notify_kept(host)
        entry = (len(self.entries), host, t.device, done)
        self.entries.append(entry)
        return entry

    def _to_device(self, entry) -> torch.Tensor:
        _, host, device, done = entry
        side = self._side_stream(device)
        with torch.cuda.stream(side):
            side.wait_event(done)
            return host.to(device, non_blocking=True)

    def unpack(self, entry):
        if isinstance(entry, torch.Tensor):
            return entry
        index, _, device, _ = entry
        out = self.prefetched.pop(index, None)
        if out is None:
            out = self._to_device(entry)
        current = torch.cuda.current_stream(device)
        current.wait_stream(self._side_stream(device))
        out.record_stream(current)
        self.fetched = True
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.prefetch()
        return out

    def prefetch(self) -> None:
        if self.fetched or self.prefetched:
            return
        for entry in self.entries:
            self.prefetched[entry[0]] = self._to_device(entry)


@contextlib.contextmanager
def offload_without_prefetch():
    """Inside: offloaded regions copy their inputs back only when backward reaches them (no
    prefetch), as the planner's model of an offloaded region assumes (csrc/include/llmmem/checkpointing.h)."""
    local = HostCopies._local
    before = getattr(local, "no_prefetch", False)
    local.no_prefetch = True
    try:
        yield
    finally:
        local.no_prefetch = before
