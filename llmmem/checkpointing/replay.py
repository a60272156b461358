"""What a recompute replays: the RNG streams (default generators, accelerators, and registered
trackers such as tensor-parallel dropout's), the autocast state, and the operator log of
``debug=True``.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Callable

import torch
import torch.utils._python_dispatch

from llmmem._devices import cuda_index

__all__ = [
    "register_rng_tracker",
    "has_rng_trackers",
    "ReplayTrackers",
    "RngState",
    "autocast_state",
    "accelerator_type",
    "OpLog",
    "format_op_logs",
]


def accelerator_type(tensors) -> str | None:
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device.type
    return None


# Random streams kept outside the default generators (llmmem.parallel.random.RNGStatesTracker,
# whose fork() swaps a stream into the default generators for split-region dropout). A region that
# forks one draws from the stream's state at forward time; the recompute runs later, after the
# stream has moved on, so the stream's state must be stashed and replayed like the default
# generators', or the recomputed mask (and so every gradient) differs from the forward's.
# Objects with get_states() -> states and set_states(states); held weakly.
_RNG_TRACKERS: weakref.WeakSet = weakref.WeakSet()


def register_rng_tracker(tracker) -> None:
    """Have every checkpoint replay ``tracker``'s streams (``get_states()``/``set_states()``) in its
    recompute, as it replays the default generators. Held weakly."""
    _RNG_TRACKERS.add(tracker)


def has_rng_trackers() -> bool:
    return len(_RNG_TRACKERS) > 0


class ReplayTrackers:
    """For torch's reentrant checkpoint, which replays only the default generators: the first call
    (the forward) stashes the registered trackers' streams, later calls (recomputes) replay them."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        self.states = None

    def __call__(self, *args):
        if self.states is None:
            self.states = _stash_trackers()
            return self.function(*args)
        with _replayed_trackers(self.states):
            return self.function(*args)


def _stash_trackers() -> list:
    return [(t, t.get_states()) for t in list(_RNG_TRACKERS)]


@contextlib.contextmanager
def _replayed_trackers(stashed: list):
    """The trackers' streams as stashed, for a recompute; as fork_rng does for the default
    generators, the streams' current (backward-time) states come back afterwards, so the
    recompute does not move them on."""
    current = [(t, t.get_states()) for t, _ in stashed]
    for t, states in stashed:
        t.set_states(states)
    try:
        yield
    finally:
        for t, states in current:
            t.set_states(states)


class RngState:
    """CPU RNG, the RNG of the CUDA devices the inputs are on (and the current one), the RNG of any
    other accelerator the inputs are on (XPU, MPS, ...), and the streams of the registered RNG
    trackers (tensor-parallel dropout): dropout must replay identically on recompute."""

    def __init__(self, tensors) -> None:
        self.cpu = torch.get_rng_state()
        self.trackers = _stash_trackers()
        self.cuda_was_initialized = torch.cuda.is_initialized()
        self.cuda_devices: list[int] = []
        self.cuda_states: list[torch.Tensor] = []
        if self.cuda_was_initialized:
            devs = {cuda_index(t.device) for t in tensors if t.device.type == "cuda"}
            devs.add(torch.cuda.current_device())
            self.cuda_devices = sorted(devs)
            self.cuda_states = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        # Other accelerators go through torch's own per-device-type helpers (first type found, as torch).
        others = sorted({t.device.type for t in tensors} - {"cpu", "cuda", "meta"})
        self.other_type = others[0] if others else None
        self.other_devices: list[int] = []
        self.other_states: list[torch.Tensor] = []
        if self.other_type is not None:
            from torch.utils.checkpoint import get_device_states

            self.other_devices, self.other_states = get_device_states(
                *[t for t in tensors if t.device.type == self.other_type]
            )

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.cuda_devices, enabled=True, device_type="cuda"))
            if self.other_type is not None:
                stack.enter_context(
                    torch.random.fork_rng(devices=self.other_devices, enabled=True, device_type=self.other_type)
                )
            torch.set_rng_state(self.cpu)
            for d, s in zip(self.cuda_devices, self.cuda_states):
                torch.cuda.set_rng_state(s, d)
            if self.other_type is not None:
                from torch.utils.checkpoint import set_device_states

                set_device_states(self.other_devices, self.other_states, device_type=self.other_type)
            with _replayed_trackers(self.trackers):
                yield


def autocast_state(device_type: str) -> dict:
    return {
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """debug=True: every operator run, in order, as ``$3: float32[2, 4] = aten.mm.default($1, $2)``
    with the Python stack that called it (innermost frame first) -- what torch's checkpoint debug
    mode records, without its C++ frames. Tensors are named ``$n`` in the order they are produced;
    an input from outside the region shows as its dtype and shape. Costs a stack walk per operator,
    and keeps no tensor alive."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log  # (line, [(file, line number, function), ...]) per operator
        self._names: dict[int, tuple] = {}  # id(tensor) -> (weakref to it, "$n")
        self._count = 0

    def _arg(self, x) -> str:
        if isinstance(x, torch.Tensor):
            known = self._names.get(id(x))
            if known is not None and known[0]() is x:
                return known[1]
            return _tensor_text(x)
        if isinstance(x, (list, tuple)):
            inner = ", ".join(self._arg(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
        text = repr(x)
        return text if len(text) <= 60 else text[:57] + "..."

    def _out(self, x) -> str:
        if isinstance(x, torch.Tensor):
            self._count += 1
            name = f"${self._count}"
            try:
                self._names[id(x)] = (weakref.ref(x), name)
            except TypeError:
                pass
            return f"{name}: {_tensor_text(x)}"
        if isinstance(x, (list, tuple)):
            return "(" + ", ".join(self._out(v) for v in x) + ")"
        return repr(x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frames = []
        f = sys._getframe(1)  # the operator's caller: this method is not part of the story
        while f is not None:
            frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        ins = ", ".join([self._arg(a) for a in args] + [f"{k}={self._arg(v)}" for k, v in kwargs.items()])
        out = func(*args, **kwargs)
        self.log.append((f"{self._out(out)} = {func}({ins})", frames))
        return out


def _tensor_text(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def format_op_logs(forward: list, recompute: list) -> str:
    """The two logs of :class:`OpLog` as a checkpoint error shows them: each operator with its
    stack, then both operator lists for comparison."""

    def traces(label: str, log: list) -> list:
        lines = [f"{label}: {len(log)} operators, each with the Python stack that called it (innermost first)"]
        for i, (op, frames) in enumerate(log):
            lines.append(f"  [{i + 1}/{len(log)}] {op}")
            lines.extend(f"      {file}:{lineno} in {name}" for file, lineno, name in frames)
        return lines

    out = ["", "", "debug=True: what the checkpointed region ran", ""]
    out += traces("forward", forward) + [""] + traces("recompute", recompute)
    out += [
        "",
        "the operators in order (the recompute's detach calls are checkpointing's own and can be ignored):",
        "forward:",
    ]
    out += [f"  {op}" for op, _ in forward] + ["recompute:"] + [f"  {op}" for op, _ in recompute]
    # torch's phrase for this error (code that matches torch's message finds it here too)
    out += [
        "",
        "You are seeing this error because you passed `debug=True` to checkpoint (or turned on "
        "torch.utils.checkpoint.set_checkpoint_debug_enabled(True)) and the recompute did not save what "
        "the forward saved: the first operator where the two lists above part is where to look.",
    ]
    return "\n".join(out)
