"""Memory-budgeted activation checkpointing: measure a chain of blocks, plan it in C, run the plan.

* :func:`profile_blocks` measures, per block and per mode, forward and backward times (median of
  repeats) and the bytes autograd keeps for backward (every storage counted once, parameters and
  buffers excluded), on the CPU or a CUDA device.
* :func:`plan_checkpoints` hands those costs to the C planner (Rotor's dynamic program,
  csrc/plan/) and returns a :class:`CheckpointPlan`: which blocks run normally, which selectively,
  which inside (nested) checkpointed regions; with its predicted peak, held bytes and time.
* :func:`auto_checkpoint` does both and returns a module that runs the plan.

Modes of a block: ``"store-all"`` (autograd keeps its tape), ``"selective"`` (keeps matmul and
attention outputs, recomputes the rest: :mod:`llmmem.selective`), ``"recompute-cheap"`` (keeps the
tape but rebuilds in backward the tensors one elementwise operator or a LayerNorm makes from kept
ones, such as GELU outputs and dropped-out attention probabilities: :mod:`llmmem.remat`), and,
from regions of one block, ``"store-input-only"``. Budgets: bytes (``int``), a string (``"6GB"``,
``"512MiB"``) or a fraction (``float`` in (0, 1]) of the activation memory of the chain without
checkpointing.

With ``offload=True`` the planner may also keep the input of a top-level region in host memory
(``llmmem.checkpoint(offload=True)``): zero device bytes for that input between the region's forward
and its backward, at a transfer cost of ``bytes / host_bandwidth`` for the copy back (on the critical
path: these regions are not prefetched, so the memory model stays exact) plus whatever part of the
copy out is not hidden behind the region's own forward. That is what fits budgets below the
every-layer checkpointing minimum. The model is in csrc/include/llmmem/plan.h.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn

from llmmem import remat, selective
from llmmem._native import native
from llmmem.checkpointing import _offload_without_prefetch, checkpoint
from llmmem.errors import InfeasibleError
from llmmem.units import format_bytes, parse_bytes

__all__ = ["profile_blocks", "plan_checkpoints", "auto_checkpoint", "measure_saved_bytes", "ChainProfile",
           "CheckpointPlan", "AutoCheckpointed", "MODES", "measure_host_bandwidth", "DEFAULT_HOST_BANDWIDTH"]

MODES = ("store-all", "selective", "recompute-cheap")
_NESTABLE = {"store-all": 1, "selective": 0, "recompute-cheap": 0}
DEFAULT_SLOTS = None  # 2000 for identical blocks or short chains (cheap), else 500
# Bytes per second of a host<->device copy when none is measured: a PCIe 4.0 x16 link moves about
# 25 GB/s of pinned memory in practice (the theoretical 32 GB/s less protocol overhead). On the CPU
# there is no link at all (the "device" is host memory), so offload costs there are this model only.
DEFAULT_HOST_BANDWIDTH = 25e9


def _default_slots(profile) -> int:
    chain = profile.to_chain()
    identical = all(chain[k][i] == chain[k][0] for k in ("fwd_time", "bwd_time", "saved_bytes")
                    for i in range(profile.n_blocks))
    return 2000 if identical or profile.n_blocks <= 32 else 500


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
        active = selective._observers.__dict__.setdefault("active", [])
        active.append(self._record)
        return self

    def __exit__(self, *exc):
        selective._observers.active.remove(self._record)
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
    fwd_time: list            # [L][K] forward keeping the tape in mode k
    fwd_nostore_time: list    # [L] forward inside a checkpointed region (profile_blocks: mean with its recompute)
    bwd_time: list            # [L][K]
    input_bytes: list         # [L + 1]
    saved_bytes: list         # [L][K] beyond the block input
    fwd_tmp_bytes: list       # [L] (0 on the CPU: no allocator statistics there)
    bwd_tmp_bytes: list       # [L][K]
    device: str = "cpu"
    # [L][K] 1 where the block's tape in that mode keeps its own output (selective keeps a final
    # matmul's output, tanh keeps its result): offloading the next block's input would then free
    # nothing on the device. Empty: unknown, treated as all 0.
    output_kept: list = field(default_factory=list)

    def to_chain(self, host_bandwidth: float = 0.0) -> dict:
        """The dict the C planner takes (llmmem._C.plan_solve); ``host_bandwidth`` in bytes per
        second, 0 for no offloading."""
        return {"fwd_time": self.fwd_time, "fwd_nostore_time": self.fwd_nostore_time, "bwd_time": self.bwd_time,
                "input_bytes": self.input_bytes, "saved_bytes": self.saved_bytes,
                "fwd_tmp_bytes": self.fwd_tmp_bytes, "bwd_tmp_bytes": self.bwd_tmp_bytes,
                "mode_nestable": [_NESTABLE[m] for m in self.modes],
                "output_kept": self.output_kept or None, "host_bandwidth": float(host_bandwidth)}

    @property
    def n_blocks(self) -> int:
        return len(self.fwd_time)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
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


def _run_mode(block, x, mode: str, **checkpoint_options):
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
        return _run_mode(block, x, mode)

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
    medians = {m: (f0 + statistics.median(f - fb for (f, _), (fb, _) in zip(v, base)),
                   b0 + statistics.median(b - bb for (_, b), (_, bb) in zip(v, base))) for m, v in samples.items()}
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
        if type(b) is not type(first) or repr(b) != repr(first) or [(p.shape, p.dtype, p.device) for p in b.parameters()] != sig:
            return False
    with torch.no_grad():
        y = first(x)
    return isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype


def profile_blocks(blocks, sample_input, *, modes: Sequence[str] = MODES, repeats: int = 5, warmup: int = 1,
                   same_blocks: bool | None = None) -> ChainProfile:
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
    blocks = _as_block_list(blocks, "profile_blocks")
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


def _as_block_list(blocks, who: str) -> list:
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        blocks = list(blocks)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise TypeError(f"{who}: blocks must be a non-empty nn.Sequential, nn.ModuleList or list of modules")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"{who}: blocks[{i}] must be an nn.Module, got {type(b).__name__}")
    return list(blocks)


# --------------------------------------------------------------------------------------------
# Planning


@dataclass
class CheckpointPlan:
    """The planner's answer for one chain and budget (all byte figures are predictions).

    ``modes[i]`` is the mode block ``i`` keeps its tape in (inside a region: during the recompute);
    ``regions`` are the checkpointed ranges ``[start, end)`` in pre-order (outer before inner);
    ``offloaded`` the (top-level) ones among them whose input is kept in host memory. With
    offloading, ``predicted_time`` includes ``predicted_transfer_time`` (modelled from
    ``host_bandwidth``, bytes/s), and ``predicted_held_bytes`` counts device bytes only
    (``predicted_host_bytes`` are on the host).
    """

    modes: list
    regions: list
    budget_bytes: int
    min_budget_bytes: int
    predicted_peak_bytes: int
    predicted_held_bytes: int
    predicted_time: float
    predicted_overhead_time: float
    no_checkpoint_peak_bytes: int
    profile: ChainProfile = field(repr=False)
    offloaded: list = field(default_factory=list)
    predicted_transfer_time: float = 0.0
    predicted_host_bytes: int = 0
    host_bandwidth: float | None = None
    host_bandwidth_measured: bool = False

    @property
    def n_blocks(self) -> int:
        return len(self.modes)

    def depth(self, i: int) -> int:
        """How many regions contain block ``i``."""
        return sum(1 for s, e in self.regions if s <= i < e)

    def block_label(self, i: int) -> str:
        inner = [(s, e) for s, e in self.regions if s <= i < e]
        if not inner:
            return self.modes[i]
        host = ", input on host" if any(s <= i < e for s, e in self.offloaded) else ""
        if len(inner) == 1 and inner[0] == (i, i + 1):
            return "store-input-only" + host
        s, e = min(inner, key=lambda r: r[1] - r[0])
        return f"recomputed in [{s},{e}) depth {len(inner)}{host}"

    def describe(self) -> str:
        """A readable table of the plan and its predictions."""
        p = self.profile
        rows = [f"{'block':>5}  {'plan':<32} {'fwd ms':>8} {'bwd ms':>8} {'input':>11} {'kept (store-all)':>17}"]
        for i in range(self.n_blocks):
            k = p.modes.index(self.modes[i])
            rows.append(f"{i:>5}  {self.block_label(i):<32} {1e3 * p.fwd_time[i][k]:>8.3f} {1e3 * p.bwd_time[i][k]:>8.3f} "
                        f"{format_bytes(p.input_bytes[i]):>11} {format_bytes(p.saved_bytes[i][0]):>17}")
        base = self.predicted_time - self.predicted_overhead_time
        what = "recompute and transfers" if self.offloaded else "recompute"
        rows += ["",
                 f"budget                {format_bytes(self.budget_bytes)}  (least feasible "
                 f"{format_bytes(self.min_budget_bytes)}; no checkpointing needs {format_bytes(self.no_checkpoint_peak_bytes)})",
                 f"predicted peak        {format_bytes(self.predicted_peak_bytes)}",
                 f"held after forward    {format_bytes(self.predicted_held_bytes)}"
                 + (" on the device" if self.offloaded else ""),
                 f"predicted step time   {1e3 * self.predicted_time:.2f} ms  (+{100 * self.predicted_overhead_time / base:.1f}% "
                 f"{what} over no checkpointing)" if base > 0 else
                 f"predicted step time   {1e3 * self.predicted_time:.2f} ms",
                 f"regions               {self.regions if self.regions else 'none'}"]
        if self.host_bandwidth is not None:
            source = "measured" if self.host_bandwidth_measured else "assumed, not measured"
            if self.offloaded:
                rows += [f"offloaded to host     {self.offloaded}: {format_bytes(self.predicted_host_bytes)} "
                         f"on the host after the forward",
                         f"transfer time         {1e3 * self.predicted_transfer_time:.2f} ms of the step (modelled at "
                         f"{self.host_bandwidth / 1e9:.1f} GB/s, {source}: copy back not prefetched, copy out hidden "
                         f"behind the region's forward)"]
            else:
                rows.append(f"offloaded to host     none (allowed at {self.host_bandwidth / 1e9:.1f} GB/s, {source})")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.describe()


def _resolve_budget(budget, reference_peak: int, who: str) -> int:
    if isinstance(budget, bool):
        raise ValueError(f"{who}: budget must be bytes, a string like '6GB' or a fraction in (0, 1], got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"{who}: a fractional budget must be in (0, 1], got {budget!r}")
        return int(budget * reference_peak)
    return parse_bytes(budget, name=f"{who}: budget")


def measure_host_bandwidth(device="cpu", nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, bool]:
    """Bytes per second of a copy between pinned host memory and ``device``, and whether it was measured.

    On a CUDA device: the slower direction of ``nbytes`` copies each way (median of ``repeats``).
    On the CPU there is nothing to copy across, so :data:`DEFAULT_HOST_BANDWIDTH` is returned with
    ``measured=False``. Memory: ``nbytes`` on the device and pinned on the host, briefly;
    synchronises the device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_HOST_BANDWIDTH, False
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        seconds = _median_time(lambda: dst.copy_(src, non_blocking=True), repeats, device)
        rates.append(nbytes / max(seconds, 1e-9))
    del host, dev
    return min(rates), True


