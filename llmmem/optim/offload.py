"""Host offload of the optimizer (ZeRO-Offload's idea for one GPU): the moments, and the fp32
master where there is one, live in host memory and the C CPU kernel steps them there; only the
weights and their gradients stay on the device.

A step of offloaded parameters:

1. waits until the previous step's weights have reached the device (their host buffers are
   about to be rewritten);
2. copies every gradient to a pinned host buffer on a side stream, after the work that made it
   (one host synchronisation: the kernel needs them);
3. refreshes the host copy of a weight that was changed on the device since the last step (a
   model ``load_state_dict``, an in-place edit: seen by the tensor's version counter), keeping a
   master's extra precision wherever the master still rounds to the device's value;
4. runs the C step on the host copies (threads, GIL released);
5. copies the updated weights back on the side stream; the current stream waits for them before
   its next kernel, so the forward that follows sees them; nothing waits on the host.

Device memory saved: the moments (8 B a parameter in fp32, 2 in int8) and the master (4 B); what
it costs: 2 x (weight bytes) + (gradient bytes) over the host link each step, and the host
memory of the moments, a pinned copy of every weight and gradient.

On the CPU (parameters already in host memory) the same path runs with plain copies: the results
equal the step without offload bit for bit, which is what the tests check there.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmmem.optim import kernels
from llmmem.optim.formats import Format
from llmmem.optim.kernels import Hyper, Item


def _pinned(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    pin = like.device.type == "cuda"  # pinned memory exists only beside a CUDA device
    return torch.empty(like.shape, dtype=dtype or like.dtype, device="cpu", pin_memory=pin)


class HostBuffers:
    """One parameter's host copies: its weight (the parameter's dtype) and its gradient."""

    __slots__ = ("weight", "grad", "version")

    def __init__(self, param: torch.Tensor) -> None:
        self.weight = _pinned(param)
        self.weight.copy_(param.detach())
        self.grad: Optional[torch.Tensor] = None
        self.version = -1  # the device parameter's version after the last copy to it


class Offload:
    """The host side of an optimizer's offloaded parameters (see the module)."""

    def __init__(self) -> None:
        self.buffers: dict = {}  # parameter -> HostBuffers
        self._stream = None
        self._pushed = None  # the event of the last copy of weights to the device

    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def forget(self) -> None:
        """Drops the host copies (after a state load: they are rebuilt from the device weights)."""
        self.wait()
        self.buffers.clear()

    def wait(self) -> None:
        if self._pushed is not None:
            self._pushed.synchronize()
            self._pushed = None

    def step(self, params: list, items: list[Item], fmt: Format, hp: Hyper) -> None:
        """One step of ``items`` (device weights and gradients, host state), in place."""
        if not items:
            return
        self.wait()
        device = items[0].param.device
        cuda = device.type == "cuda"
        side = self._side_stream(device) if cuda else None
        host_items = []
        if cuda:
            side.wait_stream(torch.cuda.current_stream(device))  # the gradients are made
        with torch.cuda.stream(side) if cuda else _nothing():
            for p, it in zip(params, items):
                buf = self.buffers.get(p)
                if buf is None:
                    buf = self.buffers[p] = HostBuffers(it.param)
                elif buf.version != p._version:
                    self._refresh(buf, it)
                if buf.grad is None or buf.grad.dtype != it.grad.dtype:
                    buf.grad = _pinned(it.grad)
                buf.grad.copy_(it.grad.detach(), non_blocking=cuda)
                host_items.append(
                    Item(param=buf.weight, grad=buf.grad, master=it.master, state=it.state, seed=it.seed)
                )
        if cuda:
            side.synchronize()  # the kernel reads the host gradients
        kernels.step(host_items, fmt, hp, torch.device("cpu"))
        with torch.cuda.stream(side) if cuda else _nothing():
            for p, it in zip(params, items):
                buf = self.buffers[p]
                it.param.copy_(buf.weight, non_blocking=cuda)
                buf.version = p._version
        if cuda:
            torch.cuda.current_stream(device).wait_stream(side)
            self._pushed = torch.cuda.Event()
            self._pushed.record(side)

    @staticmethod
    def _refresh(buf: HostBuffers, it: Item) -> None:
        """The device weight changed outside the step: take it, keeping the master's precision
        wherever the master still rounds to the device's value."""
        device_weight = it.param.detach().to("cpu")
        if it.master is not None:
            same = it.master.to(device_weight.dtype) == device_weight
            it.master.copy_(torch.where(same, it.master, device_weight.to(torch.float32)))
        buf.weight.copy_(device_weight)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
