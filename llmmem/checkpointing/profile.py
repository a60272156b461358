"""Measuring a chain of blocks for the recompute planner: per block and per mode, forward and
backward times (median of repeats) and the bytes autograd keeps for backward (every storage counted
once, parameters and buffers excluded), on the CPU or a CUDA device.

Modes of a block: ``"store-all"`` (autograd keeps its tape), ``"selective"`` (keeps matmul and
attention outputs, recomputes the rest: :mod:`llmmem.checkpointing.selective`), ``"recompute-cheap"``
(keeps the tape but rebuilds in backward the tensors one elementwise operator or a LayerNorm makes
from kept ones: :mod:`llmmem.checkpointing.remat`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn

from llmmem.checkpointing import remat, selective
from llmmem.checkpointing.core import checkpoint
from llmmem.checkpointing.observers import observe_kept

__all__ = [
    "profile_blocks",
    "measure_saved_bytes",
    "ChainProfile",
    "MODES",
    "run_mode",
    "as_block_list",
    "median_time",
]

MODES = ("store-all", "selective", "recompute-cheap")
_NESTABLE = {"store-all": 1, "selective": 0, "recompute-cheap": 0}


# --------------------------------------------------------------------------------------------
# Measuring what is kept for backward


class measure_saved_bytes:
    """Context manager: the bytes kept for backward by what runs inside, each storage once.

    Counts the tensors autograd saves at this level (inside a checkpointed region they are
    placeholders, so they do not count, exactly as they take no memory) and the outputs kept by
    the selective mode, and the inputs of offloaded regions on the memory they are kept in (the
    host copy; on the CPU the input itself). Storages in ``exclude`` (parameters, buffers) are not
    counted; ``storages`` keys carry the device, so device and host bytes can be told apart.
    ``.bytes`` is the total after the block exits; ``.storages`` maps storage key to bytes.

    Memory: none beyond weak bookkeeping (it keeps no tensor alive it did not already keep).
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self.excluded = {_storage_key(t) for t in exclude}
        self.storages: dict = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _record(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        key = _storage_key(t)
        if key not in self.excluded:
            self.storages[key] = t.untyped_storage().nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t)
        # Detached (same storage and version counter): a saved output returned as itself holds its
        # own grad_fn, a cycle through C++ that leaks when the forward is measured without a backward.
        return t.detach()

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks.__enter__()
        self._observing = observe_kept(self._record)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc):
        self._observing.__exit__(*exc)
        return self._hooks.__exit__(*exc)


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def _module_tensors(block) -> list:
    if isinstance(block, nn.Module):
        return list(block.parameters()) + list(block.buffers())
    return []


# --------------------------------------------------------------------------------------------
# Profiling


@dataclass
class ChainProfile:
    """Measured costs of a chain of blocks, in seconds and bytes; ``modes`` names the columns."""

    modes: tuple
    fwd_time: list  # [L][K] forward keeping the tape in mode k
    fwd_nostore_time: list  # [L] forward inside a checkpointed region (profile_blocks: mean with its recompute)
    bwd_time: list  # [L][K]
    input_bytes: list  # [L + 1]
    saved_bytes: list  # [L][K] beyond the block input
    fwd_tmp_bytes: list  # [L] (0 on the CPU: no allocator statistics there)
    bwd_tmp_bytes: list  # [L][K]
    device: str = "cpu"
    # [L][K] 1 where the block's tape in that mode keeps its own output (selective keeps a final
    # matmul's output, tanh keeps its result): offloading the next block's input would then free
    # nothing on the device. Empty: unknown, treated as all 0.
    output_kept: list = field(default_factory=list)

    def to_chain(self, host_bandwidth: float = 0.0) -> dict:
        """The dict the C planner takes (llmmem._C.plan_solve); ``host_bandwidth`` in bytes per
        second, 0 for no offloading."""
        return {
            "fwd_time": self.fwd_time,
            "fwd_nostore_time": self.fwd_nostore_time,
            "bwd_time": self.bwd_time,
            "input_bytes": self.input_bytes,
            "saved_bytes": self.saved_bytes,
            "fwd_tmp_bytes": self.fwd_tmp_bytes,
            "bwd_tmp_bytes": self.bwd_tmp_bytes,
            "mode_nestable": [_NESTABLE[m] for m in self.modes],
            "output_kept": self.output_kept or None,
            "host_bandwidth": float(host_bandwidth),
        }

    @property
    def n_blocks(self) -> int:
        return len(self.fwd_time)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _tensor_bytes(x) -> int:
    seen = {}
    for t in torch.utils._pytree.tree_leaves(x):
        if isinstance(t, torch.Tensor):
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def run_mode(block, x, mode: str, **checkpoint_options):
    """``block(x)`` in one mode (profiling, and the top-level blocks of a plan); the options go to
    :func:`llmmem.checkpoint` in the modes that use it."""
    if mode == "store-all":
        return block(x)
    if mode == "selective":
        return checkpoint(block, x, context_fn=selective.selective_context_fn, **checkpoint_options)
    if mode == "recompute-cheap":
        with remat.recompute_cheap(block):
            return block(x)
    if mode == "nostore":
        return checkpoint(block, x, **checkpoint_options)
    raise ValueError(f"unknown mode {mode!r}")