def plan_checkpoints(blocks, sample_input=None, budget=1.0, *, profile: ChainProfile | None = None,
                     slots: int = DEFAULT_SLOTS, fast_path: bool = True, offload: bool = False,
                     host_bandwidth: float | None = None, **profile_options) -> CheckpointPlan:
    """The fastest checkpointing plan for ``blocks`` whose predicted peak fits ``budget``.

    :param blocks: the chain (as for :func:`profile_blocks`); may be ``None`` with ``profile=``.
    :param sample_input: input of the first block (not needed with ``profile=``).
    :param budget: bytes, a string (``"6GB"``), or a fraction of the no-checkpoint peak.
    :param profile: reuse a :class:`ChainProfile` instead of measuring.
    :param slots: memory discretisation of the DP (more: closer to optimal, slower); default 2000
        for identical blocks or chains of at most 32 blocks, else 500.
    :param offload: also consider keeping the inputs of top-level regions in host memory (see the
        module docstring for the cost model); the plan says which in ``.offloaded``.
    :param host_bandwidth: bytes per second of a host<->device copy, for ``offload=True``. Default:
        measured on a CUDA device (:func:`measure_host_bandwidth`), :data:`DEFAULT_HOST_BANDWIDTH` on the CPU.
    :raises llmmem.InfeasibleError: (a ``ValueError``) when no plan fits; the message states the
        smallest feasible budget, also in ``.min_budget_bytes``.

    Memory and time: profiling (see :func:`profile_blocks`), then the C solver (milliseconds for
    identical blocks; O(L³·slots) otherwise), which runs without the GIL.
    """
    if not isinstance(offload, bool):
        raise ValueError(f"plan_checkpoints: offload must be True or False, got {offload!r}")
    if host_bandwidth is not None:
        if (isinstance(host_bandwidth, bool) or not isinstance(host_bandwidth, (int, float))
                or not math.isfinite(host_bandwidth) or host_bandwidth <= 0):
            raise ValueError(f"plan_checkpoints: host_bandwidth must be a finite number of bytes per second > 0, "
                             f"got {host_bandwidth!r}")
        if not offload:
            raise ValueError("plan_checkpoints: host_bandwidth is only used with offload=True")
    if profile is None:
        if blocks is None or sample_input is None:
            raise ValueError("plan_checkpoints: give blocks and sample_input, or profile=")
        profile = profile_blocks(blocks, sample_input, **profile_options)
    elif profile_options:
        raise ValueError(f"plan_checkpoints: {sorted(profile_options)} only apply when profiling (profile=None)")
    if slots is None:
        slots = _default_slots(profile)
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= 100000:
        raise ValueError(f"plan_checkpoints: slots must be an int in 1..100000, got {slots!r}")
    measured = False
    if offload and host_bandwidth is None:
        host_bandwidth, measured = measure_host_bandwidth(profile.device)
    chain = profile.to_chain(host_bandwidth if offload else 0.0)
    reference = native.plan_simulate(chain, [0] * profile.n_blocks, [])["peak_bytes"]
    budget_bytes = _resolve_budget(budget, reference, "plan_checkpoints")
    try:
        result = native.plan_solve(chain, budget_bytes, slots, fast_path=fast_path)
    except InfeasibleError:
        least = native.plan_min_budget(chain)
        with_offload = " with offloading" if offload else " (offload=True may lower it)"
        err = InfeasibleError(
            f"plan_checkpoints: no plan fits a budget of {budget_bytes} bytes ({format_bytes(budget_bytes)}); the smallest "
            f"feasible budget for these blocks and this input{with_offload} is {least} bytes ({format_bytes(least)}), "
            f"{100 * least / reference:.1f}% of the {format_bytes(reference)} needed without checkpointing")
        err.min_budget_bytes = least
        raise err from None
    return CheckpointPlan(modes=[profile.modes[k] for k in result["modes"]],
                          regions=[tuple(r) for r in result["regions"]], budget_bytes=budget_bytes,
                          min_budget_bytes=result["min_budget_bytes"], predicted_peak_bytes=result["peak_bytes"],
                          predicted_held_bytes=result["held_bytes"], predicted_time=result["time"],
                          predicted_overhead_time=result["overhead_time"], no_checkpoint_peak_bytes=reference,
                          profile=profile, offloaded=[tuple(r) for r in result["offloaded"]],
                          predicted_transfer_time=result["transfer_time"], predicted_host_bytes=result["host_bytes"],
                          host_bandwidth=float(host_bandwidth) if offload else None,
                          host_bandwidth_measured=measured)


# --------------------------------------------------------------------------------------------
# Running a plan


class _Step:
    """What iterating an :class:`AutoCheckpointed` yields: the first block of a top-level item runs
    the whole item; the other blocks of a region pass their input through (it is already done)."""

    def __init__(self, owner, item) -> None:
        self._owner, self._item = owner, item

    def __call__(self, x):
        return self._owner._run_item(self._item, x) if self._item is not None else x


class AutoCheckpointed(nn.ModuleList):
    """The blocks of a chain, run according to a :class:`CheckpointPlan`.

    A ``ModuleList`` of the original blocks (same ``state_dict`` keys, ``len``, indexing). Calling
    it runs the whole chain: ``y = module(x)``. Iterating it (``for block in model.layers: x =
    block(x)``, as most models' forward do) yields one callable per block that together run the
    plan: only valid when the loop passes each output straight to the next block.

    Memory: what the plan predicts (``.plan``); time: the plan's recompute overhead.
    """

    def __init__(self, blocks, plan: CheckpointPlan, **checkpoint_options) -> None:
        super().__init__(blocks)
        if len(self) != plan.n_blocks:
            raise ValueError(f"auto_checkpoint: the plan is for {plan.n_blocks} blocks, got {len(self)}")
        self.plan = plan
        self._options = checkpoint_options
        self._offloaded = set(plan.offloaded)
        self._items = self._build(0, len(self))

    def _build(self, s: int, e: int) -> list:
        """Items of the sequence [s, e): ("block", i) or ("region", start, end, inner items)."""
        # The regions directly inside [s, e): maximal ones among those strictly inside it.
        inside = sorted({r for r in self.plan.regions if s <= r[0] and r[1] <= e and r != (s, e)},
                        key=lambda r: (r[0], -r[1]))
        children, reach = {}, s
        for rs, re_ in inside:
            if rs >= reach:  # not nested in the previous maximal region
                children[rs] = re_
                reach = re_
        items, i = [], s
        while i < e:
            if i in children:
                items.append(("region", i, children[i], self._build(i, children[i])))
                i = children[i]
            else:
                items.append(("block", i))
                i += 1
        return items

    def _run_item(self, item, x):
        if item[0] == "block":
            i = item[1]
            return _run_mode(self[i], x, self.plan.modes[i], **self._options)
        _, start, end, inner = item
        if (start, end) in self._offloaded:
            with _offload_without_prefetch():
                return checkpoint(self._run_items, inner, x, **{**self._options, "offload": True})
        return checkpoint(self._run_items, inner, x, **self._options)

    def _run_items(self, items, x):
        for item in items:
            x = self._run_item(item, x)
        return x

    def forward(self, x):
        return self._run_items(self._items, x)

    def __iter__(self):
        firsts = {}
        for item in self._items:
            firsts[item[1]] = item
        return iter([_Step(self, firsts.get(i)) for i in range(len(self))])