def _first_tensor(out) -> torch.Tensor:
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    raise ValueError("profile_blocks: a block returned no tensor that requires grad")


def _profile_one(block, x: torch.Tensor, modes, repeats: int, warmup: int, device: torch.device):
    params = _module_tensors(block)
    cuda = device.type == "cuda"
    rng = torch.get_rng_state()  # profiling must not change the user's random stream

    def forward(mode):
        return run_mode(block, x, mode)

    def step(mode):
        """(forward seconds, backward seconds) of one training step of the block, as training runs
        it: timing forwards alone measures another memory pattern (on the CPU, the allocator hands
        pages back between forwards that a step would have reused)."""
        _sync(device)
        t0 = time.perf_counter()
        out = _first_tensor(forward(mode))
        _sync(device)
        t1 = time.perf_counter()
        torch.autograd.backward(out, torch.ones_like(out))
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    # Round-robin over the modes, so that a load change on a shared machine shifts them all alike.
    timed = list(modes) + ["nostore"]
    samples = {mode: [] for mode in timed}
    for r in range(warmup + repeats):
        for mode in timed:
            sample = step(mode)
            if r >= warmup:
                samples[mode].append(sample)
    # Other modes: store-all's median plus the median of their per-round differences to it (paired
    # samples cancel most of the drift a shared machine adds, which is larger than these differences).
    base = samples[modes[0]]
    f0, b0 = statistics.median(f for f, _ in base), statistics.median(b for _, b in base)
    medians = {
        m: (
            f0 + statistics.median(f - fb for (f, _), (fb, _) in zip(v, base)),
            b0 + statistics.median(b - bb for (_, b), (_, bb) in zip(v, base)),
        )
        for m, v in samples.items()
    }
    # The planner charges fwd_nostore_time twice per recomputed block: the forward inside the
    # region, and its recompute in backward. The recompute costs more than that forward (it
    # records a graph again and allocates the activations anew, in the middle of the backward: for
    # the small GPT's block on the CPU, measured 1.7-2.4 ms above a 6.7-7.4 ms forward), so the
    # value handed over is the mean of the two measured costs: a one-level region is then charged
    # what it costs.
    recompute = max(0.0, medians["nostore"][1] - medians[modes[0]][1])
    nostore = 0.5 * (medians["nostore"][0] + recompute)
    fwd, bwd, saved, btmp, kept_out = [], [], [], [], []
    input_key = _storage_key(x)
    for mode in modes:
        f, b = medians[mode]
        # The other modes run store-all's operators plus extra work (hooks, recomputes): a lower
        # measured time is noise, and taken at face value it would make the planner prefer them
        # even when memory is plentiful.
        if f + b < f0 + b0:
            b = f0 + b0 - f
        fwd.append(f)
        bwd.append(b)
        with measure_saved_bytes(exclude=params) as m:
            out = forward(mode)
        m.storages.pop(input_key, None)
        # A block that keeps its own output (e.g. ending in tanh/sigmoid) shares that storage with
        # whatever holds the next block's input; the planner counts it there, except after the
        # last block (profile_blocks adds it back for that one).
        kept_out.append(m.storages.pop(_storage_key(_first_tensor(out)), 0))
        saved.append(m.bytes)
        if cuda:
            grad = torch.ones_like(_first_tensor(out))
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            torch.autograd.backward(_first_tensor(out), grad)
            peak = torch.cuda.max_memory_allocated(device) - base
            # beyond the incoming and outgoing gradients (the planner counts those)
            btmp.append(max(0, peak - 2 * _tensor_bytes(x)))
        else:
            btmp.append(0)
        del out
        if isinstance(block, nn.Module):
            block.zero_grad(set_to_none=True)
        x.grad = None
    ftmp = 0
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            y = block(x)
        ftmp = max(0, torch.cuda.max_memory_allocated(device) - base - _tensor_bytes(y))
        del y
    torch.set_rng_state(rng)
    return fwd, nostore, bwd, saved, ftmp, btmp, kept_out