def auto_checkpoint(blocks, sample_input, budget=0.5, *, slots: int = DEFAULT_SLOTS, profile: ChainProfile | None = None,
                    offload: bool = False, host_bandwidth: float | None = None, **options) -> AutoCheckpointed:
    """Profile ``blocks``, plan them for ``budget`` and return a module that runs the plan.

    ``model.layers = llmmem.auto_checkpoint(model.layers, x0, budget="6GB")``: the result is an
    ``nn.ModuleList`` of the same blocks (same parameters and state_dict keys). ``budget`` is
    bytes, a string like ``"6GB"``, or a fraction of the activation memory without checkpointing.
    ``offload=True`` lets the planner keep some regions' inputs in host memory (those in
    ``.plan.offloaded`` run as ``llmmem.checkpoint(offload=True)``); ``host_bandwidth`` as in
    :func:`plan_checkpoints`. ``options`` are passed to :func:`llmmem.checkpoint` for every region
    (``preserve_rng_state``, ``determinism_check``, ...). The plan is in ``.plan``
    (``print(module.plan.describe())``).

    Raises :class:`llmmem.InfeasibleError` (a ``ValueError``) stating the smallest feasible budget.
    """
    blocks = _as_block_list(blocks, "auto_checkpoint")
    plan = plan_checkpoints(blocks, sample_input, budget, slots=slots, profile=profile, offload=offload,
                            host_bandwidth=host_bandwidth)
    return AutoCheckpointed(blocks, plan, **options)