def _look_identical(blocks: list, x: torch.Tensor) -> bool:
    """Same class, same configuration (repr), same parameter shapes/dtypes, shape-preserving."""
    first = blocks[0]
    sig = [(p.shape, p.dtype, p.device) for p in first.parameters()]
    for b in blocks[1:]:
        if (
            type(b) is not type(first)
            or repr(b) != repr(first)
            or [(p.shape, p.dtype, p.device) for p in b.parameters()] != sig
        ):
            return False
    with torch.no_grad():
        y = first(x)
    return isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype


def profile_blocks(
    blocks,
    sample_input,
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    warmup: int = 1,
    same_blocks: bool | None = None,
) -> ChainProfile:
    """Measure each block of a chain: times (median of ``repeats``) and bytes kept for backward.

    :param blocks: an ``nn.Sequential``/``nn.ModuleList``/list of blocks; block ``i + 1`` takes the
        output of block ``i``.
    :param sample_input: the first block's input, of the shape used in training (the costs depend
        on batch and sequence length: profile again when they change).
    :param modes: which modes to measure, from ``("store-all", "selective", "recompute-cheap")``;
        store-all is required.
    :param same_blocks: the blocks are copies of one block (transformer layers): measure the first
        and reuse its costs for all, which is faster, free of timing noise between blocks, and lets
        the planner use its fast path. ``None``: decided by comparing the blocks' class, ``repr``,
        parameter shapes, and whether a block keeps its input's shape.
    :returns: a :class:`ChainProfile`.

    Memory: one block's activations at a time (and the chain's boundary activations). Runs each
    block ``(warmup + repeats)`` times per mode and for the no-store forward; synchronises a CUDA device.
    Gradients of the blocks' parameters are reset to ``None``.
    """
    blocks = as_block_list(blocks, "profile_blocks")
    modes = tuple(modes)
    if not modes or modes[0] != "store-all" or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"profile_blocks: modes must start with 'store-all' and be taken from {MODES}, got {modes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"profile_blocks: repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(f"profile_blocks: sample_input must be a tensor, got {type(sample_input).__name__}")
    device = sample_input.device
    x = sample_input.detach()
    prof = ChainProfile(modes, [], [], [], [_tensor_bytes(x)], [], [], [], device=str(device))
    if same_blocks is None:
        same_blocks = len(blocks) > 1 and _look_identical(blocks, x)
    if same_blocks:
        xi = x.clone().requires_grad_(x.is_floating_point())
        fwd, nostore, bwd, saved, ftmp, btmp, kept_out = _profile_one(blocks[0], xi, modes, repeats, warmup, device)
        n = len(blocks)

        def per_block(row: list) -> list:
            # a list of its own per block, not n references to one: editing one block's costs in
            # the returned profile must not change the others'
            return [list(row) for _ in range(n)]

        prof.fwd_time, prof.fwd_nostore_time, prof.bwd_time = per_block(fwd), [nostore] * n, per_block(bwd)
        prof.saved_bytes, prof.fwd_tmp_bytes, prof.bwd_tmp_bytes = per_block(saved), [ftmp] * n, per_block(btmp)
        prof.saved_bytes[-1] = [s + o for s, o in zip(saved, kept_out)]
        prof.input_bytes = [prof.input_bytes[0]] * (n + 1)
        prof.output_kept = per_block([int(o > 0) for o in kept_out])
        return prof
    for i, block in enumerate(blocks):
        xi = x.clone().requires_grad_(x.is_floating_point())
        fwd, nostore, bwd, saved, ftmp, btmp, kept_out = _profile_one(block, xi, modes, repeats, warmup, device)
        prof.output_kept.append([int(o > 0) for o in kept_out])
        if i == len(blocks) - 1:
            saved = [s + o for s, o in zip(saved, kept_out)]
        prof.fwd_time.append(fwd)
        prof.fwd_nostore_time.append(nostore)
        prof.bwd_time.append(bwd)
        prof.saved_bytes.append(saved)
        prof.fwd_tmp_bytes.append(ftmp)
        prof.bwd_tmp_bytes.append(btmp)
        with torch.no_grad():
            x = block(x)
        if not isinstance(x, torch.Tensor):
            raise TypeError("profile_blocks: each block must return one tensor (the next block's input)")
        prof.input_bytes.append(_tensor_bytes(x))
    return prof


def as_block_list(blocks, who: str) -> list:
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        blocks = list(blocks)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise TypeError(f"{who}: blocks must be a non-empty nn.Sequential, nn.ModuleList or list of modules")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"{who}: blocks[{i}] must be an nn.Module, got {type(b).__name__}")
    return list(blocks)
